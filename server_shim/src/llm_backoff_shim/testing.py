"""Test helpers for code that takes a clock: the shim's pure decision logic is tested without sleeping."""

from __future__ import annotations


class ManualClock:
    """A monotonic clock that moves only when the test moves it (set ``now``, or ``advance``)."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
