"""Property-based tests (hypothesis) of the shim's pure parts, fake clock only.

- admission invariants of the controller the shim really builds (``build_controller``
  with its class scheduler: reservations, minimum shares), driven by a hypothesis
  state machine: never more than the cap in flight, never more than the queue bounds
  waiting, first come first served within a tenant of a class (within the class for one
  tenant alone; whatever placement does across classes), every admitted request released
  exactly once, every ticket ends in exactly one final state; with a cost budget (drawn, or
  none), the cost in flight is the admitted requests' (in all and per class), each class's
  own stays within the budget unless one of its requests runs alone (or, for a lower class,
  was admitted with nothing of a class above it queued or in flight), and it comes back to
  zero whatever the mix of outcomes;
- the request-target check: whatever the encoding tricks, an accepted path stays
  under ``/v1/`` even for an upstream that decodes once more;
- the Retry-After the shim writes is read back by the SDK as the same estimate.
"""

from __future__ import annotations

import math
import posixpath
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llm_backoff.retry_after import hint_from_body, parse_hint
from llm_backoff_shim.decide.limit import FixedLimit
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.serve.api.rejection import rejection_response, retry_after_header
from llm_backoff_shim.serve.app import build_controller
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.request_path.proxy import is_allowed_path
from llm_backoff_shim.testing import ManualClock

CLASSES = ("interactive", "batch")


class CountingLimit(FixedLimit):
    """A fixed cap that counts how many slots were handed back."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.completions = 0

    def on_complete(self, *, service_time: float, in_flight: int, overloaded: bool) -> None:
        self.completions += 1


class AdmissionMachine(RuleBasedStateMachine):
    """Random arrivals, completions, disconnects, deadlines and clock jumps."""

    def __init__(self) -> None:
        super().__init__()
        self.configured = False

    @precondition(lambda self: not self.configured)
    @rule(
        limit=st.integers(1, 6),
        max_queue=st.integers(0, 6),
        batch_queue=st.integers(0, 6),
        reserved=st.sampled_from([0.0, 0.25, 0.5]),
        minimum=st.sampled_from([0.0, 0.1, 0.5]),
        tokens=st.sampled_from([None, None, 100, 400, 2000]),
        tenants=st.sampled_from([1, 1, 3]),
    )
    def configure(
        self,
        limit: int,
        max_queue: int,
        batch_queue: int,
        reserved: float,
        minimum: float,
        tokens: int | None = None,
        tenants: int = 1,
    ) -> None:
        self.clock = ManualClock(1000.0)
        self.tenants = tenants
        self.settings = ShimSettings(
            max_concurrency=limit,
            max_queue=max_queue,
            class_max_queue={"batch": batch_queue},
            max_queue_wait=5.0,
            reserved_share={"interactive": reserved},
            min_share={"batch": minimum},
            max_inflight_tokens=tokens,
        )
        self.limit_obj = CountingLimit(limit)
        self.c = build_controller(self.settings, self.clock, self.limit_obj)
        self.tickets: list[Ticket] = []
        # Per class, tenant and lane (returning callers are served before fresh ones).
        self.admission_order: dict[tuple[str, str | None, bool], list[int]] = {}
        self.released: dict[int, int] = {}
        # Tickets of a lower class admitted while nothing of a class above it was queued or in
        # flight: the cost budget does not hold those (admission.py, "nobody above").
        self.unheld: set[int] = set()
        self.configured = True

    def _note(self, tickets: list[Ticket]) -> None:
        live = (TicketState.QUEUED, TicketState.ADMITTED)
        for t in tickets:
            self.admission_order.setdefault((t.cls, t.request.tenant, t.returning), []).append(t.id)
            above = CLASSES[: CLASSES.index(t.cls)]
            if above and not any(o.cls in above and o.state in live for o in self.tickets):
                self.unheld.add(t.id)

    @precondition(lambda self: self.configured)
    @rule(
        cls=st.sampled_from(CLASSES),
        budget=st.sampled_from([None, None, 0.5, 3.0, 30.0]),
        cost=st.sampled_from([0, 40, 40, 150, 900, 2500]),
        tenant=st.sampled_from([0, 0, 1, 2]),
        retry=st.sampled_from([0, 0, 0, 1]),
    )
    def arrive(self, cls: str, budget: float | None, cost: int = 0, tenant: int = 0, retry: int = 0) -> None:
        who = None if self.tenants == 1 else f"t{tenant % self.tenants}"
        request = AdmissionRequest(cls=cls, budget=budget, cost=cost, tenant=who, retry=retry)
        decision = self.c.submit(request)
        moved = self.c.take_moved()
        if moved is not None:
            # What the edge does with them: a place taken by a tenant below its share.
            self._note(moved.admitted)
            for t in moved.expired:
                assert t.state is TicketState.EXPIRED
                assert t.rejection is not None
                assert t.rejection.code == "queue_full"
                assert t.rejection.retry_after > 0
        if isinstance(decision, Rejection):
            assert decision.retry_after > 0
            assert math.isfinite(decision.retry_after)
            return
        self.tickets.append(decision)
        if decision.state is TicketState.ADMITTED:
            self._note([decision])

    @precondition(lambda self: self.configured)
    @rule(index=st.integers(0, 10_000), outcome=st.sampled_from(list(Outcome)))
    def finish(self, index: int, outcome: Outcome) -> None:
        running = [t for t in self.tickets if t.state is TicketState.ADMITTED]
        if not running:
            return
        t = running[index % len(running)]
        self._note(self.c.release(t, outcome).admitted)
        self.released[t.id] = self.released.get(t.id, 0) + 1
        with pytest.raises(ValueError, match="not admitted"):
            self.c.release(t, outcome)  # a second release is refused, never double-counted

    @precondition(lambda self: self.configured)
    @rule(index=st.integers(0, 10_000))
    def disconnect(self, index: int) -> None:
        live = [t for t in self.tickets if t.state in (TicketState.QUEUED, TicketState.ADMITTED)]
        if not live:
            return
        t = live[index % len(live)]
        was_admitted = t.state is TicketState.ADMITTED
        self._note(self.c.cancel(t).admitted)
        if was_admitted:
            self.released[t.id] = self.released.get(t.id, 0) + 1
        assert self.c.cancel(t).admitted == []  # cancelling twice does nothing

    @precondition(lambda self: self.configured)
    @rule(seconds=st.sampled_from([0.0, 0.2, 1.0, 6.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        for t in list(self.tickets):
            if t.state is TicketState.QUEUED and t.deadline <= self.clock.now:
                rejection = self.c.expire(t)  # what the asyncio timer does
                assert rejection is not None
                assert rejection.code == "queue_timeout"

    @invariant()
    def bounds_hold(self) -> None:
        if not self.configured:
            return
        c = self.c
        assert c.in_flight() <= self.settings.max_concurrency
        assert c.queued() <= self.settings.max_queue
        for cls in CLASSES:
            assert c.queued(cls) <= c.policy(cls).max_queue
            assert c.in_flight(cls) == sum(
                t.state is TicketState.ADMITTED and t.cls == cls for t in self.tickets
            )
            assert c.queued(cls) == sum(t.state is TicketState.QUEUED and t.cls == cls for t in self.tickets)
        for order in self.admission_order.values():
            assert order == sorted(order), "first come, first served within a tenant of a class"
        assert all(n == 1 for n in self.released.values())
        assert self.limit_obj.completions == len(self.released)
        running = [t for t in self.tickets if t.state is TicketState.ADMITTED]
        assert c.in_flight_tokens() == sum(t.request.cost for t in running)
        tokens = self.settings.max_inflight_tokens
        for cls in CLASSES:
            mine = [t for t in running if t.cls == cls]
            assert c.in_flight_tokens(cls) == sum(t.request.cost for t in mine)
            if tokens is not None and sum(t.request.cost > 0 for t in mine) > 1:
                # A class's own cost over the budget only alone (beside requests that cost
                # nothing at most: each admission counts its class's and the higher classes'),
                # or for a lower class once admitted with nobody above it to keep the engine
                # quick for.
                assert c.in_flight_tokens(cls) <= tokens or any(t.id in self.unheld for t in mine), (
                    f"{cls} over the cost budget, not alone"
                )
        # Nobody admitted after its queue deadline.
        for t in self.tickets:
            if t.admitted_at is not None:
                assert t.admitted_at <= t.deadline

    def teardown(self) -> None:
        if not self.configured:
            return
        # Drain: everyone still queued leaves, everyone running finishes.
        for t in self.tickets:
            if t.state is TicketState.QUEUED:
                self.c.cancel(t)
        while any(t.state is TicketState.ADMITTED for t in self.tickets):
            for t in self.tickets:
                if t.state is TicketState.ADMITTED:
                    self.c.release(t, Outcome.COMPLETED)
                    self.released[t.id] = self.released.get(t.id, 0) + 1
        assert (self.c.in_flight(), self.c.queued(), self.c.in_flight_tokens()) == (0, 0, 0)
        final = {TicketState.RELEASED, TicketState.CANCELLED, TicketState.EXPIRED}
        assert all(t.state in final for t in self.tickets)
        ever_admitted = {t.id for t in self.tickets if t.admitted_at is not None}
        assert set(self.released) == ever_admitted
        assert all(n == 1 for n in self.released.values())
        assert self.limit_obj.completions == len(ever_admitted)


AdmissionMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestAdmissionInvariants = AdmissionMachine.TestCase


def test_a_request_placed_behind_a_lower_class_is_not_passed_by_a_later_one_of_its_class() -> None:
    """The shrunk example that found it: an interactive request placed behind a queued batch
    request (whose promise it would have broken) kept a key extending the batch request's,
    and a later interactive arrival, finding the batch request no longer tight, took its
    natural place ahead of both. First come, first served within a class must hold whatever
    placement does across classes."""
    m = AdmissionMachine()
    m.configure(batch_queue=1, limit=1, max_queue=5, minimum=0.0, reserved=0.0)
    for _ in range(5):
        m.arrive(budget=None, cls="interactive")
    m.arrive(budget=0.5, cls="batch")
    steps = ["finish"] * 4 + ["arrive", "arrive", "finish", "arrive", "finish", "finish"]
    for step in steps:
        if step == "finish":
            m.finish(index=0, outcome=Outcome.COMPLETED)
        else:
            m.arrive(budget=None, cls="interactive")
        m.bounds_hold()
    m.teardown()
    order = m.admission_order["interactive", None, False]
    assert order == sorted(order)
    assert len(order) == 7  # the two that met out of order included


# -- request targets -------------------------------------------------------------------------

PIECES = [
    "/",
    ".",
    "..",
    "%2e",
    "%2E",
    "%2f",
    "%2F",
    "%25",
    "%5c",
    "\\",
    "v1",
    "models",
    "x",
    "%00",
    "%0a",
    ";",
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12))
def test_an_accepted_target_stays_under_v1_even_if_the_upstream_decodes_again(pieces: list[str]) -> None:
    raw = "/v1/" + "".join(pieces)
    path = unquote(raw)  # what uvicorn puts in scope["path"]
    if not is_allowed_path(path):
        return
    for seen_by_upstream in (path, unquote(path)):
        assert seen_by_upstream.startswith("/v1/")
        assert ".." not in seen_by_upstream.split("/")
        assert posixpath.normpath(seen_by_upstream).startswith("/v1")
        assert "\\" not in seen_by_upstream
        assert not any(ord(ch) < 0x20 for ch in seen_by_upstream)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_accepted_path_is_under_v1(text: str) -> None:
    for path in (text, "/v1/" + text):
        if is_allowed_path(path):
            assert path.startswith("/v1/")
            assert ".." not in path.split("/")
            assert "%" not in path


# -- the Retry-After the shim writes, as the SDK reads it -------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), st.integers(0, 10_000))
def test_the_sdk_reads_the_shims_estimate_back(estimate: float, depth: int) -> None:
    rejection = Rejection(code="queue_full", message="full", retry_after=estimate, queue_depth=depth)
    response = rejection_response(rejection, 429)
    headers = {k.decode(): v.decode() for k, v in response.headers}
    whole = int(headers["retry-after"])
    assert whole >= 1
    assert whole >= estimate - 1e-6  # never tells a client to come back before the estimate
    assert whole == retry_after_header(estimate)
    hint = parse_hint(headers, response.body, wall_clock=lambda: 0.0)
    assert hint is not None
    assert hint.source == "retry-after-ms"
    assert abs(hint.seconds - max(0.001, estimate)) <= 0.0005 + 1e-9 * estimate
    from_body = hint_from_body(response.body)
    assert from_body is not None
    assert abs(from_body - estimate) <= 0.0005 + 1e-9 * estimate
