"""The pure admission controller, with a fake clock: no asyncio, no sockets, no sleeps."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.drain_estimate import DrainEstimator, EstimatorConfig
from llm_backoff_shim.decide.limit import FixedLimit
from llm_backoff_shim.decide.queues import ClassQueues
from llm_backoff_shim.decide.requests import AdmissionRequest, ClassPolicy, QuotaVerdict, UnknownClassError
from llm_backoff_shim.decide.tenants import QuotaGate
from llm_backoff_shim.decide.tickets import Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.decide.view import AdmissionView
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller


@pytest.fixture(scope="module")
def make(make_controller: MakeController) -> MakeController:
    """Two classes, fresh arrivals only (the places kept for returning ones:
    test_admission_returning) and the exact estimate (the slack kept for its error has its
    own test); hints as computed (the aim for clients' jitter: test_drain_estimate)."""
    return functools.partial(
        make_controller,
        limit=2,
        max_queue=3,
        max_wait=10.0,
        start=50.0,
        returning_share=0.0,
        promise_slack=0.0,
        retry_after_min=0.1,
        retry_after_max=100.0,
        return_jitter=0.0,
    )


def ticket(decision: Ticket | Rejection) -> Ticket:
    assert isinstance(decision, Ticket), decision
    return decision


def rejection(decision: Ticket | Rejection) -> Rejection:
    assert isinstance(decision, Rejection), decision
    return decision


def req(cls: str = "interactive", budget: float | None = None) -> AdmissionRequest:
    return AdmissionRequest(cls=cls, budget=budget)


def test_admits_up_to_the_limit_then_queues_then_rejects(make: MakeController) -> None:
    c, _ = make(limit=2, max_queue=3)
    states = [ticket(c.submit(req())).state for _ in range(5)]
    assert states == [TicketState.ADMITTED] * 2 + [TicketState.QUEUED] * 3
    refused = rejection(c.submit(req()))
    assert refused.code == "queue_full"
    assert refused.queue_depth == 3
    assert refused.type == "server_overloaded"
    assert refused.status is None
    assert (c.in_flight(), c.queued()) == (2, 3)


def test_release_admits_the_queue_head_in_fifo_order(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=3)
    running = ticket(c.submit(req()))
    queued = [ticket(c.submit(req())) for _ in range(3)]
    clock.now += 2.0
    moved = c.release(running, Outcome.COMPLETED)
    assert moved.admitted == [queued[0]]
    assert queued[0].queue_time == pytest.approx(2.0)
    assert c.release(queued[0], Outcome.COMPLETED).admitted == [queued[1]]


def test_interactive_is_served_before_batch(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=5)
    running = ticket(c.submit(req()))
    batch = ticket(c.submit(req("batch")))
    interactive = ticket(c.submit(req("interactive")))
    assert c.release(running, Outcome.COMPLETED).admitted == [interactive]
    assert c.release(interactive, Outcome.COMPLETED).admitted == [batch]


def test_total_queue_bound_holds_across_classes(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=3, max_queue_total=3)
    ticket(c.submit(req()))
    for cls in ("interactive", "batch", "batch"):
        assert ticket(c.submit(req(cls))).state is TicketState.QUEUED
    assert rejection(c.submit(req("interactive"))).code == "queue_full"
    assert c.queued() == 3


def test_a_class_without_a_bound_holds_what_the_slots_drain_within_its_wait(make: MakeController) -> None:
    # Before any request ended: one turn of the two slots, whatever the prior says.
    c, clock = make(
        limit=2, classes=("interactive",), max_queue=None, max_wait=10.0, initial_service_time=0.1
    )
    running = [ticket(c.submit(req())) for _ in range(2)]
    queued = [ticket(c.submit(req())) for _ in range(2)]
    assert all(t.state is TicketState.QUEUED for t in queued)
    full = rejection(c.submit(req()))
    assert (full.code, full.queue_depth) == ("queue_full", 2)
    # Measured at 1 s a request, the two slots drain 20 requests within the 10 s wait.
    clock.now += 1.0
    for t in running:
        c.release(t, Outcome.COMPLETED)
    assert c.queued("interactive") == 0
    assert [ticket(c.submit(req())).state for _ in range(20)] == [TicketState.QUEUED] * 20
    full = rejection(c.submit(req()))
    assert (full.code, full.message) == ("queue_full", "server at capacity (queue full)")


class MovingLimit:
    """A concurrency limit the test moves (an adaptive limit's, without its controller)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def on_complete(self, *, service_time: float, in_flight: int, overloaded: bool) -> None:
        return None


def test_a_derived_bound_follows_the_measured_service_time_and_the_limit() -> None:
    clock = ManualClock(0.0)
    estimator = DrainEstimator(EstimatorConfig(initial_service_time=1.0), clock)
    limit = MovingLimit(2)
    policies = {
        "interactive": ClassPolicy("interactive", None, 10.0),
        "batch": ClassPolicy("batch", None, 0.1),
        "bulk": ClassPolicy("bulk", 3, 10.0),
    }
    queues = ClassQueues(
        policies, estimator, limit, max_total=None, returning_share=0.0, returning_first=False
    )
    assert queues.bound("interactive") == 2  # nothing measured yet: one turn of the slots
    assert queues.bound("bulk") == 3  # a class with its own bound keeps it
    estimator.observe_completion("interactive", 1.0)
    assert (queues.bound("interactive"), queues.bound("batch")) == (20, 1)  # at least one place
    estimator.observe_completion("interactive", 16.0)  # the engine slows: EWMA 1 + 0.2 x 15 = 4 s
    assert queues.bound("interactive") == 5
    limit.limit = 8
    assert queues.bound("interactive") == 20


def test_the_highest_class_bound_turns_its_slots_over_at_its_own_service_time() -> None:
    """Chats are served before anyone queued below them, so the slots turn over at chat's pace
    for a chat queue: with chats of 0.5 s beside batch of 4.5 s (every class's mean 2.5 s with
    alpha 0.5), 4 slots drain 8 chats a second; batch's queue drains at every class's mean."""
    clock = ManualClock(0.0)
    estimator = DrainEstimator(EstimatorConfig(service_time_alpha=0.5), clock)
    policies = {c: ClassPolicy(c, None, 5.0) for c in ("interactive", "batch")}
    queues = ClassQueues(
        policies, estimator, FixedLimit(4), max_total=None, returning_share=0.0, returning_first=False
    )
    estimator.observe_completion("interactive", 0.5)
    estimator.observe_completion("batch", 4.5)
    assert estimator.service_time == pytest.approx(2.5)
    assert (queues.bound("interactive"), queues.bound("batch")) == (40, 8)


def test_zero_queue_admits_when_idle_and_rejects_when_busy(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=0)
    first = ticket(c.submit(req()))
    assert first.state is TicketState.ADMITTED
    assert rejection(c.submit(req())).code == "queue_full"
    assert c.queued() == 0
    c.release(first, Outcome.COMPLETED)
    assert ticket(c.submit(req())).state is TicketState.ADMITTED


def test_cancel_frees_a_queue_place_and_an_admitted_slot(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=1)
    running = ticket(c.submit(req()))
    waiting = ticket(c.submit(req()))
    assert c.cancel(waiting).admitted == []
    assert waiting.state is TicketState.CANCELLED
    assert c.queued() == 0
    again = ticket(c.submit(req()))
    moved = c.cancel(running)
    assert moved.admitted == [again]
    assert running.state is TicketState.RELEASED
    assert c.cancel(running).admitted == []  # idempotent


def test_a_stream_its_client_ended_teaches_its_slot_time_and_answer(make: MakeController) -> None:
    # The client closed the answer after it began: the engine held the slot 0.4 s for 30 tokens,
    # which is what the drain rate and the answer lengths measure; one that left before its
    # answer began (ABORTED) teaches nothing.
    c, clock = make(limit=1, initial_service_time=1.0, token_budget=10_000)
    assert c.pricing is not None
    for _ in range(16):  # answer_length.MIN_ANSWERS
        t = ticket(c.submit(AdmissionRequest(cls="interactive", stream=True, max_tokens=4096)))
        clock.now += 0.4
        c.release(t, Outcome.ENDED_BY_CLIENT, answer_tokens=30)
    assert (c.estimator.samples, c.estimator.service_time) == (16, pytest.approx(0.4))
    # The token rate counts the answer's 30 tokens, not the 4096 it could have had.
    assert c.estimator.token_rate == pytest.approx(30 / 0.4)
    assert c.pricing.answers.learned("interactive") == 30
    t = ticket(c.submit(req()))
    clock.now += 5.0
    c.release(t, Outcome.ABORTED, answer_tokens=999)
    assert (c.estimator.samples, c.estimator.service_time) == (16, pytest.approx(0.4))


def test_aborted_and_failed_requests_do_not_feed_the_service_time(make: MakeController) -> None:
    c, clock = make(limit=1, initial_service_time=1.0)
    for outcome in (Outcome.ABORTED, Outcome.UPSTREAM_ERROR, Outcome.OVERLOADED, Outcome.CLIENT_ERROR):
        t = ticket(c.submit(req()))
        clock.now += 0.01
        c.release(t, outcome)
    assert c.estimator.samples == 0
    t = ticket(c.submit(req()))
    clock.now += 3.0
    c.release(t, Outcome.COMPLETED)
    assert c.estimator.service_time == pytest.approx(3.0)


def test_release_twice_is_an_error(make: MakeController) -> None:
    c, _ = make()
    t = ticket(c.submit(req()))
    c.release(t, Outcome.COMPLETED)
    with pytest.raises(ValueError, match="not admitted"):
        c.release(t, Outcome.COMPLETED)


def test_expire_drops_a_queued_ticket_with_queue_timeout(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=2, max_wait=5.0)
    running = ticket(c.submit(req()))
    waiting = ticket(c.submit(req()))
    assert waiting.deadline == pytest.approx(clock.now + 5.0)
    clock.now += 5.0
    refused = c.expire(waiting)
    assert refused is not None
    assert refused.code == "queue_timeout"
    assert "waited the maximum 5 s" in refused.message
    assert c.queued() == 0
    assert c.expire(running) is None  # admitted tickets are not expired


def test_a_ticket_past_its_deadline_is_never_admitted(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=2, max_wait=5.0)
    running = ticket(c.submit(req()))
    stale = ticket(c.submit(req(budget=1.0)))
    fresh = ticket(c.submit(req()))
    clock.now += 2.0  # stale's budget is spent; its timer has not fired yet
    moved = c.release(running, Outcome.COMPLETED)
    assert moved.expired == [stale]
    assert moved.admitted == [fresh]
    assert stale.rejection is not None
    assert stale.rejection.code == "queue_timeout"
    assert "budget" in stale.rejection.message


def test_budget_shorter_than_estimated_wait_is_refused_at_once(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=5)
    first = ticket(c.submit(req()))
    clock.now += 2.0
    c.release(first, Outcome.COMPLETED)  # service time measured: 2 s
    ticket(c.submit(req()))
    refused = rejection(c.submit(req(budget=1.0)))
    assert refused.code == "queue_timeout"
    assert "estimated queue wait 2.00 s" in refused.message
    assert c.queued() == 0
    # 2 s of wait + 2 s of service: a 4 s budget suffices.
    assert ticket(c.submit(req(budget=4.0))).state is TicketState.QUEUED


def test_budget_is_not_judged_on_the_prior_alone(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=5, initial_service_time=100.0)
    ticket(c.submit(req()))
    assert ticket(c.submit(req(budget=1.0))).state is TicketState.QUEUED


def test_spent_budget_is_refused_even_when_idle(make: MakeController) -> None:
    c, _ = make()
    assert rejection(c.submit(req(budget=0.0))).code == "queue_timeout"
    assert c.in_flight() == 0


def test_rejection_hint_grows_with_depth(make: MakeController) -> None:
    c, clock = make(limit=1, max_queue=50, max_queues={"batch": 0}, initial_service_time=1.0)
    ticket(c.submit(req()))
    hints = []
    for _ in range(6):
        clock.now += 100.0  # past any earlier promise: measure depth only, not burst spreading
        hints.append(rejection(c.submit(req("batch"))).retry_after)
        ticket(c.submit(req()))
    # The request in flight has run 100 s past its expected 1 s: its slot is due now, so the
    # k-th hint is the k - 1 queued ahead at 1 s each (the first: the 0.1 s minimum).
    assert hints == pytest.approx([0.1, 1.0, 2.0, 3.0, 4.0, 5.0])


def test_slots_that_started_together_free_together(make: MakeController) -> None:
    # Four requests admitted at once, 1 s of service each; half a second later four more are
    # queued. Those four are served when the first four end (in 0.5 s), and the next caller a
    # service later (1.5 s). Evenly spread, as if the slots freed one by one at 4 per second,
    # it would be told 1.25 s and come back to find no slot.
    c, clock = make(limit=4, max_queue=50, max_queues={"batch": 0}, initial_service_time=1.0)
    for _ in range(4):
        ticket(c.submit(req()))
    clock.now += 0.5
    for _ in range(4):
        ticket(c.submit(req()))
    refused = rejection(c.submit(req("batch")))  # batch queue 0: told when a slot frees for it
    assert refused.retry_after == pytest.approx(1.5)
    assert c.estimator.expected_wait(4, 4, 0) == pytest.approx(1.25)  # the even estimate


def test_parse_class(make: MakeController) -> None:
    c, _ = make()
    assert c.parse_class(None) == "interactive"
    assert c.parse_class("  ") == "interactive"
    assert c.parse_class("Batch ") == "batch"
    with pytest.raises(UnknownClassError, match="unknown request class 'vip'"):
        c.parse_class("vip")
    with pytest.raises(UnknownClassError):
        c.submit(req("vip"))


class Refuse:
    def __init__(self, when_in_flight: int) -> None:
        self.when = when_in_flight
        self.seen: list[AdmissionRequest] = []

    def check(self, request: AdmissionRequest, view: AdmissionView) -> Rejection | None:
        self.seen.append(request)
        if view.in_flight() >= self.when:
            return Rejection(code="slo_shed", message="shed", retry_after=7.0, status=503)
        return None


def test_gates_run_before_queueing_and_can_refuse_with_their_own_code(make: MakeController) -> None:
    c, _ = make(limit=4)
    gate = Refuse(when_in_flight=1)
    c.gates.append(gate)
    ticket(c.submit(req()))
    refused = rejection(c.submit(AdmissionRequest("batch", tenant="t1")))
    assert (refused.code, refused.retry_after, refused.status) == ("slo_shed", 7.0, 503)
    assert gate.seen[-1].tenant == "t1"
    assert c.queued() == 0


class HoldForInteractive:
    """A scheduler that keeps the last slot for interactive (the hook reserved shares use)."""

    def pick(self, waiting: Sequence[str], view: AdmissionView) -> str | None:
        if "interactive" in waiting:
            return "interactive"
        return "batch" if view.in_flight() < view.limit - 1 else None


def test_the_quota_gate_refuses_what_the_tenant_quota_said_no_to(make: MakeController) -> None:
    c, _ = make(limit=1)
    c.gates.insert(0, QuotaGate(retry_after_min=0.1))
    ticket(c.submit(AdmissionRequest("interactive", quota=QuotaVerdict("t1"))))
    ticket(c.submit(req()))  # queued: the over-quota refusals below report it
    over = rejection(c.submit(AdmissionRequest("interactive", quota=QuotaVerdict("t1", retry_after=4.0))))
    assert (over.code, over.type, over.status, over.retry_after) == (
        "tenant_rate_limited",
        "rate_limit_exceeded",
        429,
        4.0,
    )
    assert over.message == "rate limit of tenant t1 reached"
    assert over.queue_depth == 1
    store = rejection(c.submit(AdmissionRequest("interactive", quota=QuotaVerdict("t1", store_error="Boom"))))
    assert (store.code, store.status, store.retry_after) == ("upstream_unavailable", 503, 0.1)
    assert "quota store unavailable (Boom)" in store.message
    assert (c.in_flight(), c.queued()) == (1, 1)


def test_a_scheduler_may_hold_a_slot_back(make_controller: MakeController) -> None:
    c, _ = make_controller(2, max_queue=5, max_wait=10.0, start=50.0, scheduler=HoldForInteractive())
    assert ticket(c.submit(req("batch"))).state is TicketState.ADMITTED
    assert ticket(c.submit(req("batch"))).state is TicketState.QUEUED
    assert ticket(c.submit(req("interactive"))).state is TicketState.ADMITTED


def test_constructor_validates() -> None:
    clock = ManualClock(50.0)
    est = DrainEstimator(EstimatorConfig(), clock)
    with pytest.raises(ValueError, match="at least one"):
        AdmissionController([], limit=FixedLimit(1), estimator=est, clock=clock)
    with pytest.raises(ValueError, match="duplicate"):
        AdmissionController(
            [ClassPolicy("a", 1, 1.0), ClassPolicy("a", 1, 1.0)],
            limit=FixedLimit(1),
            estimator=est,
            clock=clock,
        )
    with pytest.raises(ValueError, match="default class"):
        AdmissionController(
            [ClassPolicy("a", 1, 1.0)], limit=FixedLimit(1), estimator=est, clock=clock, default_class="b"
        )
    with pytest.raises(ValueError, match="max_queue_wait"):
        ClassPolicy("a", 1, 0.0)
    with pytest.raises(ValueError, match=">= 1"):
        FixedLimit(0)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    limit=st.integers(1, 4),
    max_queue=st.integers(0, 5),
    steps=st.integers(1, 120),
)
def test_any_mix_of_outcomes_leaves_nothing_behind(
    make: MakeController, seed: int, limit: int, max_queue: int, steps: int
) -> None:
    rng = random.Random(seed)
    c, clock = make(limit=limit, max_queue=max_queue, max_queue_total=max_queue + 1, max_wait=3.0)
    live: list[Ticket] = []
    admitted_order: dict[str, list[int]] = {"interactive": [], "batch": []}

    def note(tickets: list[Ticket]) -> None:
        for t in tickets:
            admitted_order[t.cls].append(t.id)

    for _ in range(steps):
        clock.now += rng.choice([0.0, 0.1, 1.0, 4.0])
        action = rng.random()
        if action < 0.45:
            budget = rng.choice([None, None, 0.5, 5.0])
            decision = c.submit(req(rng.choice(["interactive", "batch"]), budget))
            if isinstance(decision, Ticket):
                live.append(decision)
                if decision.state is TicketState.ADMITTED:
                    admitted_order[decision.cls].append(decision.id)
        elif live:
            t = rng.choice(live)
            if t.state is TicketState.ADMITTED:
                note(c.release(t, rng.choice(list(Outcome))).admitted)
            elif t.state is TicketState.QUEUED:
                if rng.random() < 0.5:
                    note(c.cancel(t).admitted)
                elif clock.now >= t.deadline:
                    c.expire(t)
        assert c.in_flight() <= limit
        assert c.queued() <= max_queue + 1
        for cls in ("interactive", "batch"):
            assert c.queued(cls) <= max_queue
        assert c.in_flight() == sum(t.state is TicketState.ADMITTED for t in live)
        assert c.queued() == sum(t.state is TicketState.QUEUED for t in live)
        # A free slot with someone waiting never persists.
        assert c.in_flight() == limit or c.queued() == 0
    # Drain: everyone finishes or leaves.
    for t in live:
        if t.state is TicketState.QUEUED:
            c.cancel(t)
    for _ in range(len(live)):
        for t in live:
            if t.state is TicketState.ADMITTED:
                c.release(t, Outcome.COMPLETED)
    assert (c.in_flight(), c.queued()) == (0, 0)
    # FIFO within a class: admission order follows arrival order.
    for cls, ids in admitted_order.items():
        assert ids == sorted(ids), cls


def stream_req(budget: float, cls: str = "interactive") -> AdmissionRequest:
    return AdmissionRequest(cls=cls, budget=budget, stream=True)


@pytest.fixture(scope="module")
def measured(make: MakeController) -> MakeController:
    """A controller whose estimator has measured one completion of ``service`` seconds."""

    def build(
        limit: int = 1,
        service: float = 2.0,
        first_byte: float | None = None,
        max_wait: float = 10.0,
        stream_served_at: Literal["end", "first_token"] = "end",
    ) -> tuple[AdmissionController, ManualClock]:
        c, clock = make(limit=limit, max_queue=10, max_wait=max_wait, stream_served_at=stream_served_at)
        t = ticket(c.submit(req()))
        clock.now += service
        c.release(t, Outcome.COMPLETED)
        if first_byte is not None:
            c.estimator.observe_first_byte(first_byte)
        return c, clock

    return build


def test_budget_must_cover_wait_plus_service_time_for_a_non_streaming_call(measured: MakeController) -> None:
    c, _ = measured(service=2.0)
    ticket(c.submit(req()))  # holds the only slot: the next waits ~2 s
    refused = rejection(c.submit(req(budget=3.5)))
    assert refused.code == "queue_timeout"
    assert "+ expected service time 2.00 s" in refused.message
    assert c.queued() == 0


def test_a_stream_needs_wait_plus_the_whole_service_by_default(measured: MakeController) -> None:
    c, _ = measured(service=2.0, first_byte=0.3)
    ticket(c.submit(req()))
    # Its deadline would cut the stream mid-way: 2 s wait + 2 s service must fit.
    assert ticket(c.submit(stream_req(4.5))).state is TicketState.QUEUED
    refused = rejection(c.submit(stream_req(3.9)))
    assert "expected service time 2.00 s" in refused.message


def test_a_stream_served_at_the_first_token_needs_only_wait_plus_first_token(
    measured: MakeController,
) -> None:
    c, _ = measured(service=2.0, first_byte=0.3, stream_served_at="first_token")
    ticket(c.submit(req()))
    # 2 s wait + 0.3 s to the first token fits 2.5 s; the whole 2 s service would not.
    assert ticket(c.submit(stream_req(2.5))).state is TicketState.QUEUED
    refused = rejection(c.submit(stream_req(2.2)))
    assert "expected time to first token 0.30 s" in refused.message


def test_a_budget_to_begin_needs_only_wait_plus_first_token_for_a_stream(measured: MakeController) -> None:
    c, clock = measured(service=2.0, first_byte=0.3)  # the shim-wide rule: the whole service
    running = ticket(c.submit(req()))
    to_start = AdmissionRequest(cls="interactive", budget=2.5, stream=True, budget_to_start=True)
    queued = ticket(c.submit(to_start))
    assert queued.state is TicketState.QUEUED  # 2 s wait + 0.3 s to the first token fit 2.5 s
    refused = rejection(c.submit(stream_req(2.5)))  # the same budget for the whole call
    assert "expected service time 2.00 s" in refused.message
    # Not for a non-streaming answer: it begins only at its end.
    whole = rejection(c.submit(AdmissionRequest(cls="interactive", budget=2.5, budget_to_start=True)))
    assert "expected service time 2.00 s" in whole.message
    # Slower than estimated, the budget to begin still covers the first token: it is served.
    clock.now += 2.1
    assert c.release(running, Outcome.COMPLETED).admitted == [queued]


def test_budget_below_service_is_refused_even_with_a_free_slot(measured: MakeController) -> None:
    c, _ = measured(limit=2, service=2.0)
    refused = rejection(c.submit(req(budget=1.0)))
    assert refused.code == "queue_timeout"
    assert "cannot cover the expected service time 2.00 s" in refused.message
    assert c.in_flight() == 0
    assert c.queued() == 0
    assert ticket(c.submit(req(budget=2.5))).state is TicketState.ADMITTED


def test_free_slot_and_short_budget_is_admitted_on_the_prior_alone(make: MakeController) -> None:
    c, _ = make(limit=1, initial_service_time=100.0)
    assert ticket(c.submit(req(budget=1.0))).state is TicketState.ADMITTED


def test_queued_call_whose_budget_no_longer_covers_service_is_dropped_when_dequeued(
    measured: MakeController,
) -> None:
    c, clock = measured(service=2.0)
    running = ticket(c.submit(req()))
    late = ticket(c.submit(req(budget=5.0)))  # 2 s wait + 2 s service fit in 5 s at arrival
    fresh = ticket(c.submit(req()))
    clock.now += 3.5  # the engine was slower than estimated: 1.5 s left < 2 s of service
    moved = c.release(running, Outcome.COMPLETED)
    assert moved.expired == [late]
    assert moved.admitted == [fresh]
    assert late.rejection is not None
    assert late.rejection.code == "queue_timeout"
    assert "remaining request budget 1.50 s cannot cover" in late.rejection.message
    assert c.in_flight() == 1
    assert c.queued() == 0


def test_wait_beyond_max_queue_wait_is_refused_at_once_as_queue_full(measured: MakeController) -> None:
    c, _ = measured(service=1.0, max_wait=3.0)
    ticket(c.submit(req()))  # in flight
    # Queued k-th (from 0) expects (k + 1) s: 1, 2, 3 s fit the 3 s limit, the fourth not.
    for _ in range(3):
        assert ticket(c.submit(req())).state is TicketState.QUEUED
    refused = rejection(c.submit(req()))
    assert refused.code == "queue_full"
    assert "estimated queue wait 4.00 s exceeds the 3 s limit" in refused.message
    assert refused.retry_after >= 4.0  # the queue ahead, not a constant
    assert c.queued() == 3


def test_max_queue_wait_estimate_counts_higher_priority_classes_only(measured: MakeController) -> None:
    c, _ = measured(service=1.0, max_wait=3.0)
    ticket(c.submit(req()))
    for _ in range(3):
        ticket(c.submit(req("interactive")))
    assert rejection(c.submit(req("batch"))).code == "queue_full"  # served after 3 interactive
    c2, _ = measured(service=1.0, max_wait=3.0)
    ticket(c2.submit(req()))
    batch = [ticket(c2.submit(req("batch"))) for _ in range(2)]  # 1 s and 2 s: room to spare
    # Strict priority: queued batch work does not delay an interactive newcomer.
    interactive = ticket(c2.submit(req("interactive")))
    assert c2.serve_order() == [interactive, *batch]


def test_a_newcomer_does_not_go_ahead_of_a_request_it_would_make_late(measured: MakeController) -> None:
    c, _ = measured(service=1.0, max_wait=3.5)
    ticket(c.submit(req()))
    batch = [ticket(c.submit(req("batch"))) for _ in range(3)]  # 1, 2, 3 s: the last has 0.5 s
    # Ahead of all three it would push the last to 4 s: it goes after it instead, where its
    # own wait (4 s) passes its 3.5 s limit, so it is refused at arrival.
    refused = rejection(c.submit(req("interactive")))
    assert refused.code == "queue_full"
    assert "estimated queue wait 4.00 s" in refused.message
    assert c.serve_order() == batch
    assert not c.recheck()


def test_a_newcomer_is_placed_right_after_the_last_request_it_would_make_late(
    measured: MakeController,
) -> None:
    c, _ = measured(service=1.0, max_wait=10.0)
    running = ticket(c.submit(req()))
    tight = ticket(c.submit(req("batch", budget=2.0)))  # 1 s wait + 1 s service: no room at all
    loose = ticket(c.submit(req("batch")))  # 2 s of its 10 s
    interactive = ticket(c.submit(req("interactive")))
    assert c.serve_order() == [tight, interactive, loose]
    assert not c.recheck()  # nobody was made late
    order = []
    current = running
    for _ in range(3):
        (current,) = c.release(current, Outcome.COMPLETED).admitted
        order.append(current)
    assert order == [tight, interactive, loose]
    assert c.overtaken_total == 0


def test_max_queue_wait_is_not_judged_on_the_prior_alone(make: MakeController) -> None:
    c, _ = make(limit=1, max_queue=10, max_wait=3.0, initial_service_time=100.0)
    ticket(c.submit(req()))
    assert all(ticket(c.submit(req())).state is TicketState.QUEUED for _ in range(10))


@pytest.mark.parametrize("seed", range(8))
def test_refuse_at_once_answers_as_submit_would_and_otherwise_changes_nothing(
    make: MakeController, seed: int
) -> None:
    """Two controllers see the same requests; one asks refuse_at_once first (as the relay does
    from a request's head), the other only submits. Their every answer and state agree."""
    rng = random.Random(seed)
    twins = [
        make(limit=3, max_queue=3, max_queues={"batch": 2}, max_queue_total=4, returning_share=0.5)
        for _ in range(2)
    ]
    held: list[list[Ticket]] = [[], []]
    answered_early = 0
    for _ in range(400):
        step = rng.random()
        elapsed = rng.choice([0.0, 0.05, 0.4])
        for _, clock in twins:
            clock.advance(elapsed)
        if step < 0.3 and held[0]:
            at = rng.randrange(len(held[0]))
            for (c, _), mine in zip(twins, held, strict=True):
                c.release(mine.pop(at), Outcome.COMPLETED)
        else:
            request = AdmissionRequest(
                cls=rng.choice(["interactive", "batch"]),
                budget=rng.choice([None, 0.0, 2.0, 30.0]),
                retry=rng.choice([0, 0, 1]),
            )
            early = twins[0][0].refuse_at_once(request)
            first = early if early is not None else twins[0][0].submit(request)
            second = twins[1][0].submit(request)
            if early is not None:
                answered_early += 1
                assert isinstance(second, Rejection)
            assert type(first) is type(second)
            if isinstance(first, Rejection):
                assert isinstance(second, Rejection)
                assert (first.code, first.retry_after, first.queue_depth) == (
                    second.code,
                    second.retry_after,
                    second.queue_depth,
                )
            else:
                assert isinstance(second, Ticket)
                assert first.state is second.state
                if first.state is TicketState.ADMITTED:
                    held[0].append(first)
                    held[1].append(second)
        states = [[(c.in_flight(cls), c.queued(cls)) for cls in ("interactive", "batch")] for c, _ in twins]
        assert states[0] == states[1]
    assert answered_early > 20  # the sequence does reach a full shim
