"""The autoscaler's decision as a pure function: windows, no flapping, bounds, zero."""

from __future__ import annotations

import datetime as dt

import pytest

from placement.autoscale import Decision, Policy, Sample, Signals, decide, recommend

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def at(s: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=s)


INFLIGHT = Policy("inflight", minimum=1, maximum=10, target=4, up_window_s=0, down_window_s=60)
TTFT = Policy("ttft_p95", minimum=1, maximum=5, target=1.0, up_window_s=30, down_window_s=120)
QUEUE = Policy("queue", minimum=0, maximum=4, target=2, up_window_s=0, down_window_s=60)
TO_ZERO = Policy("inflight", minimum=0, maximum=3, target=4, up_window_s=0, down_window_s=300)


class Sim:
    """Runs decide() every `step` seconds as the reconciler would, keeping the history and the count."""

    def __init__(self, policy: Policy, current: int, step: float = 10.0) -> None:
        self.policy, self.current, self.step = policy, current, step
        self.history: list[Sample] = []
        self.t = 0.0
        self.steps: list[tuple[float, Decision]] = []

    def run(self, signals: Signals, seconds: float) -> list[int]:
        counts = []
        end = self.t + seconds
        while self.t < end:
            d = decide(self.policy, signals, self.current, self.history, now=at(self.t))
            self.history.append(Sample(at(self.t), d.recommended))
            if d.desired != self.current:
                self.steps.append((self.t, d))
            self.current = d.desired
            counts.append(self.current)
            self.t += self.step
        return counts


# recommend: the load alone


@pytest.mark.parametrize(
    ("inflight", "current", "expected"),
    [
        (0, 3, 1),  # idle: the minimum
        (4, 1, 1),  # on target
        (8, 1, 2),
        (9, 1, 3),  # 9/4 = 2.25 -> 3
        (12, 2, 3),
        (4, 2, 1),  # half the target per replica
        (100, 2, 10),  # capped at the maximum
        (17, 4, 4),  # 4.25 per replica: within the 10 % tolerance
        (18, 4, 5),  # 4.5 per replica: beyond it
    ],
)
def test_recommend_inflight(inflight, current, expected):
    assert recommend(INFLIGHT, Signals(inflight=inflight), current) == expected


def test_recommend_at_zero_counts_held_requests():
    assert recommend(TO_ZERO, Signals(held=1), 0) == 1
    assert recommend(TO_ZERO, Signals(held=9), 0) == 3
    assert recommend(TTFT, Signals(held=5), 0) == 1
    assert recommend(TO_ZERO, Signals(), 2) == 0


def test_recommend_ttft_follows_the_ratio_and_keeps_the_count_unmeasured():
    assert recommend(TTFT, Signals(inflight=3, ttft_p95_s=1.8), 2) == 4
    assert recommend(TTFT, Signals(inflight=3, ttft_p95_s=0.4), 3) == 2
    assert recommend(TTFT, Signals(inflight=3, ttft_p95_s=None), 3) == 3
    assert recommend(TTFT, Signals(inflight=3, ttft_p95_s=1.05), 3) == 3


def test_recommend_queue_never_drops_a_busy_deployment_to_zero():
    assert recommend(QUEUE, Signals(inflight=5, waiting=0.0), 2) == 1
    assert recommend(QUEUE, Signals(inflight=5, waiting=10.0), 2) == 4
    assert recommend(QUEUE, Signals(inflight=5, waiting=None), 2) == 2
    assert recommend(QUEUE, Signals(), 2) == 0


# decide: windows and reasons


def test_scale_up_with_no_window_is_immediate_with_its_reason():
    d = decide(INFLIGHT, Signals(inflight=12), 1, [], now=at(0))
    assert d == Decision(3, 3, 12.0, "12.0 requests in flight per replica > 4: 1 -> 3 replicas")


def test_ttft_scale_up_waits_for_the_window_and_says_how_long():
    sim = Sim(TTFT, current=2)
    hot = Signals(inflight=6, ttft_p95_s=1.8)
    # The history must reach back over the 30 s window before anything moves.
    assert sim.run(hot, 30) == [2, 2, 2]
    assert sim.run(hot, 10) == [4]
    t, d = sim.steps[0]
    assert t == 30
    assert d.reason == "TTFT p95 1.8 s > 1.0 s for 30 s: 2 -> 4 replicas"


def test_a_brief_spike_inside_the_up_window_does_not_scale():
    sim = Sim(TTFT, current=2)
    calm = Signals(inflight=2, ttft_p95_s=1.0)
    sim.run(calm, 60)
    sim.run(Signals(inflight=6, ttft_p95_s=3.0), 20)
    assert sim.run(calm, 60) == [2] * 6
    assert sim.steps == []


def test_scale_down_only_after_the_load_stayed_low_for_the_window():
    sim = Sim(INFLIGHT, current=3)
    low = Signals(inflight=2)
    counts = sim.run(low, 70)
    # 60 s of history are needed; the sample at 0 s is in effect at the window's start at 60 s.
    assert counts == [3, 3, 3, 3, 3, 3, 1]
    assert sim.steps[0][1].reason == "0.7 requests in flight per replica < 4 for 60 s: 3 -> 1 replicas"


def test_no_flapping_under_a_load_that_swings_faster_than_the_down_window():
    sim = Sim(INFLIGHT, current=1)
    for _ in range(10):
        sim.run(Signals(inflight=12), 20)
        sim.run(Signals(inflight=1), 30)
    # Up once to 3, and never down: a high sample is always inside the last 60 s.
    assert [(d.desired) for _, d in sim.steps] == [3]


def test_scale_down_takes_the_highest_recommendation_of_the_window():
    sim = Sim(INFLIGHT, current=5, step=10)
    sim.run(Signals(inflight=16), 30)  # recommends 4 (16/4): down from 5 only once the window is covered
    sim.run(Signals(inflight=4), 60)  # recommends 1, but the 4s are still in the window
    assert sim.current == 4
    sim.run(Signals(inflight=4), 30)
    assert sim.current == 1
    assert [d.desired for _, d in sim.steps] == [4, 1]


def test_a_fresh_history_never_scales_down():
    assert decide(INFLIGHT, Signals(), 3, [], now=at(0)) == Decision(3, 1, 0.0)


def test_history_older_than_the_window_covers_it_but_does_not_count():
    history = [Sample(at(-500), 9), Sample(at(-60), 1), Sample(at(-30), 1)]
    d = decide(INFLIGHT, Signals(), 3, history, now=at(0))
    assert d.desired == 1


# bounds


def test_below_the_minimum_or_above_the_maximum_is_corrected_at_once():
    assert decide(INFLIGHT, Signals(), 0, [], now=at(0)).reason == "below the minimum of 1: 0 -> 1 replicas"
    d = decide(INFLIGHT, Signals(inflight=100), 12, [], now=at(0))
    assert (d.desired, d.reason) == (10, "above the maximum of 10: 12 -> 10 replicas")


def test_the_maximum_caps_a_scale_up():
    assert decide(INFLIGHT, Signals(inflight=1000), 2, [], now=at(0)).desired == 10


def test_the_minimum_floors_a_scale_down():
    sim = Sim(INFLIGHT, current=4)
    sim.run(Signals(), 120)
    assert sim.current == 1


# zero


def test_idle_goes_to_zero_after_the_idle_window_and_says_so():
    sim = Sim(TO_ZERO, current=1, step=30)
    counts = sim.run(Signals(), 330)
    assert counts[-2:] == [1, 0]
    assert sim.steps == [(300.0, Decision(0, 0, 0.0, "no requests for 300 s: 1 -> 0 replicas"))]


def test_a_request_at_zero_starts_a_replica_at_once_whatever_the_up_window():
    slow = Policy("ttft_p95", minimum=0, maximum=3, target=1.0, up_window_s=600, down_window_s=300)
    d = decide(slow, Signals(held=2), 0, [], now=at(0))
    assert d == Decision(1, 1, None, "2 requests waiting at zero replicas: 0 -> 1 replicas")


def test_zero_stays_zero_while_idle():
    sim = Sim(TO_ZERO, current=0)
    assert sim.run(Signals(), 600) == [0] * 60
    assert sim.steps == []


def test_one_request_during_the_idle_window_restarts_it():
    sim = Sim(TO_ZERO, current=1, step=30)
    sim.run(Signals(), 270)
    sim.run(Signals(inflight=1), 30)
    assert sim.run(Signals(), 270) == [1] * 9
    assert sim.run(Signals(), 60)[-1] == 0


def test_no_further_scale_up_while_a_replica_is_still_starting():
    d = decide(INFLIGHT, Signals(inflight=40), 2, [], now=at(0), starting=1)
    assert (d.desired, d.recommended, d.reason) == (2, 10, "")
    # From zero it starts one whatever is pending, and the bounds still hold.
    assert decide(TO_ZERO, Signals(held=1), 0, [], now=at(0), starting=1).desired == 1
    assert decide(INFLIGHT, Signals(), 0, [], now=at(0), starting=1).desired == 1
