"""Returning callers (``x-stainless-retry-count`` >= 1) first: pure logic with a fake clock."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.classes import ClassShares, SharedSlots
from llm_backoff_shim.decide.drain_estimate import DrainEstimator, EstimatorConfig
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.retry_after import HintRequest, retry_after
from llm_backoff_shim.decide.tickets import Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.serve.app import build_controller
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.tuning import Tuning
from llm_backoff_shim.serve.request_path.intake import parse_retry_count
from llm_backoff_shim.serve.request_path.waiting import AsyncAdmission, Grant
from llm_backoff_shim.testing import ManualClock


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 0),
        ("0", 0),
        ("1", 1),
        (" 2 ", 2),
        ("999999", 1000),  # only ">= 1" matters; a huge claim is not kept as is
        ("", 0),
        ("-1", 0),
        ("1.5", 0),
        ("abc", 0),
        ("١", 0),  # a non-ASCII digit is malformed, not a retry
        ("12345678901234567890", 0),
    ],
)
def test_retry_count_header_is_lenient(value: str | None, expected: int) -> None:
    # A client library's header, not our protocol: unreadable means a fresh arrival, never a 400.
    assert parse_retry_count(value) == expected


def test_a_request_with_a_retry_count_is_returning() -> None:
    assert not AdmissionRequest("interactive").returning
    assert not AdmissionRequest("interactive", retry=0).returning
    assert AdmissionRequest("interactive", retry=1).returning


# -- the controller ----------------------------------------------------------------------------


MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller


@pytest.fixture(scope="module")
def make(make_controller: MakeController) -> MakeController:
    """One slot, two classes, places kept for returning callers; the exact estimate, and hints as
    computed (return_jitter 0 unless given; the aim for clients' jitter: test_drain_estimate)."""
    return functools.partial(
        make_controller,
        limit=1,
        max_queue=8,
        max_wait=10.0,
        start=100.0,
        promise_slack=0.0,
        retry_after_min=0.1,
        retry_after_max=100.0,
        return_jitter=0.0,
    )


def measure(c: AdmissionController, clock: ManualClock, service: float) -> None:
    """One completed request of ``service`` seconds, so that estimates no longer rest on the prior."""
    t = ticket(c.submit(AdmissionRequest("interactive")))
    clock.now += service
    c.release(t, Outcome.COMPLETED)


def promise(c: AdmissionController, cls: str = "interactive") -> float:
    """Turn a caller away as the controller would: it is told (and promised) a hint."""
    return retry_after(c.estimator, HintRequest(cls, c.ahead_of(cls), c.limit))


def ticket(decision: Ticket | Rejection) -> Ticket:
    assert isinstance(decision, Ticket), decision
    return decision


def rejection(decision: Ticket | Rejection) -> Rejection:
    assert isinstance(decision, Rejection), decision
    return decision


def fresh(cls: str = "interactive", budget: float | None = None) -> AdmissionRequest:
    return AdmissionRequest(cls, budget=budget)


def back(cls: str = "interactive", budget: float | None = 1000.0) -> AdmissionRequest:
    """A retry that says how long it will wait (by default: far longer than any wait here)."""
    return AdmissionRequest(cls, budget=budget, retry=1)


def test_returning_requests_go_before_fresh_ones_of_their_class_fifo_within_each(
    make: MakeController,
) -> None:
    c, _ = make(limit=1)
    running = ticket(c.submit(fresh()))
    f1, r1, f2, r2 = (ticket(c.submit(r)) for r in (fresh(), back(), fresh(), back()))
    order = []
    current = running
    for _ in range(4):
        (current,) = c.release(current, Outcome.COMPLETED).admitted
        order.append(current)
    assert order == [r1, r2, f1, f2]


def test_a_returning_batch_request_does_not_pass_interactive_ones(make: MakeController) -> None:
    c, _ = make(limit=1)
    running = ticket(c.submit(fresh()))
    batch_back = ticket(c.submit(back("batch")))
    interactive = ticket(c.submit(fresh("interactive")))
    assert c.release(running, Outcome.COMPLETED).admitted == [interactive]
    assert c.release(interactive, Outcome.COMPLETED).admitted == [batch_back]


def test_a_full_queue_refuses_fresh_arrivals_before_returning_ones_and_evicts_nobody(
    make: MakeController,
) -> None:
    c, _ = make(limit=1, max_queue=8, returning_share=0.25)
    ticket(c.submit(fresh()))
    assert c.fresh_room(8, ["interactive"]) == 8  # nobody was told to come back
    for _ in range(3):
        promise(c)
    assert c.fresh_room(8, ["interactive"]) == 6  # one place per promise, at most 2 of 8
    queued = [ticket(c.submit(fresh())) for _ in range(6)]
    assert rejection(c.submit(fresh())).code == "queue_full"
    kept = [ticket(c.submit(back())) for _ in range(2)]
    assert rejection(c.submit(back())).code == "queue_full"
    assert all(t.state is TicketState.QUEUED for t in queued + kept)
    assert c.queued("interactive") == 8
    assert c.queued_returning("interactive") == 2


def test_the_total_bound_keeps_places_for_returning_requests_too(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=8, max_queue_total=4, returning_share=0.25)  # total: 3 fresh, 1 returning
    ticket(c.submit(fresh()))
    promise(c, "batch")
    for cls in ("interactive", "batch", "batch"):
        ticket(c.submit(fresh(cls)))
    assert rejection(c.submit(fresh("interactive"))).code == "queue_full"
    ticket(c.submit(back("batch")))
    assert rejection(c.submit(back("interactive"))).code == "queue_full"


def test_small_queues_keep_no_place_back(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=3, returning_share=0.25)
    ticket(c.submit(fresh()))
    promise(c)
    assert all(ticket(c.submit(fresh())).state is TicketState.QUEUED for _ in range(3))


def test_cancel_and_expire_find_a_returning_ticket(make: MakeController) -> None:
    c, clock = make(limit=1, max_wait=5.0)
    ticket(c.submit(fresh()))
    gone, late = ticket(c.submit(back())), ticket(c.submit(back()))
    c.cancel(gone)
    assert gone.state is TicketState.CANCELLED
    clock.now += 5.0
    assert rejection(c.expire(late)).code == "queue_timeout"  # type: ignore[arg-type]
    assert c.queued() == 0


def test_oldest_wait_looks_at_both_queues(make: MakeController) -> None:
    c, clock = make(limit=1)
    ticket(c.submit(fresh()))
    ticket(c.submit(fresh()))
    clock.now += 3.0
    ticket(c.submit(back()))
    clock.now += 1.0
    assert c.oldest_wait("interactive") == pytest.approx(4.0)


def test_a_fresh_arrival_counts_the_returns_already_promised(make: MakeController) -> None:
    # 1 slot, 1 s per request: a slot per second. 4 callers told to come back at 2, 3, 4, 5 s.
    c, clock = make(limit=1, max_queue=8, max_wait=3.5, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    ticket(c.submit(fresh()))  # queued: served in 1 s
    hints = [promise(c) for _ in range(4)]
    assert hints == pytest.approx([2.0, 3.0, 4.0, 5.0])
    # Queue alone: 2 s; with the promises due before it is served, it would wait 6 s > 3.5 s.
    refused = rejection(c.submit(fresh()))
    assert refused.code == "queue_full"
    assert "exceeds the 3.5 s limit" in refused.message
    assert refused.retry_after == pytest.approx(6.0)  # after the last promise
    # A returning caller goes before fresh ones: the promises made to others do not delay it.
    assert ticket(c.submit(back())).state is TicketState.QUEUED


def test_a_fresh_arrival_does_not_yield_to_a_lower_class_promise(make: MakeController) -> None:
    # 4 batch callers told to come back at 2..5 s hold no slot against a fresh interactive
    # arrival: it is queued behind the queue alone (2 s), as if nothing had been promised.
    c, clock = make(limit=1, max_queue=8, max_wait=3.5, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    ticket(c.submit(fresh()))  # queued: served in 1 s
    hints = [promise(c, "batch") for _ in range(4)]
    assert hints == pytest.approx([2.0, 3.0, 4.0, 5.0])
    assert ticket(c.submit(fresh())).state is TicketState.QUEUED
    # A fresh batch arrival still yields to them: its own class's promises keep their slots.
    refused = rejection(c.submit(fresh("batch")))
    assert refused.code == "queue_full"
    assert "exceeds the 3.5 s limit" in refused.message


def test_a_caller_whose_slot_is_beyond_its_budget_is_told_its_budget(make: MakeController) -> None:
    # Its slot is 4 s away and it needs 1 s of service: with 4.9 s of budget it could not be
    # served at its slot, so no slot is kept for it and it is told its budget (give up now).
    c, clock = make(limit=1, max_queue=3, max_wait=10.0, returning_share=0.0, return_jitter=0.2)
    measure(c, clock, 1.0)
    for _ in range(4):
        ticket(c.submit(fresh()))
    tight = rejection(c.submit(fresh(budget=4.9)))
    assert tight.retry_after == pytest.approx(4.9)
    assert c.estimator.promises.outstanding("interactive") == 0
    roomy = rejection(c.submit(fresh(budget=5.4)))
    assert roomy.retry_after == pytest.approx(4.0 / 1.1)
    assert c.estimator.promises.outstanding("interactive") == 1


def test_a_caller_that_may_come_back_too_late_for_its_slot_is_told_to_come_back_early(
    make: MakeController,
) -> None:
    # Its slot is 4 s away; aimed for clients' jitter (up to 20 % of the hint above it) it
    # would be told 4 / 1.1 s and might come back at 4.36 s, with less than the 1 s of service
    # left of 5.3 s. Its slot is within reach (5.3 - 1 = 4.3 s), so it is still promised, told
    # 4.3 / 1.2 s: back by 4.3 s at the latest, it waits in the queue for its slot.
    c, clock = make(limit=1, max_queue=3, max_wait=10.0, returning_share=0.0, return_jitter=0.2)
    measure(c, clock, 1.0)
    for _ in range(4):
        ticket(c.submit(fresh()))
    early = rejection(c.submit(fresh(budget=5.3)))
    assert early.retry_after == pytest.approx(4.3 / 1.2)
    assert c.estimator.promises.outstanding("interactive") == 1
    # The next caller is promised the next slot (5 s away), not the same one.
    assert rejection(c.submit(fresh(budget=6.3))).retry_after == pytest.approx(5.3 / 1.2)
    assert c.estimator.promises.outstanding("interactive") == 2


def test_before_any_completion_a_slot_is_within_reach_on_the_prior(make: MakeController) -> None:
    # Nothing measured yet: the slot must still leave the prior's service time (2 s) before the
    # end of the budget, or the caller would be admitted only to be cut by its deadline.
    c, _ = make(
        limit=1, max_queue=0, max_wait=10.0, returning_share=0.0, return_jitter=0.2, initial_service_time=2.0
    )
    ticket(c.submit(fresh()))  # holds the slot; the next free one is 2 s away (the prior)
    assert rejection(c.submit(fresh(budget=3.9))).retry_after == pytest.approx(3.9)
    assert c.estimator.promises.outstanding("interactive") == 0
    assert rejection(c.submit(fresh(budget=4.1))).retry_after == pytest.approx(2.1 / 1.2)
    assert c.estimator.promises.outstanding("interactive") == 1


def test_a_caller_back_from_a_promise_no_longer_holds_a_slot_ahead_of_others(make: MakeController) -> None:
    # Two callers promised returns at 1 s and 2 s; one comes back early and queues. Its promise
    # is redeemed: a fresh arrival's wait counts it once (queued), not twice.
    c, clock = make(limit=1, max_queue=8, max_wait=10.0, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    promise(c)
    promise(c)
    assert c.estimator.promises.outstanding("interactive") == 2
    clock.now += 0.5
    assert ticket(c.submit(back())).state is TicketState.QUEUED
    assert c.estimator.promises.outstanding("interactive") == 1
    # Not counting itself twice: ahead of a fresh arrival are the one queued and one promise.
    assert c.estimator.promises.promised_within(("interactive",), clock.now, clock.now + 10.0) == 1


def test_a_lower_class_caller_with_a_long_budget_is_promised_a_slot_after_the_higher_class_wait(
    make: MakeController,
) -> None:
    # Interactive callers wait at most 3 s in the queue; a batch caller that can wait a minute
    # is told to come back after that, and the slots before it go to interactive callers.
    c, clock = make(limit=1, max_queue=0, max_wait=3.0, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))  # holds the slot
    assert rejection(c.submit(fresh("batch", budget=60.0))).retry_after == pytest.approx(3.0)
    assert rejection(c.submit(fresh(budget=60.0))).retry_after == pytest.approx(1.0)
    # A batch caller whose budget does not reach past those 3 s is not held back: it takes
    # the free slot at 2 s.
    assert rejection(c.submit(fresh("batch", budget=3.5))).retry_after == pytest.approx(2.0)


def test_promises_fall_due_and_stop_counting(make: MakeController) -> None:
    c, clock = make(limit=1, max_wait=2.5, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    for _ in range(3):
        promise(c)
    assert c.estimator.promises.outstanding("interactive") == 3
    clock.now += 3.2  # all three are due, even allowing the 0.1 s minimum for lateness
    assert c.estimator.promises.outstanding("interactive") == 0
    assert ticket(c.submit(fresh())).state is TicketState.QUEUED


def test_a_hint_beyond_the_callers_budget_is_not_remembered() -> None:
    clock = ManualClock(100.0)
    est = DrainEstimator(EstimatorConfig(retry_after_min=1.0, retry_after_max=30.0, return_jitter=0.0), clock)
    assert retry_after(est, HintRequest("interactive", 4, 1, keep_within=2.0)) == pytest.approx(5.0)
    assert est.promises.outstanding("interactive") == 0  # that caller cannot come back in time
    # so the next hears the same slot
    assert retry_after(est, HintRequest("interactive", 4, 1)) == pytest.approx(5.0)
    assert est.promises.outstanding("interactive") == 1
    assert retry_after(est, HintRequest("interactive", 4, 1, keep_within=10.0)) == pytest.approx(6.0)


def test_higher_class_promises_delay_a_lower_class_hint() -> None:
    clock = ManualClock(100.0)
    est = DrainEstimator(EstimatorConfig(retry_after_min=1.0, retry_after_max=30.0, return_jitter=0.0), clock)
    for _ in range(3):
        retry_after(est, HintRequest("interactive", 0, 1))  # interactive returns promised at 1, 2, 3 s
    # One timeline for all classes: the batch caller's slot comes after those promises.
    assert retry_after(est, HintRequest("batch", 0, 1)) == pytest.approx(4.0)
    assert est.expected_wait(0, 1, 0, promised_by=("interactive",)) == pytest.approx(4.0)
    assert retry_after(est, HintRequest("batch", 0, 1, promised_by=("interactive",))) == pytest.approx(5.0)


# -- a queued request keeps its promise; the recheck is the safety net ----------------------------


def test_interactive_arrivals_do_not_push_a_batch_request_past_its_budget(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=8, max_wait=10.0, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    b0 = ticket(c.submit(fresh("batch")))
    b1 = ticket(c.submit(fresh("batch", budget=4.5)))  # 2 s wait + 1 s service: 1.5 s to spare
    first = ticket(c.submit(fresh()))  # ahead of both: b1 now 3 + 1 s, within 4.5 s
    assert c.serve_order() == [first, b0, b1]
    second = ticket(c.submit(fresh()))  # ahead of both would make b1 late: right after it
    assert c.serve_order() == [first, b0, b1, second]
    assert second.key > b1.key
    assert not c.recheck()
    assert c.overtaken_total == 0
    # Where it breaks no promise (5 s away) is past its own budget: refused at arrival, with a hint.
    refused = rejection(c.submit(fresh(budget=3.0)))
    assert refused.code == "queue_timeout"
    assert "estimated queue wait 5.00 s" in refused.message
    assert refused.retry_after > 0
    assert c.serve_order() == [first, b0, b1, second]


def test_a_class_held_longer_than_the_newcomers_yields_and_the_recheck_turns_away_who_it_makes_late(
    make: MakeController,
) -> None:
    # Batch held up to 20 s, interactive at most 3 s: a batch promise is longer than any
    # interactive one, so interactive arrivals pass queued batch requests whatever it does to them.
    c, clock = make(
        limit=1,
        max_queue=8,
        max_wait=10.0,
        max_waits={"interactive": 3.0, "batch": 20.0},
        returning_share=0.0,
    )
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    b0 = ticket(c.submit(fresh("batch")))
    b1 = ticket(c.submit(fresh("batch", budget=4.5)))  # 2 s wait + 1 s service: 1.5 s to spare
    first, second, third = (ticket(c.submit(fresh())) for _ in range(3))  # 1, 2 and 3 s away
    assert c.serve_order() == [first, second, third, b0, b1]  # b1 now 5 + 1 s, past its 4.5 s
    # Past it even as the recheck judges it (as if a slot freed now: 4 + 1 s): turned away,
    # told when to come back.
    late = c.recheck().expired
    assert late == [b1]
    assert late[0].rejection is not None
    assert late[0].rejection.code == "queue_timeout"
    assert late[0].rejection.retry_after > 0
    assert c.serve_order() == [first, second, third, b0]


def test_returning_callers_go_first_only_where_they_make_nobody_late(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=8, max_wait=10.0, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    first, second = ticket(c.submit(fresh())), ticket(c.submit(fresh(budget=4.5)))  # 1 s and 2 s away
    r1 = ticket(c.submit(back()))  # ahead of both: second 3 + 1 s, within 4.5 s
    r2 = ticket(c.submit(back()))  # ahead of both would make second late: right after it
    assert c.serve_order() == [r1, first, second, r2]
    assert not c.recheck()


def test_a_budget_is_a_promise_too(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=8, max_wait=30.0, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    short = ticket(c.submit(fresh("batch", budget=2.5)))  # 1 s wait + 1 s service: fits
    later = ticket(c.submit(fresh()))  # ahead of it: 2 s wait + 1 s service > 2.5 s
    assert c.serve_order() == [short, later]
    assert not c.recheck()


def test_the_recheck_turns_away_at_once_those_the_estimate_now_says_are_late(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=8, max_wait=3.5, returning_share=0.0)
    measure(c, clock, 1.0)
    running = ticket(c.submit(fresh()))
    queued = [ticket(c.submit(fresh("batch"))) for _ in range(3)]  # 1, 2, 3 s
    assert not c.recheck()
    clock.now += 3.0
    moved = c.release(running, Outcome.COMPLETED)  # 3 s, not 1 s: the estimate grows to 1.4 s
    assert c.estimator.service_time == pytest.approx(1.4)
    assert moved.admitted == queued[:1]
    # 0.5 s of limit left each. The new head is not judged late: the estimate does not know how
    # long the request in flight has run, so it is judged on a slot freeing now (0 s). The one
    # behind it needs one more slot, 1.4 s at the soonest: it cannot make it.
    assert moved.expired == queued[2:]
    refusal = queued[2].rejection
    assert refusal is not None
    assert refusal.code == "queue_timeout"
    assert "overtaken in the queue" in refusal.message
    assert refusal.retry_after > 0
    assert c.overtaken_total == 1
    assert c.queued() == 1


def test_a_guaranteed_minimum_share_keeps_batch_requests_it_will_serve(make: MakeController) -> None:
    shares = SharedSlots(ClassShares(minimum={"batch": 0.5}))  # 1 of 2 slots for batch
    c, clock = make(limit=2, max_queue=8, max_wait=2.2, returning_share=0.0, scheduler=shares)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    ticket(c.submit(fresh("batch")))
    batch = ticket(c.submit(fresh("batch")))  # its share serves it within 1 s
    # Interactive drains at 1 slot (the other is batch's): 1 s and 2 s, within 2.2 s.
    ahead = [ticket(c.submit(fresh())) for _ in range(2)]
    assert c.serve_order() == [*ahead, batch]  # they go ahead: it stays within its share's time
    assert rejection(c.submit(fresh())).code == "queue_full"  # 3 s
    assert not c.recheck()
    assert batch.state is TicketState.QUEUED


def test_nothing_is_rechecked_on_the_prior_alone(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=8, max_wait=0.5, returning_share=0.0)
    ticket(c.submit(fresh()))
    ticket(c.submit(fresh("batch")))
    for _ in range(5):
        ticket(c.submit(fresh()))
    assert not c.recheck()


async def test_a_waiter_the_estimate_says_is_late_is_answered_at_once(make: MakeController) -> None:
    c, clock = make(limit=2, max_queue=8, max_wait=2.0, returning_share=0.0)
    measure(c, clock, 1.0)
    admission = AsyncAdmission(c, clock)
    slow = await admission.acquire(fresh())
    assert isinstance(slow, Grant)
    clock.now += 20.0
    other = await admission.acquire(fresh())
    assert isinstance(other, Grant)
    b1, b2, b3 = (asyncio.create_task(admission.acquire(fresh("batch"))) for _ in range(3))
    await asyncio.sleep(0)
    assert admission.waiting == 3  # 0.5, 1 and 1.5 s of their 2 s
    clock.now += 0.2
    admission.release(slow, Outcome.COMPLETED)  # 20.2 s: the estimate grows to 4.84 s
    first = await asyncio.wait_for(b1, 1.0)
    assert isinstance(first, Grant)
    refused = await asyncio.wait_for(b3, 1.0)  # a slot ahead of it: answered now, not in 1.8 s
    assert isinstance(refused, Rejection)
    assert refused.code == "queue_timeout"
    assert c.overtaken_total == 1
    assert not b2.done()  # at the head: a slot may free any moment
    admission.release(first, Outcome.COMPLETED)
    second = await asyncio.wait_for(b2, 1.0)
    assert isinstance(second, Grant)
    for grant in (second, other):
        admission.release(grant, Outcome.COMPLETED)
    assert (c.in_flight(), c.queued(), admission.waiting) == (0, 0, 0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    limit=st.integers(1, 3),
    max_queue=st.integers(0, 8),
    steps=st.integers(1, 80),
)
def test_any_mix_with_returning_callers_leaves_nothing_behind(
    make: MakeController, seed: int, limit: int, max_queue: int, steps: int
) -> None:
    rng = random.Random(seed)
    shares = SharedSlots(ClassShares(reserved={"interactive": 0.3}, minimum={"batch": 0.3}))
    c, clock = make(
        limit=limit, max_queue=max_queue, max_wait=2.0, max_queue_total=max_queue + 1, scheduler=shares
    )
    live: list[Ticket] = []
    for _ in range(steps):
        clock.now += rng.random() * 0.5
        op = rng.random()
        if op < 0.5:
            request = AdmissionRequest(
                rng.choice(["interactive", "batch"]),
                budget=rng.choice([None, 0.5, 3.0]),
                retry=rng.choice([0, 0, 1, 2]),
            )
            decision = c.submit(request)
            if isinstance(decision, Ticket):
                live.append(decision)
                c.recheck()
        elif live:
            t = rng.choice(live)
            if t.state is TicketState.ADMITTED:
                c.release(t, rng.choice(list(Outcome)))
            elif t.state is TicketState.QUEUED:
                c.expire(t) if rng.random() < 0.5 else c.cancel(t)
        # Returning requests of a class are always served before its fresh ones.
        for cls in c.classes:
            assert c.queued_returning(cls) <= c.queued(cls) <= max(max_queue, 0)
        assert c.in_flight() <= limit
    for t in live:
        if t.state is TicketState.QUEUED:
            c.cancel(t)
        if t.state is TicketState.ADMITTED:
            c.release(t, Outcome.COMPLETED)
    assert (c.in_flight(), c.queued()) == (0, 0)
    assert all(t.state in (TicketState.RELEASED, TicketState.CANCELLED, TicketState.EXPIRED) for t in live)


def test_a_guaranteed_share_bounds_the_wait_whatever_higher_classes_do(make: MakeController) -> None:
    shares = SharedSlots(ClassShares(minimum={"batch": 0.5}))
    c, clock = make(limit=2, max_queue=20, max_wait=3.0, returning_share=0.0, scheduler=shares)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    ticket(c.submit(fresh("batch")))
    for _ in range(3):
        ticket(c.submit(fresh()))  # 3 s of interactive work queued (it drains at 1 of the 2 slots)
    for _ in range(10):
        promise(c)  # and 10 interactive returns promised
    queued = ticket(c.submit(fresh("batch")))
    assert queued.state is TicketState.QUEUED  # its one guaranteed slot frees within 1 s


def test_returning_first_can_be_switched_off(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=4, returning_first=False)
    running = ticket(c.submit(fresh()))
    promise(c)  # a return is promised, yet no place is kept for it
    assert c.fresh_room(4, ["interactive"]) == 4
    f1, r1, f2 = (ticket(c.submit(r)) for r in (fresh(), back(), fresh()))
    assert c.queued_returning("interactive") == 0
    order = []
    current = running
    for _ in range(3):
        (current,) = c.release(current, Outcome.COMPLETED).admitted
        order.append(current)
    assert order == [f1, r1, f2]  # arrival order: the retry claim counts for nothing


def test_a_retry_without_a_budget_is_served_as_a_fresh_arrival(make: MakeController) -> None:
    # Without x-request-timeout-ms the shim cannot tell whether a retry served first would still
    # be in time for its caller: it keeps its arrival order.
    c, _ = make(limit=1, max_queue=4)
    running = ticket(c.submit(fresh()))
    f1, blind, r1 = (ticket(c.submit(r)) for r in (fresh(), back(budget=None), back()))
    assert c.queued_returning("interactive") == 1
    order = []
    current = running
    for _ in range(3):
        (current,) = c.release(current, Outcome.COMPLETED).admitted
        order.append(current)
    assert order == [r1, f1, blind]


@pytest.mark.parametrize("returning_first", [True, False])
def test_the_serve_flags_switch_returning_first(returning_first: bool) -> None:
    shim_settings = ShimSettings(
        upstream="http://127.0.0.1:9",
        max_concurrency=1,
        max_queue=4,
        returning_first=returning_first,
    )
    now = [0.0]
    controller = build_controller(shim_settings, lambda: now[0], tuning=Tuning(returning_share=0.5))
    holder = controller.submit(AdmissionRequest(cls="interactive"))
    assert isinstance(holder, Ticket)
    fresh = controller.submit(AdmissionRequest(cls="interactive", budget=60.0))
    retry = controller.submit(AdmissionRequest(cls="interactive", budget=60.0, retry=1))
    assert isinstance(fresh, Ticket)
    assert isinstance(retry, Ticket)
    now[0] += 1.0
    moved = controller.release(holder, Outcome.COMPLETED)
    assert moved.admitted == [retry if returning_first else fresh]


def test_a_caller_whose_budget_could_not_cover_the_service_at_the_hint_is_told_its_budget(
    make: MakeController,
) -> None:
    c, clock = make(limit=1, max_queue=3, max_wait=10.0, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    for _ in range(3):
        ticket(c.submit(fresh()))  # full; a retry would find room in about 4 s
    # Back at 4 s it would have 0.5 s left for 1 s of service: it is told 4.5 s, its whole
    # budget, so a client that keeps its deadline gives up now; and no return is expected.
    short = rejection(c.submit(fresh(budget=4.5)))
    assert short.code == "queue_full"
    assert short.retry_after == pytest.approx(4.5)
    assert c.estimator.promises.outstanding("interactive") == 0
    roomy = rejection(c.submit(fresh(budget=60.0)))  # enough left at the hint: the usual hint
    assert roomy.retry_after == pytest.approx(4.0)
    assert c.estimator.promises.outstanding("interactive") == 1


def test_a_higher_class_drains_only_the_slots_lower_shares_leave_it(make: MakeController) -> None:
    shares = SharedSlots(ClassShares(minimum={"batch": 0.25}))  # 1 of 4 slots
    c, clock = make(limit=4, max_queue=20, max_wait=1.1, returning_share=0.0, scheduler=shares)
    measure(c, clock, 1.0)
    for _ in range(4):
        ticket(c.submit(fresh()))
    # 3 slots per second for interactive: 1/3, 2/3, 1 s; the fourth (1.33 s) is past 1.1 s.
    queued = [ticket(c.submit(fresh())) for _ in range(3)]
    assert all(t.state is TicketState.QUEUED for t in queued)
    assert rejection(c.submit(fresh())).code == "queue_full"


def test_a_newcomer_leaves_a_queued_request_slack_for_the_estimates_error(make: MakeController) -> None:
    # 10 % of the 10 s limit: a queued request keeps 1 s in hand against newcomers.
    c, clock = make(limit=1, max_queue=8, max_wait=10.0, returning_share=0.0, promise_slack=0.1)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    b0 = ticket(c.submit(fresh("batch")))
    b1 = ticket(c.submit(fresh("batch", budget=5.5)))  # 2 s wait + 1 s service: 2.5 s to spare
    first = ticket(c.submit(fresh()))  # b1 then 3 + 1 s: 1.5 s to spare, more than 1 s
    assert c.serve_order() == [first, b0, b1]
    second = ticket(c.submit(fresh()))  # b1 would keep 0.5 s, less than 1 s: right after it
    assert c.serve_order() == [first, b0, b1, second]
    with pytest.raises(ValueError, match="promise_slack"):
        make(promise_slack=1.0)


def test_a_caller_without_a_budget_is_spread_but_no_slot_is_kept_for_it(make: MakeController) -> None:
    # It will come back as a fresh arrival (a retry is returning only with a budget), so a
    # slot kept for it would be kept for nobody; it still takes its place on the timeline.
    c, clock = make(limit=1, max_queue=1, max_wait=10.0, returning_share=0.0)
    measure(c, clock, 1.0)
    ticket(c.submit(fresh()))
    ticket(c.submit(fresh()))  # full
    plain = rejection(c.submit(fresh()))
    assert plain.retry_after == pytest.approx(2.0)
    assert c.estimator.promises.outstanding("interactive") == 0
    budgeted = rejection(c.submit(fresh(budget=60.0)))
    assert budgeted.retry_after == pytest.approx(3.0)  # the next slot after the plain caller's
    assert c.estimator.promises.outstanding("interactive") == 1
