"""What the cost budget counts for a request: answer lengths learned from the answers relayed
(decide/answer_length.py) and the price of a request (decide/pricing.py), on a fake clock."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.answer_length import AnswerLengths
from llm_backoff_shim.decide.cost import MESSAGE_OVERHEAD, SAMPLE_TEXT
from llm_backoff_shim.decide.pricing import Pricing
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Outcome, Ticket, TicketState
from llm_backoff_shim.decide.token_budget import TokenBudget
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller


def lengths(clock: ManualClock, **kwargs: float) -> AnswerLengths:
    return AnswerLengths(("interactive", "batch"), clock, **kwargs)  # type: ignore[arg-type]


def test_nothing_is_learned_before_enough_answers_then_a_high_quantile() -> None:
    clock = ManualClock(0.0)
    answers = lengths(clock, min_answers=10)
    for tokens in range(1, 10):  # 9 answers: not yet
        answers.observe("interactive", tokens * 10)
    assert answers.learned("interactive") is None
    answers.observe("interactive", 100)
    # 10, 20, ..., 100: the 90th percentile is the 9th of 10.
    assert answers.learned("interactive") == 90
    assert answers.learned("batch") is None  # per class


def test_the_prior_stands_in_until_learned_and_max_tokens_caps_either() -> None:
    clock = ManualClock(0.0)
    answers = lengths(clock, min_answers=2)
    # Cold: the prior, not the client's max_tokens; capped by a smaller max_tokens.
    assert answers.expected("interactive", 4096, prior=300) == 300
    assert answers.expected("interactive", None, prior=300) == 300
    assert answers.expected("interactive", 50, prior=300) == 50
    answers.observe("interactive", 70)
    answers.observe("interactive", 80)
    assert answers.expected("interactive", 4096, prior=300) == 80
    assert answers.expected("interactive", None, prior=300) == 80
    assert answers.expected("interactive", 16, prior=300) == 16


def test_a_class_without_answers_of_its_own_is_priced_at_every_classs_answers() -> None:
    clock = ManualClock(0.0)
    answers = lengths(clock, min_answers=4)
    for tokens in (100, 200, 300):
        answers.observe("interactive", tokens)
    assert answers.expected("batch", None, prior=7) == 7  # 3 answers in all: the prior
    answers.observe("batch", 400)
    # 4 in all: batch (1 of its own) is priced at every class's 90th percentile.
    assert answers.learned("batch") is None
    assert answers.learned_overall() == 400
    assert answers.expected("batch", None, prior=7) == 400
    assert answers.expected("interactive", None, prior=7) == 400  # 3 of its own: not yet
    answers.observe("interactive", 50)
    assert answers.expected("interactive", 4096, prior=7) == 300
    clock.now = 4000.0  # all aged out
    assert answers.learned_overall() is None


def test_only_recent_answers_count_by_number_and_by_age() -> None:
    clock = ManualClock(0.0)
    answers = lengths(clock, window=4, min_answers=2, horizon=100.0)
    for tokens in (1000, 1000, 1000, 1000):
        answers.observe("batch", tokens)
    for tokens in (10, 10, 10, 10):  # the window holds the last four
        answers.observe("batch", tokens)
    assert answers.learned("batch") == 10
    clock.now = 60.0
    answers.observe("batch", 500)
    answers.observe("batch", 500)
    assert answers.learned("batch") == 500
    # 101 s after the first four: only the two of t=60 are left, enough to learn from.
    clock.now = 101.0
    assert answers.learned("batch") == 500
    clock.now = 161.0  # all aged out: back to the prior
    assert answers.learned("batch") is None


def test_unknown_classes_and_uncountable_answers_teach_nothing() -> None:
    answers = lengths(ManualClock(0.0), min_answers=1)
    answers.observe("nope", 10)
    answers.observe("interactive", -1)
    assert answers.learned("interactive") is None
    assert answers.learned("nope") is None
    with pytest.raises(ValueError, match="quantile"):
        lengths(ManualClock(0.0), quantile=0.0)
    with pytest.raises(ValueError, match="min_answers"):
        lengths(ManualClock(0.0), window=4, min_answers=5)


def pricing(budget: int = 6528, slots: int = 8) -> tuple[Pricing, ManualClock]:
    clock = ManualClock(0.0)
    return Pricing(TokenBudget(budget), ("interactive", "batch"), clock, lambda: slots), clock


def test_cold_a_request_costs_a_slots_share_or_its_prompt_never_its_max_tokens() -> None:
    price, _ = pricing(6528, 8)  # a share of 816
    assert price.price("interactive", 20, 4096) == 816
    assert price.price("interactive", 20, None) == 816
    assert price.price("interactive", 20, 100) == 120  # its prompt and its whole answer is less
    assert price.price("batch", 3000, 4096) == 3000  # a long prompt weighs its prompt
    # Eight chats saying max_tokens 4096 fill the budget exactly, as the count cap would.
    assert 8 * price.price("interactive", 20, 4096) <= 6528


def test_learned_a_request_costs_its_prompt_and_the_classes_answer_capped_by_max_tokens() -> None:
    price, _ = pricing()
    for _ in range(16):
        price.observe("interactive", 64)
    assert price.price("interactive", 20, 4096) == 84
    assert price.price("interactive", 20, None) == 84
    assert price.price("interactive", 20, 8) == 28
    # Batch has learned nothing yet: what every class's answers say, not a share.
    assert price.price("batch", 3000, 4096) == 3064


def test_prompts_are_counted_at_the_engines_bytes_per_token() -> None:
    price, _ = pricing(budget=100_000, slots=1)  # a share far above any prompt here: look at the prompt
    body = {"messages": [{"role": "user", "content": "w" * 1000}], "max_tokens": 1}
    assert price.price_body("interactive", body) == 250 + MESSAGE_OVERHEAD + 1
    size = len(SAMPLE_TEXT.encode())
    assert price.learn_ratio(SAMPLE_TEXT, round(size / 2.5))  # 2.5 bytes a token
    assert price.ratio == pytest.approx(2.5, rel=0.01)
    assert price.price_body("interactive", body) == math.ceil(1000 / price.ratio) + MESSAGE_OVERHEAD + 1
    learned = price.ratio
    assert not price.learn_ratio(SAMPLE_TEXT, 0)  # an implausible count keeps the ratio
    assert price.ratio == learned


@pytest.fixture(scope="module")
def make(make_controller: MakeController) -> MakeController:
    return functools.partial(make_controller, limit=8, max_queue=10, max_wait=60.0, start=50.0)


def chat(c: AdmissionController, max_tokens: int | None) -> AdmissionRequest:
    """A short chat as the intake prices it."""
    body: dict[str, object] = {"messages": [{"role": "user", "content": "Say hello to the team."}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    assert c.pricing is not None
    return AdmissionRequest(
        cls="interactive", max_tokens=max_tokens, cost=c.pricing.price_body("interactive", body)
    )


@pytest.mark.parametrize("max_tokens", [4096, None])
def test_eight_chats_on_an_idle_engine_are_all_admitted_cold_and_learned(
    make: MakeController, max_tokens: int | None
) -> None:
    c, clock = make(token_budget=6528)
    for _round in range(3):  # cold, then with 8 and 16 answers of 64 tokens learned
        tickets = [c.submit(chat(c, max_tokens)) for _ in range(8)]
        assert all(isinstance(t, Ticket) and t.state is TicketState.ADMITTED for t in tickets)
        clock.now += 1.0
        for t in tickets:
            assert isinstance(t, Ticket)
            c.release(t, Outcome.COMPLETED, answer_tokens=64)
    assert c.pricing is not None
    assert c.pricing.answers.learned("interactive") == 64


def test_only_completed_answers_teach_the_controller(make: MakeController) -> None:
    c, _ = make(token_budget=6528)
    assert c.pricing is not None
    for outcome in (Outcome.ABORTED, Outcome.UPSTREAM_ERROR) * 8 + (Outcome.COMPLETED,) * 15:
        t = c.submit(chat(c, 4096))
        assert isinstance(t, Ticket)
        c.release(t, outcome, answer_tokens=3000)
    assert c.pricing.answers.learned("interactive") is None  # 15 completed: one short
    t = c.submit(chat(c, 4096))
    assert isinstance(t, Ticket)
    c.release(t, Outcome.COMPLETED, answer_tokens=3000)
    assert c.pricing.answers.learned("interactive") == 3000


def test_without_a_budget_nothing_is_priced(make: MakeController) -> None:
    c, _ = make()
    assert c.pricing is None
