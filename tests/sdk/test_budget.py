"""RetryBudget: Finagle-style retry credit, driven by a fake clock."""

from __future__ import annotations

import threading

import pytest

from llm_backoff.budget import RetryBudget, WindowedCounter
from llm_backoff.limits import RetryBudgetLike


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def spend_all(budget: RetryBudget, limit: int = 10_000) -> int:
    spent = 0
    while spent < limit and budget.try_spend():
        spent += 1
    return spent


def test_is_a_retry_budget() -> None:
    assert isinstance(RetryBudget(), RetryBudgetLike)


def test_floor_alone_allows_min_per_second_times_ttl() -> None:
    budget = RetryBudget(ratio=0.1, min_per_second=2.0, ttl=5.0, clock=FakeClock())
    assert spend_all(budget) == 10
    assert budget.try_spend() is False


def test_first_attempts_earn_ratio_of_a_retry_each() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.2, min_per_second=0.0, ttl=10.0, clock=clock)
    assert budget.try_spend() is False
    for _ in range(50):
        budget.record_request()
    assert spend_all(budget) == 10
    for _ in range(4):
        budget.record_request()
    assert budget.try_spend() is False  # 0.8 of a retry is not a retry
    budget.record_request()
    assert budget.try_spend() is True


def test_deposits_and_withdrawals_expire_after_ttl() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.5, min_per_second=0.1, ttl=10.0, clock=clock)
    for _ in range(20):
        budget.record_request()
    assert spend_all(budget) == 11  # 1 (floor) + 10 (earned)
    clock.now += 10.0
    # Earned credit is gone, and so are the withdrawals: only the floor remains.
    assert budget.balance == pytest.approx(1.0)
    assert spend_all(budget) == 1


def test_during_an_outage_retries_stay_near_the_ratio() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.1, min_per_second=1.0, ttl=10.0, clock=clock)
    first = retries = 0
    for step in range(6000):  # 60 s at 100 first attempts per second, every one failing
        clock.now = 1000.0 + step * 0.01
        budget.record_request()
        first += 1
        retries += budget.try_spend()
    # At most ratio * first + floor (1/s * 60 s) + the initial reserve.
    assert retries <= 0.1 * first + 1.0 * 60 + 10
    assert retries >= 0.1 * first  # and the budget does get used


def test_threads_never_overspend() -> None:
    budget = RetryBudget(ratio=0.0, min_per_second=10.0, ttl=10.0, clock=FakeClock())
    granted: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        n = spend_all(budget, 1000)
        with lock:
            granted.append(n)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 100


@pytest.mark.parametrize(
    "kwargs",
    [{"ratio": -0.1}, {"ratio": float("nan")}, {"min_per_second": -1}, {"ttl": 0}, {"ttl": float("inf")}],
)
def test_invalid_settings_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RetryBudget"):
        RetryBudget(**kwargs)


def test_windowed_counter_forgets_old_slices() -> None:
    counter = WindowedCounter(window=1.0, slices=10)
    counter.add(0.05, 3)
    counter.add(0.55, 2)
    assert counter.total(0.95) == 5
    assert counter.total(1.06) == 2  # the first slice (0.0-0.1) left the window
    assert counter.total(5.0) == 0
