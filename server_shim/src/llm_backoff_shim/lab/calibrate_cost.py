"""What a request costs the engine, and the in-flight cost budget calibrate recommends (pure).

A request's cost is its prompt tokens plus its ``max_tokens``: what it can hold in the
engine's KV cache at its end, known before it is sent. The shim's cost-aware cap
(``serve --max-inflight-tokens``) admits a request while the cost in flight, this one
included, stays within a budget; calibrate measures the budget as the cost the engine held
in flight, on average over the steady windows, at the knee of the mix it was given.
"""

from __future__ import annotations

import math


def request_cost(prompt_tokens: int, max_tokens: int) -> int:
    """The cost the shim's cap counts for one request: prompt tokens + ``max_tokens``."""
    return max(0, prompt_tokens) + max(0, max_tokens)


def budget_tokens(mean_inflight_cost: float) -> int:
    """The recommended ``--max-inflight-tokens``: the knee's mean in-flight cost, rounded up
    to a multiple of 64 tokens (finer than any request's cost varies, coarser than noise)."""
    if not (math.isfinite(mean_inflight_cost) and mean_inflight_cost > 0):
        raise ValueError(f"expected a positive in-flight cost, got {mean_inflight_cost!r}")
    return 64 * math.ceil(mean_inflight_cost / 64)
