"""What the cost budget counts for a request: the KV-cache tokens it is expected to hold.

    cost = prompt tokens + expected answer tokens

- **Prompt tokens in the engine's tokens**: the body's text at the engine's bytes per token
  (:func:`~llm_backoff_shim.decide.cost.estimate_prompt_tokens`), a ratio the edge learns
  once from the engine's ``/tokenize`` (:meth:`Pricing.learn_ratio`; 4 bytes a token until
  then, or for an engine without one). So a budget means the same tokens on any engine, and
  calibrate, which measures in the engine's ``usage.prompt_tokens``, recommends one in the
  same units.
- **The answer as this engine's recent answers say**, not as ``max_tokens`` says: a high
  quantile of the class's recent answers, capped by the request's ``max_tokens``
  (:class:`~llm_backoff_shim.decide.answer_length.AnswerLengths`, whose docstring says why).
  A request that names no ``max_tokens`` is priced the same, uncapped.
- **Cold start**: until a class has answers enough to learn from, it is priced at what every
  class's answers together say (:class:`AnswerLengths`); until the shim has answers enough of
  any class, a request is priced at one slot's share of the budget (the budget over the
  concurrency limit), or at its prompt when
  that is larger, never at more than its prompt plus its ``max_tokens``. Before anything is
  known of the answers, the budget then admits as many ordinary requests as the count cap
  does (an idle engine's slots all fill) and weighs only prompts larger than a slot's share;
  the client's ``max_tokens`` is never taken as the answer's length.

Pure: the clock is the answers' (:class:`AnswerLengths`); the limit is read through ``slots``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from llm_backoff_shim.decide.answer_length import AnswerLengths, Clock
from llm_backoff_shim.decide.cost import (
    BYTES_PER_TOKEN,
    answer_limit,
    bytes_per_token,
    estimate_prompt_tokens,
)
from llm_backoff_shim.decide.token_budget import TokenBudget


class Pricing:
    """Prices requests for a :class:`TokenBudget` (module docstring)."""

    __slots__ = ("_budget", "_slots", "answers", "ratio")

    def __init__(
        self,
        budget: TokenBudget,
        classes: Iterable[str],
        clock: Clock,
        slots: Callable[[], int],
        answers: AnswerLengths | None = None,
    ) -> None:
        self._budget = budget
        self._slots = slots
        #: The answer lengths it prices at: ``answers`` (shared with whoever else learns from
        #: them, as the admission controller does), else its own.
        self.answers = AnswerLengths(classes, clock) if answers is None else answers
        #: UTF-8 bytes per prompt token: the engine's, once learned.
        self.ratio = BYTES_PER_TOKEN

    def learn_ratio(self, text: str, tokens: int) -> bool:
        """The engine's tokenizer counted ``tokens`` for ``text``: price prompts at that ratio.
        False (the ratio kept) for an implausible count
        (:func:`~llm_backoff_shim.decide.cost.bytes_per_token`)."""
        ratio = bytes_per_token(text, tokens)
        if ratio is None:
            return False
        self.ratio = ratio
        return True

    def share(self) -> int:
        """One slot's share of the budget: the budget over the concurrency limit."""
        return self._budget.tokens // max(1, self._slots())

    def price(self, cls: str, prompt_tokens: int, max_tokens: int | None) -> int:
        """The cost of a request of ``cls`` with ``prompt_tokens`` and ``max_tokens`` (None: it
        names none), module docstring."""
        prompt = max(0, prompt_tokens)
        prior = max(0, self.share() - prompt)
        return prompt + self.answers.expected(cls, max_tokens, prior)

    def price_body(self, cls: str, body: Mapping[str, object]) -> int:
        """:meth:`price` of a generation request's parsed body."""
        return self.price(cls, estimate_prompt_tokens(body, self.ratio), answer_limit(body))

    def observe(self, cls: str, completion_tokens: int) -> None:
        """An answer of ``cls`` relayed in full, ``completion_tokens`` long."""
        self.answers.observe(cls, completion_tokens)
