"""Fair turns between tenants within a class (decide/queues.py), with a fake clock only."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller


@pytest.fixture(scope="module")
def make(make_controller: MakeController) -> MakeController:
    """One slot, fresh arrivals only, the exact estimate (as test_admission's)."""
    return functools.partial(
        make_controller,
        limit=1,
        max_queue=12,
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


def req(
    tenant: str | None, budget: float | None = None, cls: str = "interactive", retry: int = 0
) -> AdmissionRequest:
    return AdmissionRequest(cls=cls, budget=budget, tenant=tenant, retry=retry)


def served_order(c: AdmissionController, running: Ticket) -> list[Ticket]:
    """Release whatever runs, one at a time, until nothing is left: who was admitted, in order."""
    order: list[Ticket] = []
    while True:
        moved = c.release(running, Outcome.COMPLETED).admitted
        if not moved:
            return order
        order += moved
        (running,) = moved


def test_tenants_waiting_together_take_turns_first_come_first_served_within_one(make: MakeController) -> None:
    c, _ = make()
    running = ticket(c.submit(req("flood")))
    flood = [ticket(c.submit(req("flood"))) for _ in range(4)]
    quiet = [ticket(c.submit(req("quiet"))) for _ in range(2)]
    other = ticket(c.submit(req("other")))
    assert served_order(c, running) == [flood[0], quiet[0], other, flood[1], quiet[1], flood[2], flood[3]]


def test_a_tenant_alone_is_served_first_come_first_served(make: MakeController) -> None:
    c, _ = make()
    running = ticket(c.submit(req("solo")))
    queued = [ticket(c.submit(req("solo"))) for _ in range(5)]
    assert served_order(c, running) == queued


def test_a_newcomer_waits_in_the_round_being_served_not_from_the_first(make: MakeController) -> None:
    """A tenant that waited nowhere holds no credit: its turns start at the class's round now,
    not ahead of every round another tenant queued in."""
    c, _ = make()
    running = ticket(c.submit(req("a")))
    a = [ticket(c.submit(req("a"))) for _ in range(5)]  # rounds 0 to 4
    for t in (running, a[0], a[1]):
        c.release(t, Outcome.COMPLETED)
    assert a[2].state is TicketState.ADMITTED  # round 2 is being served
    b = [ticket(c.submit(req("b"))) for _ in range(3)]  # rounds 2 to 4
    assert served_order(c, a[2]) == [b[0], a[3], b[1], a[4], b[2]]


def test_a_tenants_returning_callers_take_its_own_turns_not_the_others(make: MakeController) -> None:
    """Retries of a flooding tenant go ahead of its own fresh calls, never ahead of another
    tenant's turn: each takes the tenant's next round and moves its fresh ones back."""
    c, _ = make()
    running = ticket(c.submit(req("a")))
    fresh = [ticket(c.submit(req("a"))) for _ in range(3)]
    b = ticket(c.submit(req("b")))
    back = [ticket(c.submit(req("a", budget=30.0, retry=1))) for _ in range(2)]
    assert all(t.returning for t in back)
    assert served_order(c, running) == [back[0], b, back[1], *fresh]


def test_a_full_queue_takes_a_tenant_below_its_share_in_the_floods_last_place(make: MakeController) -> None:
    c, _ = make(max_queue=3)
    ticket(c.submit(req("flood")))
    flood = [ticket(c.submit(req("flood"))) for _ in range(3)]
    refused = c.submit(req("flood"))
    assert isinstance(refused, Rejection)
    assert refused.code == "queue_full"

    quiet = ticket(c.submit(req("quiet")))
    assert quiet.state is TicketState.QUEUED
    # Its place was the flood's last: refused as a full queue refuses, with a hint.
    moved = c.take_moved()
    assert moved is not None
    assert moved.expired == [flood[2]]
    assert flood[2].state is TicketState.EXPIRED
    assert flood[2].rejection is not None
    assert flood[2].rejection.code == "queue_full"
    assert flood[2].rejection.retry_after > 0
    assert c.queued() == 3

    # Two tenants, three places: 1.5 each. Holding 1 it may take one more; holding 2, not.
    second = ticket(c.submit(req("quiet")))
    assert second.state is TicketState.QUEUED
    moved = c.take_moved()
    assert moved is not None
    assert moved.expired == [flood[1]]
    third = c.submit(req("quiet"))
    assert isinstance(third, Rejection)
    assert third.code == "queue_full"
    assert c.take_moved() is None
    assert [t.request.tenant for t in c._queues.serve_order()] == ["flood", "quiet", "quiet"]


def test_the_refusal_from_the_head_leaves_room_for_a_tenant_below_its_share(make: MakeController) -> None:
    c, _ = make(max_queue=2)
    ticket(c.submit(req("flood")))
    for _ in range(2):
        ticket(c.submit(req("flood")))
    refused = c.refuse_at_once(req("flood"))
    assert refused is not None
    assert refused.code == "queue_full"
    assert c.refuse_at_once(req("quiet")) is None
    assert c.queued() == 2


def test_a_quiet_tenants_wait_is_estimated_at_its_turn_not_behind_the_flood(make: MakeController) -> None:
    c, clock = make()
    first = ticket(c.submit(req("flood")))
    clock.now += 1.0
    c.release(first, Outcome.COMPLETED)  # service time measured: 1 s
    ticket(c.submit(req("flood")))
    flood = [ticket(c.submit(req("flood"))) for _ in range(10)]
    # Behind ten queued it would wait 10 s: past a 3 s budget. Its turn is after the first of
    # them, though the flood's last, 10 s from the head, then stands further back: its place is
    # after the quiet tenant's turn (placement.py).
    quiet = ticket(c.submit(req("quiet", budget=3.0)))
    assert quiet.state is TicketState.QUEUED
    assert c._queues.serve_order()[:2] == [flood[0], quiet]
    late = c.submit(req("flood", budget=3.0))
    assert isinstance(late, Rejection)
    assert late.code == "queue_timeout"


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["arrive", "arrive", "retry", "finish", "wait"]),
            st.sampled_from(["interactive", "batch"]),
        ),
        max_size=40,
    ),
    tenant=st.sampled_from([None, "solo"]),
)
def test_one_tenant_alone_is_served_in_arrival_order_within_each_class(
    make_controller: MakeController, steps: list[tuple[str, str]], tenant: str | None
) -> None:
    """Alone, a tenant's rounds rise along today's order: returning before fresh, then arrival,
    within each class (every key placement did not extend is where today's key puts it)."""
    c, clock = make_controller(limit=2, max_queue=4, max_wait=5.0, start=10.0)
    live: list[Ticket] = []
    admitted: dict[tuple[str, bool], list[int]] = {}

    def note(tickets: list[Ticket]) -> None:
        for t in tickets:
            admitted.setdefault((t.cls, t.returning), []).append(t.id)

    for step, cls in steps:
        if step in ("arrive", "retry"):
            retry = step == "retry"
            decision = c.submit(req(tenant, budget=30.0 if retry else None, cls=cls, retry=int(retry)))
            if isinstance(decision, Ticket):
                live.append(decision)
                if decision.state is TicketState.ADMITTED:
                    note([decision])
        elif step == "finish":
            running = [t for t in live if t.state is TicketState.ADMITTED]
            if running:
                note(c.release(running[0], Outcome.COMPLETED).admitted)
        else:
            clock.now += 0.7
        for queue in c._queues.lists.values():
            natural = [t for t in queue if len(t.key) == 4]
            assert natural == sorted(natural, key=lambda t: (not t.returning, t.id))
    for order in admitted.values():
        assert order == sorted(order)
