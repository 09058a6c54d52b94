"""The agent's long-poll: what each answer does, and the loop's sleep cut short by work or a shard's change."""

from __future__ import annotations

import logging
import random
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from llmgw_agent import config as config_mod
from llmgw_agent import wakeup as wakeup_mod
from llmgw_agent.loop import Agent
from llmgw_agent.wakeup import WAIT_PATH, Listener, shard_states, worth_reporting_now


def listener(answers: list, *, token: str = "llmgw-node-secret") -> tuple[Listener, list[httpx.Request]]:
    """A Listener whose control plane answers each poll with the next of `answers` (a status, or an exception)."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers.pop(0) if answers else 204
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, json={"work": True} if answer == 200 else None)

    http = httpx.Client(base_url="http://cp", transport=httpx.MockTransport(handle))
    lst = Listener(
        "http://cp",
        "gpu-01",
        lambda: token,
        woken=threading.Event(),
        stop=threading.Event(),
        rng=random.Random(3),
        http=http,
    )
    return lst, seen


def test_work_sets_the_event_and_the_poll_names_its_node_with_its_credential():
    lst, seen = listener([200])
    assert lst.poll() == 200
    assert lst.woken.is_set() and lst.wakeups == 1
    (r,) = seen
    assert r.url.path == WAIT_PATH and r.url.params["node"] == "gpu-01"
    assert r.headers["authorization"] == "Bearer llmgw-node-secret"


def test_nothing_waiting_leaves_the_event_alone():
    lst, _ = listener([204])
    assert lst.poll() == 204
    assert not lst.woken.is_set()


def test_no_credential_yet_sends_nothing():
    lst, seen = listener([200], token="")
    assert lst.poll() == 401
    assert seen == [] and not lst.woken.is_set()


def test_an_unreachable_control_plane_is_a_status_of_zero():
    lst, _ = listener([httpx.ConnectError("refused")])
    assert lst.poll() == 0


def waits_of(lst: Listener, polls: int) -> list[float]:
    """The pauses `run` takes between `polls` polls (the stop event's waits, recorded instead of slept)."""
    pauses: list[float] = []

    def fake_wait(seconds: float) -> bool:
        pauses.append(seconds)
        if len(pauses) >= polls:
            lst.stop.set()
        return lst.stop.is_set()

    lst.stop.wait = fake_wait  # type: ignore[method-assign]
    lst.run()
    return pauses


def test_errors_back_off_growing_and_a_success_resets_it():
    lst, _ = listener([httpx.ConnectError("x"), 500, 401, 204, 500])
    pauses = waits_of(lst, 5)
    rng = random.Random(3)
    expected = [wakeup_mod.backoff(n, rng) for n in (1, 2, 3)]
    assert pauses[:3] == expected and pauses[0] < pauses[1] < pauses[2]
    assert pauses[3] == wakeup_mod.MIN_GAP_S
    assert pauses[4] == wakeup_mod.backoff(1, rng)


def test_backoff_is_capped():
    rng = random.Random(1)
    assert max(wakeup_mod.backoff(n, rng) for n in range(1, 30)) <= wakeup_mod.BACKOFF_CAP_S


@pytest.mark.parametrize("status", [404, 405, 501])
def test_a_control_plane_without_the_wakeup_is_asked_again_only_every_few_minutes(status, caplog):
    lst, seen = listener([status, status])
    retry = int(wakeup_mod.NOT_SERVED_RETRY_S)
    with caplog.at_level(logging.INFO, logger="llmgw.agent.wakeup"):
        pauses = waits_of(lst, retry + 1)
    # One-second waits (so a gateway named meanwhile is polled at once), a poll after each few minutes.
    assert pauses == [1.0] * (retry + 1)
    assert len(seen) == 2
    # Said once, plainly: nobody named a gateway.
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == (
        "wakeup: no gateway is configured (agent.yaml sets no wakeup_url and the control plane names none) "
        f"and http://cp does not serve {WAIT_PATH} ({status}); commands arrive with heartbeats"
    )


def test_the_first_answer_of_each_url_is_said_once(caplog):
    lst, _ = listener([204, 200, 204])
    with caplog.at_level(logging.INFO, logger="llmgw.agent.wakeup"):
        waits_of(lst, 3)
    assert caplog.messages == [f"wakeup: long-poll held at http://cp{WAIT_PATH}; commands are heard at once"]


def test_a_gateway_named_meanwhile_is_polled_at_once():
    lst, seen = listener([404, 204])
    named = []
    lst.gateway = lambda: named[0] if named else ""

    def fake_wait(seconds: float) -> bool:
        named.append("http://gw:8080")  # the control plane's next answer names its gateway
        if len(seen) >= 2:
            lst.stop.set()
        return lst.stop.is_set()

    lst.stop.wait = fake_wait  # type: ignore[method-assign]
    lst.run()
    assert [str(r.url.copy_with(query=None)) for r in seen] == ["http://cp" + WAIT_PATH, "http://gw:8080" + WAIT_PATH]


def test_one_poll_at_a_time_the_thread_starts_once():
    lst, _ = listener([])
    lst.stop.set()  # the thread ends at once
    first = lst.start()._thread
    assert lst.start()._thread is first


def test_shard_states_sees_a_change_of_state():
    sup = SimpleNamespace(shards={"s1": SimpleNamespace(state="loading")})
    before = shard_states(sup)
    sup.shards["s1"].state = "ready"
    assert shard_states(sup) != before


@pytest.fixture
def agent(tmp_path):
    cfg = config_mod.parse(
        {
            "control_plane": "http://127.0.0.1:9",
            "join_token": "j",
            "node_id": "gpu-01",
            "state_dir": str(tmp_path / "state"),
        }
    )
    a = Agent(cfg, probe=object())
    yield a
    a.close()


def test_the_loops_sleep_ends_when_work_is_waiting(agent):
    threading.Timer(0.2, agent.woken.set).start()
    t0 = time.monotonic()
    agent._wait(30)
    assert time.monotonic() - t0 < 5
    assert not agent.woken.is_set()  # consumed: the next sleep is a whole one


def test_the_loops_sleep_ends_when_a_shard_changes_state(agent, monkeypatch):
    shards = {"s1": SimpleNamespace(state="loading")}
    monkeypatch.setattr(agent.supervisor, "shards", shards)

    def poll():
        shards["s1"].state = "ready"

    monkeypatch.setattr(agent.supervisor, "poll", poll)
    t0 = time.monotonic()
    agent._wait(30)
    assert time.monotonic() - t0 < 5


def test_a_starts_progress_waits_for_the_next_heartbeat_but_ready_and_ends_do_not(agent, monkeypatch):
    shards = {"s1": SimpleNamespace(state="starting")}
    monkeypatch.setattr(agent.supervisor, "shards", shards)
    polls: list[float] = []

    def poll():
        polls.append(time.monotonic())
        shards["s1"].state = "loading"

    monkeypatch.setattr(agent.supervisor, "poll", poll)
    t0 = time.monotonic()
    agent._wait(2.5)
    # Loading changes nothing the control plane acts on: the whole wait, polled every second.
    assert time.monotonic() - t0 >= 2.5 and len(polls) >= 2


@pytest.mark.parametrize(
    ("before", "after", "now"),
    [
        ((("s1", "starting"),), (("s1", "loading"),), False),
        ((("s1", "pending"),), (("s1", "starting"),), False),
        ((), (("s1", "starting"),), False),
        ((("s1", "loading"),), (("s1", "ready"),), True),
        ((("s1", "starting"),), (("s1", "failed"),), True),
        ((("s1", "ready"),), (("s1", "stopped"),), True),
        # A ready engine loading again stops serving: the gateway must hear it now.
        ((("s1", "ready"),), (("s1", "loading"),), True),
        ((("s1", "ready"), ("s2", "starting")), (("s1", "ready"), ("s2", "loading")), False),
        ((("s1", "ready"), ("s2", "loading")), (("s1", "draining"), ("s2", "loading")), True),
        ((("s1", "ready"),), (("s1", "ready"),), False),
    ],
)
def test_which_moves_are_reported_at_once(before, after, now):
    assert worth_reporting_now(before, after) is now


def test_wakeup_url_is_checked_and_defaults_to_the_control_plane():
    base = {"control_plane": "http://cp:8000/", "join_token": "j", "node_id": "n1"}
    assert config_mod.parse(base).wakeup_url == ""
    assert config_mod.parse(base).wakeup is True
    assert config_mod.parse({**base, "wakeup": False}).wakeup is False
    with pytest.raises(config_mod.ConfigError, match="wakeup must be true or false"):
        config_mod.parse({**base, "wakeup": "no"})
    assert config_mod.parse({**base, "wakeup_url": "http://cp:8080/"}).wakeup_url == "http://cp:8080"
    with pytest.raises(config_mod.ConfigError, match="wakeup_url must be an http"):
        config_mod.parse({**base, "wakeup_url": "cp:8080"})


def test_simulated_nodes_are_told_where_the_wakeup_is(tmp_path):
    from llmgw_sim.simulate import prepare_node

    token = tmp_path / "token"
    token.write_text("j")
    kw = {"profile": "cpu-only", "workdir": tmp_path, "control_plane": "http://cp:8000", "token_file": token}
    with_wakeup = prepare_node(index=0, wakeup_url="http://cp:8080", **kw)
    without = prepare_node(index=1, **kw)
    assert config_mod.load(with_wakeup.config).wakeup_url == "http://cp:8080"
    assert config_mod.load(without.config).wakeup_url == ""


def test_before_the_first_join_it_waits_without_backing_off():
    lst, seen = listener([], token="")
    assert waits_of(lst, 3) == [1.0, 1.0, 1.0]
    assert seen == []
