"""Numbers on the wire are finite, and a join token's refusal names no one."""

from __future__ import annotations

import json

import pytest

from agents.models import NodeCredential
from tests.agents.conftest import heartbeat_payload, post
from tests.factories import register_payload

pytestmark = pytest.mark.django_db

NOT_YOURS = {"detail": "this credential does not authorise requests about that node", "errors": []}


def _with_at(payload: dict, literal: str) -> str:
    # json.dumps writes NaN and Infinity itself; 1e400 it cannot write, so the text is spliced.
    return json.dumps({**payload, "at": "AT"}).replace('"AT"', literal)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_a_heartbeat_at_that_is_not_a_finite_number_is_400_naming_it(client, joined, literal):
    resp = post(client, "heartbeat", _with_at(heartbeat_payload(), literal), joined)
    assert resp.status_code == 400, resp.content
    assert resp.json()["errors"] == [{"field": "at", "problem": "Input should be a finite number"}]


@pytest.mark.parametrize("literal", ["NaN", "1e400"])
def test_non_finite_numbers_are_refused_in_every_message(client, joined, literal):
    sensors = {"gpus": [{"index": 0, "wear": {"last_xid_at": "X"}}]}
    body = json.dumps({**heartbeat_payload(), **sensors}).replace('"X"', literal)
    resp = post(client, "heartbeat", body, joined)
    assert resp.status_code == 400, resp.content
    assert [e["field"] for e in resp.json()["errors"]] == ["gpus.0.wear.last_xid_at"]
    reg = json.dumps({**register_payload("node-a"), "at": "X"}).replace('"X"', literal)
    resp = post(client, "register", reg, joined)
    assert resp.status_code == 400, resp.content
    assert [e["field"] for e in resp.json()["errors"]] == ["at"]


def test_a_join_tokens_refusal_for_a_node_with_a_credential_names_no_one(client, join_token, joined):
    taken = post(client, "register", register_payload("node-a"), join_token)
    assert taken.status_code == 403
    # The words any other node's refusal has: nothing says that node-a exists or holds a credential.
    assert taken.json() == NOT_YOURS
    assert b"node-a" not in taken.content and b"credential" not in taken.content.replace(b"this credential", b"")
    assert NodeCredential.objects.filter(node_id="node-a").count() == 1
