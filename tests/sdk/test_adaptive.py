"""CUBIC adaptive rate (AWS SDK adaptive mode), driven by a fake clock; no sleeping."""

from __future__ import annotations

import itertools
import math

import pytest

from llm_backoff.adaptive import AdaptiveRate, SendRateMeter
from llm_backoff.ratelimit import BucketState, RateLimiter


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def feed(ctl: AdaptiveRate, clock: FakeClock, *, rps: float, seconds: float) -> None:
    """Successful responses at a steady rate."""
    for _ in range(round(rps * seconds)):
        clock.now += 1.0 / rps
        ctl.on_response(throttled=False)


def test_meter_tracks_a_steady_rate() -> None:
    meter = SendRateMeter()
    for i in range(1, 201):
        meter.record(i * 0.05)  # 20 per second for 10 s
    assert meter.rate == pytest.approx(20.0, rel=0.01)


def test_meter_estimates_before_its_first_bucket_completes() -> None:
    meter = SendRateMeter(bucket_span=0.5)
    # Created long before traffic: idle time before the first event does not count.
    for i in range(8):
        meter.record(100.0 + i * 0.01)  # 8 events in 70 ms, within one bucket
    assert meter.rate == pytest.approx(8 / 0.07)
    meter2 = SendRateMeter(bucket_span=0.5)
    assert meter2.record(5.0) == pytest.approx(1 / 0.05)  # one event: a tenth of a span


def test_starts_unthrottled_and_enables_on_first_throttle() -> None:
    clock = FakeClock()
    ctl = AdaptiveRate(clock=clock, ceiling=100.0)
    feed(ctl, clock, rps=10.0, seconds=3.0)
    assert ctl.enabled is False
    measured = ctl.measured_rate
    assert measured == pytest.approx(10.0, rel=0.05)
    clock.now += 0.01
    rate = ctl.on_response(throttled=True)
    assert ctl.enabled is True
    # Multiplicative decrease from what was really being sent, not from the ceiling.
    assert rate == pytest.approx(0.7 * ctl.measured_rate)
    assert rate < measured


def test_cubic_recovery_reaches_the_last_throttle_point_after_k_seconds() -> None:
    clock = FakeClock()
    ctl = AdaptiveRate(clock=clock, ceiling=1000.0)
    feed(ctl, clock, rps=20.0, seconds=3.0)
    clock.now += 0.05
    ctl.on_response(throttled=True)
    w_max = ctl.measured_rate
    k = (w_max * (1 - 0.7) / 0.4) ** (1 / 3)
    throttle_at = clock.now
    rates = []
    while clock.now < throttle_at + k - 0.1:
        feed(ctl, clock, rps=20.0, seconds=0.1)
        rates.append(ctl.rate)
    # Concave climb: increasing, fast first, and still below w_max just before K.
    assert all(b >= a for a, b in itertools.pairwise(rates))
    assert rates[0] < w_max
    assert rates[-1] < w_max
    assert rates[1] - rates[0] > rates[-1] - rates[-2]
    clock.now = throttle_at + k
    assert ctl.on_response(throttled=False) == pytest.approx(w_max, rel=0.02)


def test_rate_never_exceeds_ceiling_or_twice_the_measured_rate() -> None:
    clock = FakeClock()
    ctl = AdaptiveRate(clock=clock, ceiling=15.0)
    feed(ctl, clock, rps=10.0, seconds=2.0)
    ctl.on_response(throttled=True)
    feed(ctl, clock, rps=10.0, seconds=60.0)  # long after: the cubic term is huge
    assert ctl.rate == 15.0
    ctl2 = AdaptiveRate(clock=clock)
    feed(ctl2, clock, rps=4.0, seconds=2.0)
    ctl2.on_response(throttled=True)
    feed(ctl2, clock, rps=4.0, seconds=60.0)
    assert ctl2.rate == pytest.approx(2 * ctl2.measured_rate)


def test_rate_never_below_floor() -> None:
    clock = FakeClock()
    ctl = AdaptiveRate(clock=clock, floor=0.5)
    for _ in range(20):
        clock.now += 0.01
        ctl.on_response(throttled=True)  # throttled before anything was measured
    assert ctl.rate == 0.5


@pytest.mark.parametrize(
    "kwargs",
    [{"floor": 0.0}, {"floor": math.nan}, {"ceiling": 0.1, "floor": 1.0}, {"beta": 1.0}, {"scale": -1.0}],
)
def test_invalid_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"floor|ceiling|beta|scale"):
        AdaptiveRate(clock=FakeClock(), **kwargs)


def simulate_fleet(
    *, clients: int, capacity: float, demand: float, seconds: float, adaptive: bool
) -> tuple[float, float, list[float]]:
    """Greedy clients against a server that admits ``capacity`` requests/s and 429s the rest.

    Returns (admitted per second, share of sent requests throttled) over the second
    half, and the admitted rate per 5 s window of the second half.
    """
    clock = FakeClock(0.0)
    dt = 0.005
    server = BucketState(capacity, max(1.0, capacity * 0.1), max(1.0, capacity * 0.1), 0.0)
    limiters = [
        RateLimiter(adaptive=True, clock=clock) if adaptive else RateLimiter(requests_per_second=1e9)
        for _ in range(clients)
    ]
    backlog = [0.0] * clients
    ok = sent = 0
    windows: list[float] = []
    window_ok = 0
    steps = round(seconds / dt)
    for step in range(steps):
        clock.now = step * dt
        second_half = step >= steps // 2
        if second_half and step % round(5.0 / dt) == 0 and step != steps // 2:
            windows.append(window_ok / 5.0)
            window_ok = 0
        for i, limiter in enumerate(limiters):
            backlog[i] = min(backlog[i] + demand * dt, 5.0)
            while backlog[i] >= 1.0:
                permit = limiter.try_acquire()
                if permit is None:
                    break
                backlog[i] -= 1.0
                server.refill(clock.now)
                admitted = server.tokens >= 1.0
                if admitted:
                    server.take(1.0)
                permit.settle(status=200 if admitted else 429, body=None)
                if second_half:
                    sent += 1
                    ok += admitted
                    window_ok += admitted
    half = seconds / 2
    return ok / half, (sent - ok) / max(sent, 1), windows


def test_fleet_converges_near_capacity_instead_of_hammering() -> None:
    capacity = 50.0
    admitted, throttled, windows = simulate_fleet(
        clients=4, capacity=capacity, demand=75.0, seconds=60.0, adaptive=True
    )
    blind_admitted, blind_throttled, _ = simulate_fleet(
        clients=4, capacity=capacity, demand=75.0, seconds=60.0, adaptive=False
    )
    # Without adaptation: 300/s offered, 50/s served, 5 of 6 requests rejected.
    assert blind_throttled > 0.8
    assert blind_admitted <= capacity * 1.05
    # With it: the server stays busy, and few requests are wasted on 429s.
    assert admitted >= 0.9 * capacity
    assert throttled < 0.1
    # No 5 s window collapses far below capacity (no saw-tooth between extremes).
    assert min(windows) >= 0.85 * capacity
