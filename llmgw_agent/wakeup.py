"""The agent's end of the wakeup: a long-poll held open so queued work is heard at once.

Commands reach the agent in heartbeat answers; heartbeats come every
`heartbeat_interval` seconds, so a command used to wait up to that long.
This thread holds GET /api/v1/agent/wait open (the control plane answers the
moment a command is queued for this node, or with 204 after ~25 s) and, on
work, sets the Event the loop's sleep waits on, so the next heartbeat goes
out now. One poll at a time per agent, always: the thread is the only caller.

Where it polls: agent.yaml's `wakeup_url`, else the gateway the control
plane names in its register and heartbeat answers (`wakeup_url`, from its
LLMGW_WAKEUP_URL or LLMGW_GATEWAY_LISTEN), else the control plane's own URL
(a reverse proxy in front of it may send the path to a gateway). So an agent
configured with nothing but `control_plane` uses the long-poll whenever a
gateway runs; `wakeup: false` in agent.yaml turns it off.

It is an optimisation, never a dependency: errors back off (with jitter, up
to a minute), a URL that does not serve the wakeup (404, or 501) is asked
again only every few minutes (at once when the control plane names another),
and throughout the heartbeat interval keeps working as before.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable
from typing import Any

import httpx

from llmgw_wire.shard_states import report_at_once

log = logging.getLogger("llmgw.agent.wakeup")

WAIT_PATH = "/api/v1/agent/wait"
# The server holds a quiet wait ~25 s; the read timeout leaves it room.
READ_TIMEOUT_S = 45.0
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 60.0
# A control plane that does not serve the wakeup is asked again this often
# (it may be upgraded, or get its Redis, without the agent restarting).
NOT_SERVED_RETRY_S = 300.0
# Between two wakeups: a burst of queued commands is fetched by one
# heartbeat, not one heartbeat each.
MIN_GAP_S = 0.05


def backoff(attempt: int, rng: random.Random) -> float:
    """Between half and all of min(cap, base * 2^(attempt-1)) seconds."""
    ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempt - 1))
    return ceiling * (0.5 + rng.random() / 2)


def shard_states(supervisor: Any) -> tuple[tuple[str, str], ...]:
    """Each shard's id and state: the loop compares two of these to report a change at once, not next interval."""
    return tuple((sid, str(s.state)) for sid, s in list(supervisor.shards.items()))


def worth_reporting_now(before: tuple[tuple[str, str], ...], after: tuple[tuple[str, str], ...]) -> bool:
    """Whether a shard moved, between two shard_states, in a way the control plane hears at once.

    A start's progress (starting, loading) waits for the next heartbeat
    (llmgw_wire/shard_states.py report_at_once).
    """
    old = dict(before)
    return any(old.get(sid) != state and report_at_once(old.get(sid), state) for sid, state in after)


class Listener:
    """A daemon thread holding the node's long-poll; sets `woken` when work is waiting."""

    def __init__(
        self,
        base_url: str,
        node_id: str,
        credential: Callable[[], str],
        *,
        woken: threading.Event,
        stop: threading.Event,
        gateway: Callable[[], str] | None = None,
        rng: random.Random | None = None,
        http: httpx.Client | None = None,
    ) -> None:
        # `base_url` is where to poll when `gateway` names none (the control plane's own URL).
        self.base_url = base_url.rstrip("/")
        self.gateway = gateway or (lambda: "")
        self.node_id = node_id
        self.credential = credential
        self.woken = woken
        self.stop = stop
        self.rng = rng or random.Random()
        self.http = http or httpx.Client(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=5.0))
        self.wakeups = 0
        self._thread: threading.Thread | None = None

    def url(self) -> str:
        """The base URL polled now: the gateway named, else `base_url`."""
        return (self.gateway() or self.base_url).rstrip("/")

    def start(self) -> Listener:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="agent-wakeup", daemon=True)
            self._thread.start()
        return self

    def poll(self) -> int:
        """One long-poll; the answer's status (0 when the control plane could not be reached)."""
        token = self.credential()
        if not token:
            return 401
        try:
            r = self.http.get(
                self.url() + WAIT_PATH, params={"node": self.node_id}, headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError as e:
            log.debug("wakeup: %s", e)
            return 0
        if r.status_code == 200:
            self.wakeups += 1
            self.woken.set()
        return r.status_code

    def run(self) -> None:
        """Poll until stopped."""
        failures = 0
        told: set[str] = set()
        while not self.stop.is_set():
            if not self.credential():
                # Not joined yet: no backoff to grow, the first credential is moments away.
                self.stop.wait(1.0)
                continue
            url = self.url()
            status = self.poll()
            if status in (200, 204):
                if url not in told:
                    told.add(url)
                    log.info("wakeup: long-poll held at %s%s; commands are heard at once", url, WAIT_PATH)
                failures = 0
                self.stop.wait(MIN_GAP_S)
            elif status in (404, 405, 501):
                if url not in told:
                    told.add(url)
                    log.info("%s", self.not_served(url, status))
                self._wait_for_another_url(url, NOT_SERVED_RETRY_S)
            else:
                # 401 too: the credential is being rotated or was reset, and
                # the heartbeat loop is sorting that out.
                failures += 1
                self.stop.wait(backoff(failures, self.rng))

    def not_served(self, url: str, status: int) -> str:
        """What the operator reads, once, when `url` does not serve the long-poll."""
        if self.gateway():
            return f"wakeup: {url} does not serve {WAIT_PATH} ({status}); commands arrive with heartbeats"
        return (
            f"wakeup: no gateway is configured (agent.yaml sets no wakeup_url and the control plane names none) "
            f"and {url} does not serve {WAIT_PATH} ({status}); commands arrive with heartbeats"
        )

    def _wait_for_another_url(self, url: str, seconds: float) -> None:
        """Wait `seconds`, or less when stopped or when the control plane names another gateway."""
        for _ in range(math.ceil(seconds)):
            if self.stop.wait(1.0) or self.url() != url:
                return

    def close(self) -> None:
        """Stop polling (the thread ends when its current poll does)."""
        self.stop.set()
        try:
            self.http.close()
        except Exception:
            log.debug("wakeup: closing the client", exc_info=True)
