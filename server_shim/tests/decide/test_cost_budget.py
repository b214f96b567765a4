"""Admission under a cost budget (``--max-inflight-tokens``): the pure controller, a fake clock."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.classes import ClassShares, SharedSlots
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller


@pytest.fixture(scope="module")
def make(make_controller: MakeController) -> MakeController:
    return functools.partial(
        make_controller,
        limit=4,
        max_queue=10,
        max_wait=60.0,
        start=50.0,
        returning_share=0.0,
        promise_slack=0.0,
        retry_after_min=0.1,
        retry_after_max=100.0,
        return_jitter=0.0,
    )


def req(cost: int, cls: str = "interactive") -> AdmissionRequest:
    return AdmissionRequest(cls=cls, cost=cost)


def ticket(decision: Ticket | Rejection) -> Ticket:
    assert isinstance(decision, Ticket), decision
    return decision


def test_requests_are_admitted_while_their_cost_fits_then_queue_with_slots_free(make: MakeController) -> None:
    c, _ = make(token_budget=1000)
    first, second = ticket(c.submit(req(400))), ticket(c.submit(req(500)))
    assert (first.state, second.state) == (TicketState.ADMITTED, TicketState.ADMITTED)
    third = ticket(c.submit(req(200)))
    # Two of four slots taken, but 900 + 200 passes the budget of 1000: it waits.
    assert third.state is TicketState.QUEUED
    assert (c.in_flight(), c.in_flight_tokens(), c.token_budget) == (2, 900, 1000)
    assert c.release(first, Outcome.COMPLETED).admitted == [third]
    assert c.in_flight_tokens() == 700


def test_the_count_cap_still_holds_under_the_budget(make: MakeController) -> None:
    c, _ = make(limit=2, token_budget=1_000_000)
    ticket(c.submit(req(10)))
    ticket(c.submit(req(10)))
    assert ticket(c.submit(req(10))).state is TicketState.QUEUED


def test_without_a_budget_the_cost_is_not_counted(make: MakeController) -> None:
    c, _ = make(limit=2)
    decisions = [ticket(c.submit(req(10**9))) for _ in range(2)]
    assert all(t.state is TicketState.ADMITTED for t in decisions)
    assert c.token_budget is None


def test_a_request_bigger_than_the_budget_runs_alone(make: MakeController) -> None:
    c, _ = make(token_budget=1000)
    chat = ticket(c.submit(req(100)))
    huge = ticket(c.submit(req(5000)))
    assert huge.state is TicketState.QUEUED  # never refused: it waits for the engine to empty
    assert c.release(chat, Outcome.COMPLETED).admitted == [huge]
    # While it runs, nothing else fits, the count cap notwithstanding.
    small = ticket(c.submit(req(1)))
    assert small.state is TicketState.QUEUED
    assert c.release(huge, Outcome.COMPLETED).admitted == [small]
    assert c.in_flight_tokens() == 1


def test_a_cheap_request_does_not_pass_a_queued_expensive_one_of_its_class(make: MakeController) -> None:
    c, _ = make(token_budget=1000)
    running = ticket(c.submit(req(600)))
    expensive = ticket(c.submit(req(900)))
    cheap = ticket(c.submit(req(200)))
    # 600 + 200 would fit, but the expensive one came first: first come, first served.
    assert (expensive.state, cheap.state) == (TicketState.QUEUED, TicketState.QUEUED)
    assert c.release(running, Outcome.COMPLETED).admitted == [expensive]
    assert cheap.state is TicketState.QUEUED  # 900 + 200 > 1000
    assert c.release(expensive, Outcome.COMPLETED).admitted == [cheap]


def test_a_higher_class_is_served_past_a_lower_class_head_that_does_not_fit(make: MakeController) -> None:
    c, _ = make(token_budget=1000)
    ticket(c.submit(req(100, "interactive")))  # a chat in flight: the budget binds batch
    ticket(c.submit(req(600, "batch")))
    long_prompt = ticket(c.submit(req(800, "batch")))
    chat = ticket(c.submit(req(200, "interactive")))
    assert (long_prompt.state, chat.state) == (TicketState.QUEUED, TicketState.ADMITTED)
    # A second long prompt queues behind the first; chat keeps flowing: it counts its own
    # class's cost (100 + 200 + 500), not the long prompt's, up to the count cap of 4.
    ticket(c.submit(req(800, "batch")))
    assert ticket(c.submit(req(500, "interactive"))).state is TicketState.ADMITTED
    assert c.in_flight_tokens() == 1400  # the whole budget and more: chat past batch's share
    assert (c.in_flight_tokens("interactive"), c.in_flight_tokens("batch")) == (800, 600)


def test_with_nothing_above_it_in_the_shim_a_lower_class_runs_on_the_count_cap_alone(
    make: MakeController,
) -> None:
    """The budget keeps the engine quick for the classes above; with none of their requests
    queued or in flight, long prompts fill the slots; once a chat is in, they are held to it."""
    c, _ = make(token_budget=1000)
    longs = [ticket(c.submit(req(800, "batch"))) for _ in range(3)]
    assert [t.state for t in longs] == [TicketState.ADMITTED] * 3
    assert ticket(c.submit(req(100))).state is TicketState.ADMITTED  # chat: its own cost only
    c.release(longs[0], Outcome.COMPLETED)
    held = ticket(c.submit(req(800, "batch")))
    assert held.state is TicketState.QUEUED  # a slot is free, but 1700 + 800 passes 1000
    assert c.in_flight_tokens() == 1700


def test_a_class_counts_its_own_cost_and_the_higher_classes_not_the_lower(make: MakeController) -> None:
    c, _ = make(limit=8, token_budget=1000)
    chats = [ticket(c.submit(req(300))) for _ in range(3)]
    # Batch counts everything in flight: 900 + 300 > 1000.
    batch = ticket(c.submit(req(300, "batch")))
    assert batch.state is TicketState.QUEUED
    # Chat counts its own: 900 + 200 > 1000 too, so it queues (first the chat queue, then batch).
    late_chat = ticket(c.submit(req(200)))
    assert late_chat.state is TicketState.QUEUED
    # 600 + 200 for chat; batch then counts 800 + 300 > 1000 and waits.
    assert c.release(chats[0], Outcome.COMPLETED).admitted == [late_chat]
    assert c.release(chats[1], Outcome.COMPLETED).admitted == [batch]  # 500 + 300 in all
    assert c.in_flight_tokens() == 800


def test_chat_alone_is_held_to_the_budget(make: MakeController) -> None:
    c, _ = make(token_budget=1000)
    first = ticket(c.submit(req(600)))
    second = ticket(c.submit(req(600)))
    assert (first.state, second.state) == (TicketState.ADMITTED, TicketState.QUEUED)


def test_a_blocked_class_with_requests_in_flight_lets_the_others_go_even_under_its_minimum_share(
    make: MakeController,
) -> None:
    # Batch is guaranteed 4 of 8 slots, at once: with one long prompt running it is under its
    # share, and the scheduler picks its head first; that head does not fit, so chat goes meanwhile.
    shares = ClassShares(minimum={"batch": 0.5}, due_after=0.0)
    c, _ = make(limit=8, token_budget=1000, scheduler=SharedSlots(shares))
    chats = [ticket(c.submit(req(100)))]  # a chat in flight: the budget binds batch
    running = ticket(c.submit(req(500, "batch")))
    second = ticket(c.submit(req(800, "batch")))
    chats += [ticket(c.submit(req(100))) for _ in range(4)]
    assert second.state is TicketState.QUEUED
    assert [t.state for t in chats] == [TicketState.ADMITTED] * 5  # 500 + 5 * 100 = 1000
    # Once batch has nothing in flight, its head holds what frees for itself: a chat that would
    # fit (500 + 100) waits behind it until the long prompt is in.
    assert c.release(running, Outcome.COMPLETED).admitted == []
    late_chat = ticket(c.submit(req(100)))
    assert late_chat.state is TicketState.QUEUED
    assert c.release(chats[0], Outcome.COMPLETED).admitted == []
    assert c.release(chats[1], Outcome.COMPLETED).admitted == []
    # 200 + 800 for batch; the chat behind it counts chat's own cost (200 + 100).
    assert c.release(chats[2], Outcome.COMPLETED).admitted == [second, late_chat]
    assert c.in_flight_tokens() == 1100


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_gives_the_cost_back(make: MakeController, outcome: Outcome) -> None:
    c, _ = make(token_budget=1000)
    running = ticket(c.submit(req(700)))
    waiting = ticket(c.submit(req(700)))
    assert c.in_flight_tokens() == 700
    assert c.release(running, outcome).admitted == [waiting]
    assert c.in_flight_tokens() == 700
    c.cancel(waiting)  # the caller went away while admitted
    assert (c.in_flight(), c.in_flight_tokens()) == (0, 0)


def test_a_head_blocked_by_the_budget_leaves_at_its_deadline_and_gives_its_place_back(
    make: MakeController,
) -> None:
    c, clock = make(token_budget=1000, max_wait=5.0)
    running = ticket(c.submit(req(900)))
    blocked = ticket(c.submit(req(900)))
    behind = ticket(c.submit(req(50)))
    clock.now += 5.0
    refusal = c.expire(blocked)
    assert refusal is not None
    assert refusal.code == "queue_timeout"
    assert behind.state is TicketState.QUEUED  # the asyncio timer expires it too; nothing moved yet
    c.expire(behind)
    assert c.queued() == 0
    c.release(running, Outcome.COMPLETED)
    assert c.in_flight_tokens() == 0


def _hint_behind(c: AdmissionController, queued_cost: int) -> float:
    """Retry-After of a chat refused with a full queue, behind one queued request of ``queued_cost``
    and four chats in flight admitted together."""
    for _ in range(4):
        ticket(c.submit(req(100)))
    assert ticket(c.submit(req(queued_cost))).state is TicketState.QUEUED
    refusal = c.submit(req(100))
    assert isinstance(refusal, Rejection)
    assert refusal.code == "queue_full"
    return refusal.retry_after


def test_a_queued_long_prompt_counts_as_its_share_of_the_budget_in_the_wait(make: MakeController) -> None:
    # Four slots, a budget of 4,000 tokens: 1,000 a slot. A queued 3,600-token prompt stands for
    # four places, so a chat behind it waits for five slots to free (two service times), not two.
    behind_chat = _hint_behind(make(max_queue=1, token_budget=4000)[0], 100)
    behind_long = _hint_behind(make(max_queue=1, token_budget=4000)[0], 3600)
    uncounted = _hint_behind(make(max_queue=1)[0], 3600)
    assert behind_chat == pytest.approx(1.0)
    assert behind_long == pytest.approx(2.0)
    assert uncounted == pytest.approx(1.0)  # without a budget, one place like any request
