"""The cost budget: the most KV-cache tokens the requests in flight may hold together.

Beside the concurrency limit (:mod:`llm_backoff_shim.decide.limit`), which counts requests,
a :class:`TokenBudget` weighs each request by its cost (:mod:`llm_backoff_shim.decide.pricing`:
prompt tokens plus the answer this engine's recent answers say it will hold, not its
``max_tokens``). With a budget, a request is admitted only while the count
cap holds AND the cost in flight it is weighed against plus its own stays within the budget;
the admission controller asks :meth:`TokenBudget.fits` beside the limit with the cost its
request's class and the classes above it hold (:mod:`llm_backoff_shim.decide.admission` says
why), and keeps the cost in flight, per class, with the slots
(:class:`~llm_backoff_shim.decide.slots.HeldSlots`), so every ticket outcome gives its cost
back with its slot.

A request costing more than the whole budget is admitted once nothing else of its class or
the classes above it holds any of the budget (and nothing of those classes is admitted beside
it while it runs). It is not refused: the shim does not know the engine's context length
(vLLM answers a request that can never fit with its own 400 at once), the prompt's size is an
estimate, the answer's a learned one, and an operator may set the budget below the engine's KV
capacity to keep chat's first tokens quick; a request the engine can serve is served.

Queue-wait estimates weigh a queued request by its cost too (:meth:`TokenBudget.places`):
the budget split evenly over the count cap's slots is one slot's share, and a request
costing ``k`` shares stands for ``k`` places (at least 1, at most the cap), so a queued long
prompt is not estimated as one chat-sized slot.
"""

from __future__ import annotations


class TokenBudget:
    """``--max-inflight-tokens``: the most cost in flight at once (module docstring)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: int) -> None:
        if isinstance(tokens, bool) or tokens < 1:
            raise ValueError(f"token budget must be >= 1, got {tokens}")
        self._tokens = tokens

    @property
    def tokens(self) -> int:
        """The budget, in KV-cache tokens."""
        return self._tokens

    def fits(self, in_flight: int, cost: int) -> bool:
        """Whether a request of ``cost`` may start beside ``in_flight`` tokens of cost already
        admitted: within the budget, or alone (nothing holds any of it)."""
        return in_flight <= 0 or in_flight + cost <= self._tokens

    def places(self, cost: int, limit: int) -> int:
        """Queue places a request of ``cost`` stands for in a wait estimate at a count cap of
        ``limit`` (module docstring)."""
        if cost <= 0:
            return 1
        return max(1, min(limit, -(-cost * max(1, limit) // self._tokens)))
