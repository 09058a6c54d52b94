"""Leases while a status waits: a node's liveness never queues behind its own status.

A status (a full heartbeat, about 9 KB) is answered by the control plane's
web tier, a lease by its gateway's batched writer (llmgw_wire/lease.py). The
loop sends one message at a time, so while a status waits in a busy web
tier's queue the node renews nothing: its silence, as the liveness sweep
reads it, is the interval before the status plus the whole wait. At 10,000
nodes a scale-up kept statuses queued for up to 11 s (the minute's status
floors of a join storm, and every shard's ready, all at the web), and live
nodes were judged unreachable behind their own statuses, though the
gateway's lease path was half idle all along.

Kubernetes' kubelet renews its node Lease from a loop of its own for the
same reason: a slow NodeStatus update must never make a node look dead. Here
a lease goes to the gateway once a status has been unanswered for AFTER_S,
and again every interval while it stays unanswered. A status answered within
AFTER_S (any control plane that keeps up) costs nothing more.

Such a lease carries no acks (they ride in the status, which is still in
flight) and its answer is left alone: commands stay pending until
acknowledged, so the status's own answer carries them again, and a
`send_status` is what is already happening. It goes to the gateway only,
never to the control plane's own lease endpoint, which sits in the same
queue as the status it would stand in for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("llmgw.agent")

# A status is answered in milliseconds by a control plane that keeps up; one unanswered for a second
# is queued. The node's silence is then at most an interval and AFTER_S, well under the unreachable delay.
AFTER_S = 1.0


class Keepalive:
    """A thread that calls `send` while a status is in flight: AFTER_S after it began, then every `every()` s.

    `send` is the agent's (a lease to the gateway); what it raises is logged. The
    thread starts on the first status, so an agent that never sends one has
    none.
    """

    def __init__(self, send: Callable[[], None], *, every: Callable[[], float], after_s: float = AFTER_S) -> None:
        self.send = send
        self.every = every
        self.after_s = after_s
        self._cond = threading.Condition()
        # The status in flight: its number and when it began (monotonic); None when none is.
        self._flight: tuple[int, float] | None = None
        self._count = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        # Leases sent while statuses waited, for the tests and the logs.
        self.sent = 0

    @contextmanager
    def during(self) -> Iterator[None]:
        """Around one status's request: leases go while it waits, none once it is answered or failed."""
        with self._cond:
            self._count += 1
            self._flight = (self._count, time.monotonic())
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="llmgw-keepalive", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._flight = None
                self._cond.notify()

    def _run(self) -> None:
        sent_for: tuple[int, int] = (0, 0)  # (the status's number, leases sent for it)
        while True:
            with self._cond:
                if self._closed:
                    return
                if self._flight is None:
                    self._cond.wait()
                    continue
                number, began = self._flight
                done = sent_for[1] if sent_for[0] == number else 0
                left = began + self.after_s + done * self.every() - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                sent_for = (number, done + 1)
            try:
                self.send()
            except Exception:
                # A lease is a courtesy while the status waits; the status itself still decides.
                log.exception("lease while a status waits")
            self.sent += 1

    def close(self) -> None:
        """Stop the thread (a lease being sent finishes)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5)
