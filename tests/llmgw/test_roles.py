"""The viewer and operator groups a real install gets from migrate."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command
from rest_framework.test import APIClient

from llmgw import roles

pytestmark = pytest.mark.django_db


def _codenames(group_name: str) -> set[str]:
    g = Group.objects.get(name=group_name)
    return {f"{p.content_type.app_label}.{p.codename}" for p in g.permissions.select_related("content_type")}


def _all(*, view_only: bool) -> set[str]:
    qs = Permission.objects.filter(content_type__app_label__in=["inventory", "placement", "agents", "gateway"])
    if view_only:
        qs = qs.filter(codename__startswith="view_")
    return {f"{p.content_type.app_label}.{p.codename}" for p in qs.select_related("content_type")}


def test_migrate_creates_both_groups_with_exactly_their_permissions():
    viewer, operator = _codenames(roles.VIEWER), _codenames(roles.OPERATOR)
    assert viewer == _all(view_only=True)
    assert operator == _all(view_only=False)
    assert {
        "inventory.view_node",
        "inventory.view_gpu",
        "placement.view_deployment",
        "agents.view_jointoken",
        "gateway.view_apikey",
    } <= viewer
    assert all(p.split(".")[1].startswith("view_") for p in viewer)
    assert {
        "inventory.cordon_node",
        "inventory.drain_node",
        "inventory.change_labels",
        "inventory.forget_node",
        "agents.add_jointoken",
        "agents.change_jointoken",
        "agents.change_nodecredential",
        "agents.delete_nodecredential",
        "placement.add_deployment",
    } <= operator
    assert viewer < operator
    # Nothing of Django's own apps: a role is not a way to make admins.
    assert not any(p.startswith(("auth.", "admin.", "contenttypes.", "sessions.")) for p in operator)


def test_migrate_again_restores_the_groups_and_duplicates_nothing():
    g = Group.objects.get(name=roles.OPERATOR)
    g.permissions.remove(Permission.objects.get(codename="cordon_node"))
    Group.objects.get(name=roles.VIEWER).permissions.add(Permission.objects.get(codename="drain_node"))
    call_command("migrate", verbosity=0)
    assert Group.objects.filter(name__in=[roles.VIEWER, roles.OPERATOR]).count() == 2
    assert _codenames(roles.OPERATOR) == _all(view_only=False)
    assert _codenames(roles.VIEWER) == _all(view_only=True)


def test_ensure_roles_counts():
    counts = roles.ensure_roles()
    assert counts == {roles.VIEWER: len(_all(view_only=True)), roles.OPERATOR: len(_all(view_only=False))}


@pytest.mark.parametrize(("group", "cordon_status"), [(roles.VIEWER, 403), (roles.OPERATOR, 200)])
def test_group_members_may_look_and_only_operators_act(django_user_model, now, group, cordon_status):
    from tests.factories import make_node

    make_node("node-a", now=now)
    user = django_user_model.objects.create_user("someone", password="pw-someone-1")
    user.groups.add(Group.objects.get(name=group))
    c = APIClient()
    c.force_authenticate(user)
    resp = c.get("/api/v1/nodes/")
    assert resp.status_code == 200
    assert [n["id"] for n in resp.json()["results"]] == ["node-a"]
    resp = c.post("/api/v1/nodes/node-a/cordon/", {"reason": "fan"}, format="json")
    assert resp.status_code == cordon_status
    from inventory.models import Node

    assert Node.objects.get(id="node-a").state == ("cordoned" if cordon_status == 200 else "ready")


def test_ensure_admin_names_the_groups(tmp_path, settings, capsys):
    settings.VAR_DIR = tmp_path
    Group.objects.filter(name=roles.VIEWER).delete()
    call_command("ensure_admin")
    out = capsys.readouterr().out
    n_view, n_all = len(_all(view_only=True)), len(_all(view_only=False))
    assert (
        f"roles: group 'llmgw viewer' looks ({n_view} permissions), "
        f"group 'llmgw operator' looks and acts ({n_all} permissions); put people in them at /admin/auth/user/"
    ) in out
    assert _codenames(roles.VIEWER) == _all(view_only=True)
