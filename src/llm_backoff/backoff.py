"""How long to wait before the next attempt.

Without a server hint: exponential from ``base_delay`` (``base * 2**retry``),
capped at ``max_delay``, then jittered as in the AWS Architecture Blog post
"Exponential Backoff And Jitter":

- ``full``:         ``uniform(0, capped)``
- ``equal``:        ``capped/2 + uniform(0, capped/2)``
- ``decorrelated``: ``min(max_delay, uniform(base, previous_wait * 3))``
- ``none``:         ``capped``

With a positive server hint the hint is a floor: ``hint + uniform(0,
retry_after_jitter * hint)``, so callers told the same number do not all come back
in the same instant. The computed backoff is not added on top: the server knows its
queue better than our exponent does, and ``max_delay`` caps only our own guesses,
not the server's (``max_retry_after`` decides whether a hint is acceptable at all).
A hint of 0 (negative header, past date) means "now": the computed backoff is used.

Pure: the random source is a ``random.Random`` passed in.
"""

from __future__ import annotations

import random

from .policy import RetryPolicy

# 2**60 * any sane base_delay is far above any max_delay; stops float overflow.
_MAX_EXPONENT = 60


def computed_backoff(
    policy: RetryPolicy, retry: int, previous_wait: float | None, rng: random.Random
) -> float:
    """The wait before retry number ``retry`` (0 = first retry) when the server gave no hint."""
    base, cap = policy.base_delay, policy.max_delay
    capped = min(cap, base * 2.0 ** min(max(retry, 0), _MAX_EXPONENT))
    if policy.jitter == "full":
        return rng.uniform(0.0, capped)
    if policy.jitter == "equal":
        return capped / 2.0 + rng.uniform(0.0, capped / 2.0)
    if policy.jitter == "decorrelated":
        previous = base if previous_wait is None else max(previous_wait, base)
        return min(cap, rng.uniform(base, previous * 3.0))
    return capped


def hinted_wait(policy: RetryPolicy, hint: float, rng: random.Random) -> float:
    """The wait for a positive server hint: the hint plus up to ``retry_after_jitter`` of it."""
    return hint + rng.uniform(0.0, policy.retry_after_jitter * hint)


def next_wait(
    policy: RetryPolicy,
    retry: int,
    hint: float | None,
    previous_wait: float | None,
    rng: random.Random,
) -> float:
    """The wait before retry ``retry``: the hint's when positive, else the computed backoff."""
    if hint is not None and hint > 0:
        return hinted_wait(policy, hint, rng)
    return computed_backoff(policy, retry, previous_wait, rng)
