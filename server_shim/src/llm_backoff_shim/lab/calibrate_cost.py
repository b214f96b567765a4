"""What a request costs the engine, and the in-flight cost budget calibrate recommends (pure).

Calibrate prices its requests as the shim's cost cap prices them
(:mod:`llm_backoff_shim.decide.pricing`), so the budget it recommends is in the shim's units:

- the prompt in the engine's own tokens: the upstream's ``usage.prompt_tokens`` (while a
  request runs, its words at the tokens per word the upstream has counted so far); the shim
  counts prompts at the bytes per token the engine's ``/tokenize`` reports, the same units;
- the answer at what this engine's recent answers were: the same estimator the shim uses
  (:class:`~llm_backoff_shim.decide.answer_length.AnswerLengths`, 90th percentile of the
  answers seen so far in the run), **not capped by the request's own** ``max_tokens``. The
  shim prices a request asking for more than that (4096, or none) at that quantile, so the
  budget is made of requests priced as such a client's: with K in flight (the knee) it holds
  K such requests of the mix's prompts, and a client naming ``max_tokens: 4096`` or none is
  never priced above the requests the budget was measured with.

The recommended ``--max-inflight-tokens`` is the cost in flight the knee's requests stayed at
or below 95 % of the time (:func:`budget_tokens`,
:func:`~llm_backoff_shim.lab.calibrate_samples.cost_quantile`): the level's ordinary mix of
prompts runs together under it, and what it holds back is an unusual pile-up of long ones.
"""

from __future__ import annotations

import math

from llm_backoff_shim.decide.answer_length import AnswerLengths, Clock

#: The class calibrate's requests are learned under (it sends one class).
CLASS = "calibrate"


class CostMeter:
    """Prices calibrate's requests as the shim does (module docstring), learning the answers as
    they end; ``prior``: the answer length assumed before enough have ended (the mix's mean)."""

    def __init__(self, clock: Clock, prior: int) -> None:
        self.answers = AnswerLengths((CLASS,), clock)
        self.prior = max(0, prior)

    def answer(self) -> int:
        """The answer tokens a request is priced at now."""
        return self.answers.expected(CLASS, None, self.prior)

    def cost(self, prompt_tokens: int) -> int:
        """A request's cost: its prompt tokens plus :meth:`answer`."""
        return max(0, prompt_tokens) + self.answer()

    def observe(self, completion_tokens: int) -> None:
        """A request ended with ``completion_tokens`` of answer."""
        self.answers.observe(CLASS, completion_tokens)


def budget_tokens(inflight_cost: float) -> int:
    """The recommended ``--max-inflight-tokens``: the knee's in-flight cost (module docstring),
    rounded up to a multiple of 64 tokens (finer than any request's cost varies, coarser than noise)."""
    if not (math.isfinite(inflight_cost) and inflight_cost > 0):
        raise ValueError(f"expected a positive in-flight cost, got {inflight_cost!r}")
    return 64 * math.ceil(inflight_cost / 64)
