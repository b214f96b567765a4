"""Per-request fault draws for the simulator: pure, from an injected ``random.Random``."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .config import SimConfig


@dataclass(frozen=True)
class FaultPlan:
    """What goes wrong with one request (``NO_FAULT`` when nothing does)."""

    error: bool = False
    reset: bool = False
    first_byte_delay: float = 0.0
    cut_after: int | None = None

    @property
    def any(self) -> bool:
        return self.error or self.reset or self.first_byte_delay > 0 or self.cut_after is not None


NO_FAULT = FaultPlan()


def plan_faults(config: SimConfig, rng: random.Random, *, max_tokens: int, stream: bool) -> FaultPlan:
    """Draw this request's faults.

    A 500 and a reset exclude each other (one uniform draw split by the two rates); a
    slow first byte can come on top of either, and a stream cut only applies to streams
    long enough to be cut between two tokens (``cut_after`` in ``1..max_tokens-1``).
    Draws are skipped for zero rates, so a fault-free config consumes no randomness.
    """
    error = reset = False
    if config.error_rate > 0 or config.reset_rate > 0:
        u = rng.random()
        error = u < config.error_rate
        reset = not error and u < config.error_rate + config.reset_rate
    delay = 0.0
    if config.slow_first_byte_rate > 0 and rng.random() < config.slow_first_byte_rate:
        delay = config.slow_first_byte_delay
    cut_after: int | None = None
    if (
        stream
        and not (error or reset)
        and max_tokens > 1
        and config.stream_cut_rate > 0
        and rng.random() < config.stream_cut_rate
    ):
        cut_after = rng.randint(1, max_tokens - 1)
    if not (error or reset or delay or cut_after is not None):
        return NO_FAULT
    return FaultPlan(error=error, reset=reset, first_byte_delay=delay, cut_after=cut_after)
