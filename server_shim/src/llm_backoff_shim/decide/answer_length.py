"""How long this engine's answers are, learned per class from the answers the shim relayed.

The cost budget (:mod:`llm_backoff_shim.decide.token_budget`) weighs a request by what it will
hold in the engine's KV cache: its prompt, and its answer. ``max_tokens`` is no measure of the
answer: vLLM allocates the KV cache as tokens are generated, and ``max_tokens`` is an upper
bound that clients set high (4096 is a common setting for answers of a hundred) or leave out.
Priced at ``max_tokens``, eight such calls on an idle 8-sequence engine took 7 429s from a
budget calibrate had measured for that engine. So an answer is priced at
:meth:`AnswerLengths.expected`: a high quantile (:data:`QUANTILE`) of the completion tokens of
the class's recent answers, capped by the request's own ``max_tokens``.

- **A high quantile, not the mean**: a request is priced once, at admission, for all of its
  run; the long answers are the ones that hold the cache longest, so a mean would let the
  budget be passed whenever a few long answers run together. The 90th percentile covers all
  but the longest tenth; calibrate prices its own requests the same way, so the budget it
  recommends is in the same units (:mod:`llm_backoff_shim.lab.calibrate.measure`).
- **Per class**: chat and batch jobs ask for different lengths.
- **Recent**: the last :data:`WINDOW` answers of the class within :data:`HORIZON` seconds, so a
  change of traffic or model is followed within a few hundred answers.
- **Cold start**: before :data:`MIN_ANSWERS` answers of a class have been seen, the class is
  priced at the same quantile of every class's recent answers together (a batch job's first
  long prompts at what chat's answers say: what this engine answers, if not for this class),
  and before as many answers of any class, by the caller's prior (the cost budget's: one
  slot's share of it, :mod:`~llm_backoff_shim.decide.pricing`). The client's ``max_tokens`` is
  never the prior: a request saying 4096 is not priced at 4096. Measured in virtual time
  (bench/bench_cost_budget.py at 658ce04, a burst of 60 long prompts at once beside chat): a
  class's first answers priced at the prior alone let the burst's prompts in unweighed by
  their answers.

Fed by the edge with the completion tokens of each answer relayed in full (from the answer's
``usage``, or by counting a stream's events: :mod:`llm_backoff_shim.serve.request_path.answer_meter`).
Pure: time comes from the injected clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable

Clock = Callable[[], float]

#: The quantile of recent answers' lengths an answer is priced at (module docstring).
QUANTILE = 0.9
#: How many recent answers per class the estimate is taken over.
WINDOW = 256
#: Answers of a class needed before its estimate replaces the prior.
MIN_ANSWERS = 16
#: Seconds after which an answer no longer counts.
HORIZON = 3600.0


class AnswerLengths:
    """Recent answers' completion tokens per class, and the price of an answer (module docstring)."""

    __slots__ = ("_answers", "_cached", "_clock", "_horizon", "_min_answers", "_quantile", "_window")

    def __init__(
        self,
        classes: Iterable[str],
        clock: Clock,
        *,
        quantile: float = QUANTILE,
        window: int = WINDOW,
        min_answers: int = MIN_ANSWERS,
        horizon: float = HORIZON,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1 or not 1 <= min_answers <= window:
            raise ValueError("need window >= 1 and 1 <= min_answers <= window")
        if not horizon > 0:
            raise ValueError("horizon must be positive")
        self._clock = clock
        self._quantile = quantile
        self._window = window
        self._min_answers = min_answers
        self._horizon = horizon
        # Per class: (when, completion tokens), oldest first.
        self._answers: dict[str, deque[tuple[float, int]]] = {c: deque(maxlen=window) for c in classes}
        # Per class (None: every class together): the estimate, until the next answer or an
        # answer ages out.
        self._cached: dict[str | None, int | None] = {}

    def observe(self, cls: str, completion_tokens: int) -> None:
        """One answer of ``cls`` relayed in full, ``completion_tokens`` long. Unknown classes and
        negative counts are ignored (an answer the edge could not count is not observed)."""
        answers = self._answers.get(cls)
        if answers is None or completion_tokens < 0:
            return
        answers.append((self._clock(), completion_tokens))
        self._cached.pop(cls, None)
        self._cached.pop(None, None)

    def learned(self, cls: str) -> int | None:
        """The class's answer length at :data:`QUANTILE` of its recent answers (rounded up), or
        None while fewer than ``min_answers`` recent ones are known."""
        answers = self._answers.get(cls)
        if answers is None:
            return None
        self._age(cls, answers)
        if cls in self._cached:
            return self._cached[cls]
        estimate = self._quantile_of([tokens for _, tokens in answers])
        self._cached[cls] = estimate
        return estimate

    def learned_overall(self) -> int | None:
        """:meth:`learned` over every class's recent answers together."""
        for cls, answers in self._answers.items():
            self._age(cls, answers)
        if None in self._cached:
            return self._cached[None]
        estimate = self._quantile_of([tokens for answers in self._answers.values() for _, tokens in answers])
        self._cached[None] = estimate
        return estimate

    def learned_for(self, cls: str) -> int | None:
        """:meth:`learned` for ``cls``, else over every class (:meth:`learned_overall`)."""
        learned = self.learned(cls)
        return self.learned_overall() if learned is None else learned

    def expected(self, cls: str, max_tokens: int | None, prior: int) -> int:
        """The answer tokens a request of ``cls`` is priced at: the class's learned length, else
        every class's, else ``prior``; capped by the request's ``max_tokens`` (None: not capped)."""
        learned = self.learned_for(cls)
        answer = prior if learned is None else learned
        return answer if max_tokens is None else min(answer, max_tokens)

    def _age(self, cls: str, answers: deque[tuple[float, int]]) -> None:
        """Drop the answers of ``cls`` older than the horizon."""
        oldest = self._clock() - self._horizon
        if answers and answers[0][0] < oldest:
            while answers and answers[0][0] < oldest:
                answers.popleft()
            self._cached.pop(cls, None)
            self._cached.pop(None, None)

    def _quantile_of(self, tokens: list[int]) -> int | None:
        if len(tokens) < self._min_answers:
            return None
        tokens.sort()
        return tokens[max(0, math.ceil(self._quantile * len(tokens)) - 1)]
