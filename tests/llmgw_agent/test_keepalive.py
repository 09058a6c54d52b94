"""Leases while a status waits (llmgw_agent/keepalive.py): when they go, and that they stop."""

from __future__ import annotations

import threading
import time

from llmgw_agent.keepalive import Keepalive


class Sends:
    """What the keepalive sent, with when (monotonic), and a way to wait for the n-th."""

    def __init__(self, *, fail: bool = False) -> None:
        self.at: list[float] = []
        self.fail = fail
        self.cond = threading.Condition()

    def __call__(self) -> None:
        with self.cond:
            self.at.append(time.monotonic())
            self.cond.notify_all()
        if self.fail:
            raise RuntimeError("the gateway went away")

    def wait_for(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.at) >= n, timeout=10), f"{len(self.at)} of {n} sent"


def test_a_status_answered_in_time_sends_nothing_and_starts_no_thread_before_the_first_status():
    sends = Sends()
    keep = Keepalive(sends, every=lambda: 5.0, after_s=60.0)
    assert keep._thread is None
    with keep.during():
        pass
    keep.close()
    assert (sends.at, keep.sent) == ([], 0)


def test_a_waiting_status_sends_a_lease_after_the_delay_then_one_every_interval():
    sends = Sends()
    keep = Keepalive(sends, every=lambda: 0.15, after_s=0.1)
    try:
        began = time.monotonic()
        with keep.during():
            sends.wait_for(3)
        # On a cadence from the status's start: the k-th no sooner than the delay and k intervals.
        assert [t - began >= 0.1 + 0.15 * k for k, t in enumerate(sends.at[:3])] == [True] * 3
    finally:
        keep.close()


def test_each_status_counts_its_own_delay_and_a_failed_send_does_not_end_the_thread(caplog):
    sends = Sends(fail=True)
    keep = Keepalive(sends, every=lambda: 60.0, after_s=0.1)
    try:
        with keep.during():
            sends.wait_for(1)
        began = time.monotonic()
        with keep.during():
            sends.wait_for(2)
        # The second status's lease came its own delay after it began, not an interval after the first's.
        assert sends.at[1] - began >= 0.1
        assert sends.at[1] - sends.at[0] < 60.0
        assert "lease while a status waits" in caplog.text
    finally:
        keep.close()
    assert keep._thread is not None and not keep._thread.is_alive()
