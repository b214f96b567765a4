"""Reserved and minimum shares between traffic classes (pure controller, fake clock, no sleeps)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.classes import ClassShares, SharedSlots, share_slots
from llm_backoff_shim.decide.drain_estimate import DrainEstimator, EstimatorConfig
from llm_backoff_shim.decide.limit import FixedLimit
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.retry_after import HintRequest, retry_after
from llm_backoff_shim.decide.tickets import Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.decide.waits import QueueWaits
from llm_backoff_shim.serve.request_path.waiting import AsyncAdmission, Grant
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller
Make = Callable[..., tuple[AdmissionController, SharedSlots]]
Reserving = Callable[..., tuple[AdmissionController, ManualClock]]


@pytest.fixture(scope="module")
def make(make_controller: MakeController) -> Make:
    """A controller over ``limit`` slots with an interactive reservation and a batch minimum share
    taken at once (``due_after=0``: the share's own mechanics; its timing has its own tests)."""

    def build(
        limit: int, *, reserved: float = 0.25, minimum: float = 0.0, queue: int = 100
    ) -> tuple[AdmissionController, SharedSlots]:
        shares = ClassShares(reserved={"interactive": reserved}, minimum={"batch": minimum}, due_after=0.0)
        scheduler = SharedSlots(shares)
        controller, _ = make_controller(limit, max_queue=queue, start=10.0, scheduler=scheduler)
        return controller, scheduler

    return build


Timed = Callable[..., tuple[AdmissionController, ManualClock]]


@pytest.fixture(scope="module")
def timed(make_controller: MakeController) -> Timed:
    """A controller with the shipped ``due_after`` and a batch minimum share, and its clock; batch
    waits up to 20 s in its queue, interactive 1 s."""

    def build(limit: int, *, minimum: float = 0.25, **shares: Any) -> tuple[AdmissionController, ManualClock]:
        scheduler = SharedSlots(ClassShares(minimum={"batch": minimum}, **shares))
        return make_controller(
            limit, max_waits={"interactive": 1.0, "batch": 20.0}, start=10.0, scheduler=scheduler
        )

    return build


def submit(c: AdmissionController, cls: str) -> Ticket:
    decision = c.submit(AdmissionRequest(cls))
    assert isinstance(decision, Ticket), decision
    return decision


def test_share_slots_rounds_up_and_stays_within_the_limit() -> None:
    assert share_slots(0.0, 8) == 0
    assert share_slots(0.25, 8) == 2
    assert share_slots(0.26, 8) == 3
    assert share_slots(0.01, 8) == 1
    assert share_slots(1.0, 3) == 3


def test_shares_are_validated() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        ClassShares(reserved={"interactive": 1.5})
    with pytest.raises(ValueError, match="more than 1"):
        ClassShares(reserved={"interactive": 0.7, "batch": 0.5})
    with pytest.raises(ValueError, match="due_after"):
        ClassShares(due_after=1.5)


def test_a_batch_flood_leaves_the_reserved_slots_to_interactive(make: Make) -> None:
    c, _ = make(8, reserved=0.25)
    batch = [submit(c, "batch") for _ in range(20)]
    assert sum(t.state is TicketState.ADMITTED for t in batch) == 6
    assert c.in_flight("batch") == 6
    assert c.queued("batch") == 14
    first = submit(c, "interactive")
    second = submit(c, "interactive")
    assert first.state is TicketState.ADMITTED
    assert second.state is TicketState.ADMITTED
    assert submit(c, "interactive").state is TicketState.QUEUED


def test_without_a_reservation_batch_takes_every_slot(make: Make) -> None:
    c, _ = make(8, reserved=0.0)
    for _ in range(10):
        submit(c, "batch")
    assert c.in_flight("batch") == 8
    assert submit(c, "interactive").state is TicketState.QUEUED


def test_interactive_beyond_its_reservation_does_not_lift_the_cap_on_batch(make: Make) -> None:
    c, _ = make(4, reserved=0.25)
    interactive = [submit(c, "interactive") for _ in range(3)]
    batch = [submit(c, "batch") for _ in range(4)]
    # 3 interactive use more than their 1 reserved slot, so one slot is left for batch.
    assert [t.state for t in batch] == [TicketState.ADMITTED] + [TicketState.QUEUED] * 3
    assert c.release(interactive[0], Outcome.COMPLETED).admitted == [batch[1]]
    assert c.release(interactive[1], Outcome.COMPLETED).admitted == [batch[2]]
    # Batch is at limit - reserved = 3: the slot interactive frees now stays free for it.
    assert c.release(interactive[2], Outcome.COMPLETED).admitted == []
    assert (c.in_flight("batch"), c.in_flight("interactive"), c.queued("batch")) == (3, 0, 1)
    assert submit(c, "interactive").state is TicketState.ADMITTED


def test_interactive_is_served_first_when_both_wait(make: Make) -> None:
    c, _ = make(2, reserved=0.0)
    holders = [submit(c, "interactive"), submit(c, "interactive")]
    batch = submit(c, "batch")
    interactive = submit(c, "interactive")
    assert c.release(holders[0], Outcome.COMPLETED).admitted == [interactive]
    assert batch.state is TicketState.QUEUED


def test_minimum_share_keeps_batch_moving_under_an_interactive_flood(make: Make) -> None:
    c, _ = make(4, reserved=0.25, minimum=0.25)
    holders = [submit(c, "interactive") for _ in range(4)]
    batch = submit(c, "batch")
    flood = [submit(c, "interactive") for _ in range(10)]
    assert all(t.state is TicketState.QUEUED for t in [batch, *flood])
    # Batch holds 0 < its 1 guaranteed slot: the next free slot is its, despite the flood.
    assert c.release(holders[0], Outcome.COMPLETED).admitted == [batch]
    # At its minimum share, batch waits behind interactive again.
    second_batch = submit(c, "batch")
    assert c.release(holders[1], Outcome.COMPLETED).admitted == [flood[0]]
    assert second_batch.state is TicketState.QUEUED


def _measured(c: AdmissionController, clock: ManualClock, service: float, slots: int) -> None:
    """Every slot served one request of exactly ``service`` seconds: the estimator's service
    time is ``service``, and every slot is free again."""
    done = [submit(c, "interactive") for _ in range(slots)]
    clock.advance(service)
    for ticket in done:
        assert c.release(ticket, Outcome.COMPLETED).admitted == []
    assert c.estimator.service_time == pytest.approx(service)


def test_minimum_share_is_due_at_the_batch_heads_latest_start(timed: Timed) -> None:
    """A peak of interactive traffic passes a queued batch request for as long as its deadline
    lets it: until two service times (its one place, and one for the estimate's error) before
    its 20 s wait ends, not once half of it was spent."""
    c, clock = timed(2)
    _measured(c, clock, 2.0, 2)
    holders = [submit(c, "interactive")]
    clock.advance(1.0)
    holders.append(submit(c, "interactive"))
    batch = submit(c, "batch")
    assert batch.state is TicketState.QUEUED
    # Each second a fresh interactive request comes and the oldest holder ends, after 2 s.
    for second in range(1, 16):
        clock.advance(1.0)
        fresh = submit(c, "interactive")
        assert c.release(holders.pop(0), Outcome.COMPLETED).admitted == [fresh], second
        holders.append(fresh)
        assert batch.state is TicketState.QUEUED
        assert c.share_due_in("batch") == pytest.approx(16.0 - second)
    assert c.head_waited("batch") == pytest.approx(0.75)  # half its wait long spent
    clock.advance(1.0)
    assert c.share_due_in("batch") == 0.0
    fresh = submit(c, "interactive")
    # At its latest start: the next free slot is batch's, whatever interactive has queued.
    assert c.release(holders.pop(0), Outcome.COMPLETED).admitted == [batch]
    assert fresh.state is TicketState.QUEUED


@pytest.mark.parametrize(
    ("service", "cost", "due_in"),
    [
        (None, 0, 10.0),  # nothing measured: half its wait, as the prior refuses nobody
        (8.0, 0, 10.0),  # a latest start before half its wait: half its wait
        (2.0, 0, 16.0),  # 20 s less 2 service times (one place, one for the error)
        (1.0, 300, 16.0),  # three places (cost 300 of a 400-token budget over 4 slots): 20 less 4
    ],
)
def test_share_due_in_is_the_heads_latest_start_and_never_before_due_after(
    make_controller: MakeController, service: float | None, cost: int, due_in: float
) -> None:
    scheduler = SharedSlots(ClassShares(minimum={"batch": 0.25}))
    c, clock = make_controller(
        4, max_waits={"interactive": 1.0, "batch": 20.0}, start=10.0, scheduler=scheduler, token_budget=400
    )
    if service is not None:
        _measured(c, clock, service, 4)
    holders = [submit(c, "interactive") for _ in range(4)]
    decision = c.submit(AdmissionRequest("batch", cost=cost))
    assert isinstance(decision, Ticket)
    assert decision.state is TicketState.QUEUED
    assert c.share_due_in("batch") == pytest.approx(due_in)
    # Not yet due: a free slot goes to interactive; once due, to batch.
    clock.advance(due_in - 0.5)
    assert c.share_due_in("batch") == pytest.approx(0.5)
    fresh = submit(c, "interactive")
    assert c.release(holders.pop(), Outcome.CLIENT_ERROR).admitted == [fresh]
    clock.advance(0.5)
    assert c.share_due_in("batch") == 0.0
    fresh = submit(c, "interactive")
    assert c.release(holders.pop(), Outcome.CLIENT_ERROR).admitted == [decision]
    assert fresh.state is TicketState.QUEUED


def test_the_share_counts_from_a_callers_budget_when_it_ends_first(timed: Timed) -> None:
    c, clock = timed(2)
    holders = [submit(c, "interactive") for _ in range(2)]
    decision = c.submit(AdmissionRequest("batch", budget=4.0))
    assert isinstance(decision, Ticket)
    clock.advance(1.9)
    flood = [submit(c, "interactive") for _ in range(3)]  # interactive waits up to 1 s
    assert c.release(holders[0], Outcome.COMPLETED).admitted == [flood[0]]
    clock.advance(0.1)  # half of its 4 s budget, not of batch's 20 s queue wait
    assert c.release(holders[1], Outcome.COMPLETED).admitted == [decision]


def test_due_after_zero_takes_the_share_at_once(timed: Timed) -> None:
    c, _ = timed(2, due_after=0.0)
    holders = [submit(c, "interactive") for _ in range(2)]
    batch = submit(c, "batch")
    submit(c, "interactive")
    assert c.release(holders[0], Outcome.COMPLETED).admitted == [batch]


@pytest.mark.parametrize("delay", [0.0, 7.0])
def test_the_wait_estimate_counts_the_share_from_when_it_is_due(delay: float) -> None:
    """A batch request far back in the serve order waits for its share, which serves it
    ``share_due_in`` later than a share taken at once; interactive's wait does not change."""
    clock = ManualClock(0.0)
    scheduler = SharedSlots(ClassShares(minimum={"batch": 0.25}))

    def build(due_in: float | None) -> QueueWaits:
        estimator = DrainEstimator(EstimatorConfig(), clock)
        due = None if due_in is None else (lambda cls: due_in)
        return QueueWaits(("interactive", "batch"), scheduler, estimator, FixedLimit(4), [], share_due_in=due)

    at_once, deferred = build(None), build(delay)
    by_share = at_once.at("batch", 400, 0, ())
    assert by_share < at_once.at("interactive", 400, 0, ())  # the share is what bounds it
    assert deferred.at("batch", 400, 0, ()) == pytest.approx(by_share + delay)
    assert deferred.at("interactive", 400, 0, ()) == at_once.at("interactive", 400, 0, ())
    walked, walked_at_once = deferred.walk()("batch", 400, 0, 1), at_once.walk()("batch", 400, 0, 1)
    assert walked == pytest.approx(walked_at_once + delay)


@pytest.mark.parametrize(("due_in", "expected"), [(10.0, 1.0), (0.5, 2.0), (0.0, 2.0)])
def test_a_lower_share_is_counted_out_only_once_it_may_come_due(due_in: float, expected: float) -> None:
    """A chat's wait drains on every slot when it ends before the batch share may come due, and
    on the slots left beside that share when it reaches it: with 4 idle slots of 1 s each, the
    8th slot frees at 1 s on 4 lanes, at 2 s on 3."""
    clock = ManualClock(0.0)
    estimator = DrainEstimator(EstimatorConfig(service_time_alpha=1.0), clock)
    estimator.observe_completion("interactive", 1.0)
    scheduler = SharedSlots(ClassShares(minimum={"batch": 0.25}))  # 1 slot of 4
    held: dict[str, list[float]] = {"interactive": [], "batch": []}
    waits = QueueWaits(
        ("interactive", "batch"), scheduler, estimator, FixedLimit(4), held, share_due_in=lambda cls: due_in
    )
    assert waits.at("interactive", 7, 7, ()) == pytest.approx(expected)
    assert waits.walk()("interactive", 7, 7, 1) == pytest.approx(expected)
    assert waits.whole_lanes("interactive", 4) == 4
    assert waits.lanes("interactive", 4) == (3, 0)


@pytest.mark.parametrize(("by_share", "expected"), [(1, 3.0), (0, 2.0)])
def test_a_lower_class_is_taken_to_be_served_by_its_share_while_its_share_holds_a_slot(
    by_share: int, expected: float
) -> None:
    """With a batch request in flight that its share admitted ahead of chats, the share's slot
    turns over to batch's next head as it ends, whatever its current head's due time: a chat's
    wait counts the share out. One admitted while no chat waited gives its slot to chat as it
    ends: until batch's head comes due, the wait drains on every slot."""
    clock = ManualClock(0.0)
    estimator = DrainEstimator(EstimatorConfig(service_time_alpha=1.0), clock)
    estimator.observe_completion("interactive", 1.0)
    estimator.observe_completion("batch", 1.0)
    scheduler = SharedSlots(ClassShares(minimum={"batch": 0.25}))  # 1 slot of 4
    held: dict[str, list[float]] = {"interactive": [0.0, 0.0, 0.0], "batch": []}
    serving = {"interactive": 0, "batch": 0}
    waits = QueueWaits(
        ("interactive", "batch"),
        scheduler,
        estimator,
        FixedLimit(4),
        held,
        share_due_in=lambda cls: 10.0,
        served_by_share=serving,
    )
    idle = waits.at("interactive", 6, 6, ())  # 4 lanes: 0, 1, 1, 1, 2, 2, 2 -> the 7th at 2 s
    held["batch"].append(0.0)
    serving["batch"] = by_share
    assert idle == pytest.approx(2.0)
    assert waits.at("interactive", 6, 6, ()) == pytest.approx(expected)  # 3 lanes: the 7th at 3 s
    assert waits.walk()("interactive", 6, 6, 1) == pytest.approx(expected)


def _chats_queued_before_a_refusal(c: AdmissionController) -> list[Ticket]:
    queued = []
    while isinstance(decision := c.submit(AdmissionRequest("interactive")), Ticket):
        assert decision.state is TicketState.QUEUED
        queued.append(decision)
    return queued


def test_a_chat_queue_drains_on_the_slot_of_batch_admitted_while_no_chat_waited(timed: Timed) -> None:
    """A batch request admitted on a free slot (no chat waiting) gives its slot to chat when it
    ends, so chats queue on all 4 lanes (a 0.9 s service each, 1 s chat wait: 4 places); one
    the share admitted ahead of a waiting chat keeps the share's slot for batch (3 places).
    Every slot and count comes back: afterwards a fresh batch request is again not counted."""
    c, clock = timed(4)
    _measured(c, clock, 0.9, 4)
    held = [submit(c, "batch"), *(submit(c, "interactive") for _ in range(3))]
    queued = _chats_queued_before_a_refusal(c)
    assert len(queued) == 4
    clock.advance(0.9)
    for ticket in held:
        c.release(ticket, Outcome.COMPLETED)  # each queued chat takes a slot
    clock.advance(0.9)
    for ticket in queued:
        c.release(ticket, Outcome.COMPLETED)
    assert c.in_flight() == 0

    chats = [submit(c, "interactive") for _ in range(4)]
    batch = submit(c, "batch")
    assert batch.state is TicketState.QUEUED
    clock.advance(c.share_due_in("batch"))
    waiting = submit(c, "interactive")
    # (Held for the share's due time: released unmeasured, so the service time stays 0.9 s.)
    assert c.release(chats.pop(), Outcome.CLIENT_ERROR).admitted == [batch]  # by its share
    assert c.release(chats.pop(), Outcome.CLIENT_ERROR).admitted == [waiting]
    for ticket in chats:
        c.release(ticket, Outcome.CLIENT_ERROR)
    held = [batch, waiting, submit(c, "interactive"), submit(c, "interactive")]
    queued = _chats_queued_before_a_refusal(c)
    assert len(queued) == 3

    clock.advance(0.9)
    for ticket in held:
        c.release(ticket, Outcome.COMPLETED)
    clock.advance(0.9)
    for ticket in queued:
        c.release(ticket, Outcome.COMPLETED)
    assert c.in_flight() == 0
    [submit(c, "batch"), *(submit(c, "interactive") for _ in range(3))]
    assert len(_chats_queued_before_a_refusal(c)) == 4


def test_the_highest_class_waits_on_its_own_turns_a_lower_one_on_every_class_s() -> None:
    """Chats queued ahead of a chat free their lanes at chat's pace once the chat lanes end; a
    batch request waits behind chats and batch alike, at the mean over every class."""
    clock = ManualClock(1000.0)
    estimator = DrainEstimator(EstimatorConfig(service_time_alpha=1.0), clock)
    estimator.observe_completion("interactive", 0.5)
    estimator.observe_completion("batch", 4.5)  # the mean over every class: the last, 4.5 s
    held = {"interactive": [1000.0, 1000.0], "batch": [1000.0, 1000.0]}
    waits = QueueWaits(("interactive", "batch"), SharedSlots(ClassShares()), estimator, FixedLimit(4), held)
    clock.advance(0.1)
    assert waits.at("interactive", 4, 4, ()) == pytest.approx(1.4)  # 0.4, 0.4, 0.9, 0.9, 1.4
    assert waits.walk()("interactive", 4, 4, 1) == pytest.approx(1.4)
    assert waits.at("batch", 4, 0, ()) == pytest.approx(0.4 + 4.5)  # 0.4, 0.4, 4.4, 4.4, 4.9
    assert waits.walk()("batch", 4, 0, 1) == pytest.approx(0.4 + 4.5)


def test_minimum_share_applies_even_when_the_reservation_covers_every_slot(make: Make) -> None:
    c, _ = make(1, reserved=1.0, minimum=0.1)
    assert submit(c, "batch").state is TicketState.ADMITTED


def test_a_reservation_never_takes_the_last_slot_of_an_idle_engine(make: Make) -> None:
    c, _ = make(2, reserved=1.0, minimum=0.0)
    assert [submit(c, "batch").state for _ in range(2)] == [TicketState.ADMITTED, TicketState.QUEUED]
    assert submit(c, "interactive").state is TicketState.ADMITTED


def test_a_hold_on_every_class_admits_nothing_until_rescheduled(make: Make) -> None:
    c, scheduler = make(4, reserved=0.0)
    saturated = True
    scheduler.add_hold(lambda cls: cls is None and saturated)
    tickets = [submit(c, "interactive"), submit(c, "batch")]
    assert all(t.state is TicketState.QUEUED for t in tickets)
    saturated = False
    moved = c.reschedule()
    assert moved.admitted == tickets
    assert c.in_flight() == 2


def test_a_class_hold_stops_batch_beyond_its_minimum_share(make: Make) -> None:
    c, scheduler = make(4, reserved=0.0, minimum=0.25)
    scheduler.add_hold(lambda cls: cls == "batch")
    batch = [submit(c, "batch") for _ in range(3)]
    assert [t.state for t in batch] == [TicketState.ADMITTED, TicketState.QUEUED, TicketState.QUEUED]
    assert submit(c, "interactive").state is TicketState.ADMITTED


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    limit=st.integers(1, 12),
    reserved=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
    minimum=st.sampled_from([0.0, 0.1, 0.3]),
    due_after=st.sampled_from([0.0, 0.5]),
)
def test_random_traffic_keeps_the_shares(
    make_controller: MakeController, seed: int, limit: int, reserved: float, minimum: float, due_after: float
) -> None:
    """Batch never exceeds max(its minimum, limit - reserved) unless it got there before, and
    whenever a decision is made, a waiting class below its minimum share whose head has spent
    ``due_after`` of its wait is not left waiting."""
    rng = random.Random(seed)
    shares = ClassShares(reserved={"interactive": reserved}, minimum={"batch": minimum}, due_after=due_after)
    scheduler = SharedSlots(shares)
    c, clock = make_controller(
        limit, max_queue=1000, max_waits={"interactive": 2.0, "batch": 10.0}, scheduler=scheduler
    )
    r = min(scheduler.reserved_slots("interactive", limit), limit - 1)
    m = scheduler.minimum_slots("batch", limit)
    admitted: list[Ticket] = []
    for _ in range(300):
        clock.advance(rng.choice([0.0, 0.0, 0.1, 0.5]))
        if admitted and rng.random() < 0.45:
            ticket = admitted.pop(rng.randrange(len(admitted)))
            dispatch = c.release(ticket, Outcome.COMPLETED)
        else:
            decision = c.submit(AdmissionRequest(rng.choice(["interactive", "batch"])))
            moved = c.take_moved()  # queued requests a submit admitted (time passed)
            if moved is not None:
                admitted.extend(moved.admitted)
            dispatch = c.reschedule()
            if isinstance(decision, Ticket) and decision.state is TicketState.ADMITTED:
                admitted.append(decision)
        admitted.extend(dispatch.admitted)
        assert c.in_flight() <= limit
        assert c.in_flight("batch") <= max(m, limit - r)
        if c.in_flight() < limit:
            # A free slot left idle must be one that batch may not use.
            assert c.queued("interactive") == 0
            if c.queued("batch"):
                assert c.in_flight("batch") >= m or c.share_due_in("batch") > 0
                assert limit - c.in_flight() - 1 < r - c.in_flight("interactive")
    while admitted:
        admitted.extend(c.release(admitted.pop(), Outcome.COMPLETED).admitted)
    assert (c.in_flight(), c.queued()) == (0, 0)


def test_class_flags_parse_maps_and_name_the_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from llm_backoff_shim.serve.config.sources import load_settings
    from llm_backoff_shim.serve.config.values import ConfigError

    s = load_settings(["--classes", "interactive,batch,bulk", "--min-share", "bulk=0.1,batch=0.2"])
    assert s.classes == ("interactive", "batch", "bulk")
    assert s.min_share == {"bulk": 0.1, "batch": 0.2}
    assert list(s.class_limits()) == ["interactive", "batch", "bulk"]
    assert s.vllm_priority() == {"interactive": 0, "batch": 1, "bulk": 2}
    monkeypatch.setenv("LLM_BACKOFF_SHIM_RESERVED_SHARE", '{"interactive": 0.5}')
    assert load_settings([]).reserved_share == {"interactive": 0.5}
    for argv, message in [
        (["--min-share", "nightly=0.1"], "unknown classes ['nightly']"),
        (["--reserved-share", "interactive"], "expected class=value pairs"),
        (["--reserved-share", "interactive=2"], "between 0 and 1"),
        (["--classes", "interactive,Batch!"], "lowercase letters"),
        (["--classes", "batch", "--min-share", ""], "default_class 'interactive' is not one of"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_settings(argv)


# --------------------------------------------------------------------------- end to end


def _post(url: str, cls: str, hold: bool = False) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-request-class": cls, **({"x-fake-hold": "1"} if hold else {})},
        timeout=60,
    )


def test_a_batch_flood_leaves_interactive_a_free_slot(
    upstream: Any, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    """The engine is held busy by batch work (deterministic, no timing): interactive requests
    still find the reserved slot at once, and batch completes once the engine moves again."""
    shim = make_shim(upstream.url, max_concurrency=4, max_queue=100, reserved_share="interactive=0.25")
    with ThreadPoolExecutor(24) as pool:
        flood = [pool.submit(_post, shim.url, "batch", True) for _ in range(20)]
        waiter(lambda: shim.state()["batch"] == (3, 17), what="batch holding 3 of 4 slots, 17 queued")
        probes = [_post(shim.url, "interactive") for _ in range(4)]
        assert shim.state()["batch"] == (3, 17)
        upstream.release()
        assert [f.result().status_code for f in flood] == [200] * 20
    assert [p.status_code for p in probes] == [200] * 4
    # Admitted on arrival every time: no interactive request waited behind the flood.
    assert [p.headers["x-queue-time-ms"] for p in probes] == ["0"] * 4
    assert upstream.peak == 4  # three batch + the interactive probe in the reserved slot
    waiter(lambda: shim.state() == {"interactive": (0, 0), "batch": (0, 0)}, what="all slots back")


def test_without_a_reservation_interactive_waits_but_goes_first(
    upstream: Any, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(upstream.url, max_concurrency=4, max_queue=100, reserved_share="", min_share="")
    with ThreadPoolExecutor(24) as pool:
        flood = [pool.submit(_post, shim.url, "batch", True) for _ in range(20)]
        waiter(lambda: shim.state()["batch"] == (4, 16), what="batch holding every slot")
        probe = pool.submit(_post, shim.url, "interactive")
        waiter(lambda: shim.state()["interactive"] == (0, 1), what="interactive queued")
        upstream.release()
        answer = probe.result()
        assert [f.result().status_code for f in flood] == [200] * 20
    assert answer.status_code == 200
    assert int(answer.headers["x-queue-time-ms"]) > 0
    # It was first in line: the upstream saw it right after the four batch requests held at the start.
    order = [r.headers for r in upstream.received]
    classes = [dict(h).get("x-request-class") for h in order]
    assert classes[:5] == ["batch"] * 4 + ["interactive"]


def test_the_simulator_serves_a_mixed_flood_through_the_shares(
    make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    """Against the vLLM-like simulator: a batch flood with interactive requests mixed in; every
    request of both classes completes, interactive ones within their 2 s budget (x-slo-state green)."""
    config = SimConfig(max_num_seqs=4, ttft=0.02, itl=0.002, output_tokens=10, seed=2)
    with ServerThread(create_sim_app(config)) as sim:
        shim = make_shim(
            sim.url,
            max_concurrency=4,
            max_queue=100,
            class_max_queue_wait={"batch": 60},
            ttft_slo="interactive=2",
        )
        with ThreadPoolExecutor(34) as pool:
            flood = [pool.submit(_post, shim.url, "batch") for _ in range(30)]
            probes = [pool.submit(_post, shim.url, "interactive") for _ in range(4)]
            answers = [f.result() for f in probes]
            assert [f.result().status_code for f in flood] == [200] * 30
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers["x-slo-state"] for a in answers} <= {"green", "yellow"}
    waiter(lambda: shim.state() == {"interactive": (0, 0), "batch": (0, 0)}, what="all slots back")


def test_forward_priority_sets_vllm_priority_from_the_class(
    upstream: Any, make_shim: Callable[..., Any]
) -> None:
    plain = make_shim(upstream.url)
    forwarding = make_shim(upstream.url, forward_priority=True)
    body = {"model": "m", "messages": [], "priority": -100}
    for shim in (plain, forwarding):
        for cls in ("interactive", "batch"):
            answer = httpx.post(
                shim.url + "/v1/chat/completions", json=body, headers={"x-request-class": cls}, timeout=10
            )
            assert answer.status_code == 200
    sent = [json.loads(r.body)["priority"] for r in upstream.received]
    # Off by default: the body goes through untouched; on: the class's position decides, not the caller.
    assert sent == [-100, -100, 0, 1]


# -- a reservation lent while its class's demand is known ----------------------------------


@pytest.fixture(scope="module")
def reserving(make_controller: MakeController) -> Reserving:
    """``reserving(limit, **max_waits)``: a controller with the default 25 % interactive
    reservation and its clock; ``max_waits``: a class's longest queue wait (60 s otherwise)."""

    def build(limit: int, **max_waits: float) -> tuple[AdmissionController, ManualClock]:
        scheduler = SharedSlots(ClassShares(reserved={"interactive": 0.25}))
        return make_controller(limit, max_waits=max_waits, start=10.0, scheduler=scheduler)

    return build


def served_in_a_second(c: AdmissionController, clock: ManualClock, cls: str) -> None:
    """One fresh request of ``cls``, served in 1 s: the service time is measured."""
    first = submit(c, cls)
    clock.advance(1.0)
    c.release(first, Outcome.COMPLETED)


def promise_interactive(c: AdmissionController, in_seconds: float) -> None:
    """Tell an interactive caller to come back in ``in_seconds`` (a promise on the timeline)."""
    retry_after(c.estimator, HintRequest("interactive", ahead=0, slots=c.limit, wait=in_seconds))


def test_a_reservation_is_lent_while_its_class_only_has_returns_not_yet_due(make: Make) -> None:
    # Interactive callers were told to come back in 5 s (one service time is 1 s): nothing of
    # interactive can arrive sooner but a caller nobody foresaw, and there was none lately.
    c, _ = make(8, reserved=0.25)
    promise_interactive(c, 5.0)
    batch = [submit(c, "batch") for _ in range(10)]
    assert c.in_flight("batch") == 8
    assert sum(t.state is TicketState.QUEUED for t in batch) == 2


def test_a_reservation_is_kept_when_a_return_is_due_within_a_service_time(make: Make) -> None:
    c, _ = make(8, reserved=0.25)
    promise_interactive(c, 5.0)
    promise_interactive(c, 0.5)
    [submit(c, "batch") for _ in range(10)]
    assert c.in_flight("batch") == 6
    assert c.outlook("interactive") == (2, 1, False)


def test_a_reservation_is_kept_without_promises(make: Make) -> None:
    c, _ = make(8, reserved=0.25)
    [submit(c, "batch") for _ in range(10)]
    assert c.in_flight("batch") == 6  # nothing promised: the reservation is for whoever comes
    assert c.outlook("interactive") == (0, 0, False)


def test_lending_starts_as_time_passes_and_the_next_submit_reports_who_moved(reserving: Reserving) -> None:
    c, clock = reserving(8)
    served_in_a_second(c, clock, "interactive")  # a fresh interactive arrival at t = 10
    promise_interactive(c, 5.0)  # and an interactive caller told to come back at t = 16
    queued = [submit(c, "batch") for _ in range(8)]
    assert c.in_flight("batch") == 6  # the fresh arrival was 1 s ago: the reservation holds
    assert c.take_moved() is None
    clock.advance(0.5)  # 1.5 s since the last fresh interactive arrival: lent from now on
    newcomer = submit(c, "batch")
    moved = c.take_moved()
    assert moved is not None
    assert moved.admitted == queued[6:]
    assert newcomer.state is TicketState.QUEUED
    assert c.in_flight("batch") == 8
    assert c.take_moved() is None  # taken once


async def test_the_asyncio_edge_resolves_the_requests_a_submit_moved(reserving: Reserving) -> None:
    c, clock = reserving(4)
    served_in_a_second(c, clock, "interactive")
    admission = AsyncAdmission(c, clock)
    promise_interactive(c, 5.0)
    held = [await admission.acquire(AdmissionRequest("batch")) for _ in range(3)]
    waiting = asyncio.create_task(admission.acquire(AdmissionRequest("batch")))
    await asyncio.sleep(0)
    assert admission.waiting == 1
    clock.advance(0.5)
    newcomer = asyncio.create_task(admission.acquire(AdmissionRequest("batch")))
    await asyncio.sleep(0)
    assert isinstance(await asyncio.wait_for(waiting, 1.0), Grant)  # told, not left holding a slot
    assert c.in_flight("batch") == 4
    assert admission.waiting == 1
    newcomer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await newcomer
    for grant in [*held, waiting.result()]:
        assert isinstance(grant, Grant)
        admission.release(grant, Outcome.COMPLETED)
    assert (c.in_flight(), c.queued(), admission.waiting) == (0, 0, 0)


def test_a_lower_class_wait_counts_only_the_slots_it_may_use(reserving: Reserving) -> None:
    # 8 slots, 2 kept for interactive: 6 batch requests in flight fill what batch may use. A
    # 7th must wait for one of them (about a service time), not for the two reserved slots
    # standing free: counted as free, it was queued on a wait of 0 s and turned away after
    # its whole max_queue_wait (the demo's late refusals).
    c, clock = reserving(8, batch=0.5)
    served_in_a_second(c, clock, "batch")
    batch = [submit(c, "batch") for _ in range(6)]
    assert all(t.state is TicketState.ADMITTED for t in batch)
    refused = c.submit(AdmissionRequest("batch"))
    assert isinstance(refused, Rejection)
    assert refused.code == "queue_full"
    assert "estimated queue wait 1.00 s exceeds the 0.5 s limit" in refused.message
    assert submit(c, "interactive").state is TicketState.ADMITTED  # the reservation is still there


# -- a reservation lent while its class expects nobody -------------------------------------


def batch(c: AdmissionController, max_tokens: int | None) -> Ticket:
    decision = c.submit(AdmissionRequest("batch", max_tokens=max_tokens))
    assert isinstance(decision, Ticket), decision
    return decision


def measured_at_100_tokens_a_second(c: AdmissionController, clock: ManualClock) -> None:
    first = batch(c, 100)
    clock.advance(1.0)
    c.release(first, Outcome.COMPLETED)
    assert c.estimator.token_rate == pytest.approx(100.0)


def test_a_reservation_is_lent_to_a_request_that_gives_it_back_within_the_ttft_budget(
    reserving: Reserving,
) -> None:
    c, clock = reserving(4, interactive=2.0)
    measured_at_100_tokens_a_second(c, clock)
    holders = [batch(c, 150) for _ in range(3)]  # the 3 unreserved slots
    assert all(t.state is TicketState.ADMITTED for t in holders)
    # Nobody interactive queued or promised: the reserved slot goes to a 1.5 s answer (<= 2 s).
    assert batch(c, 150).state is TicketState.ADMITTED
    assert c.in_flight("batch") == 4


@pytest.mark.parametrize("max_tokens", [250, None], ids=["too-long", "unknown-length"])
def test_a_reservation_is_not_lent_to_a_request_that_may_hold_it_past_the_budget(
    reserving: Reserving,
    max_tokens: int | None,
) -> None:
    c, clock = reserving(4, interactive=2.0)
    measured_at_100_tokens_a_second(c, clock)
    [batch(c, 100) for _ in range(3)]
    assert batch(c, max_tokens).state is TicketState.QUEUED  # 2.5 s > 2 s, or nobody knows
    assert c.in_flight("batch") == 3
    assert submit(c, "interactive").state is TicketState.ADMITTED  # the slot was kept


@pytest.mark.parametrize("max_tokens", [4096, None], ids=["4096", "unnamed"])
def test_once_answers_are_learned_a_request_is_lent_by_its_expected_answer(
    reserving: Reserving, max_tokens: int | None
) -> None:
    # Clients ask for 4096 tokens or name none; this engine's batch answers are 120 tokens. Judged
    # by max_tokens no request is ever lent the reserved slot (2 of 8 idle while batch waits);
    # judged by its answers, one 1.2 s answer gives it back within the 2 s budget.
    c, clock = reserving(4, interactive=2.0)
    for _ in range(16):  # answer_length.MIN_ANSWERS answers of 120 tokens at 100 a second
        ticket = batch(c, 4096)
        clock.advance(1.2)
        c.release(ticket, Outcome.COMPLETED, answer_tokens=120)
    assert c.estimator.token_rate == pytest.approx(100.0)
    assert c.expected_answer(AdmissionRequest("batch", max_tokens=max_tokens)) == 120
    [batch(c, max_tokens) for _ in range(3)]
    assert batch(c, max_tokens).state is TicketState.ADMITTED
    assert c.in_flight("batch") == 4
    # Its own max_tokens still caps what is expected of it.
    assert c.expected_answer(AdmissionRequest("batch", max_tokens=50)) == 50


def test_a_queued_short_request_takes_the_reservation_when_a_slot_frees(reserving: Reserving) -> None:
    c, clock = reserving(4, interactive=2.0)
    measured_at_100_tokens_a_second(c, clock)
    holders = [batch(c, 100) for _ in range(3)]
    long, short = batch(c, 500), batch(c, 50)
    assert (long.state, short.state) == (TicketState.QUEUED, TicketState.QUEUED)
    # A slot frees: the long one at the head takes it (unreserved), then the short one is lent
    # the reserved slot when the queue is walked again.
    moved = c.release(holders[0], Outcome.COMPLETED)
    assert moved.admitted == [long, short]
    assert c.in_flight("batch") == 4


def test_a_promised_or_queued_interactive_caller_keeps_the_reservation(reserving: Reserving) -> None:
    c, clock = reserving(4, interactive=2.0)
    measured_at_100_tokens_a_second(c, clock)
    promise_interactive(c, 0.5)  # due within a service time: the old rule keeps it too
    [batch(c, 100) for _ in range(3)]
    assert batch(c, 10).state is TicketState.QUEUED
    assert c.outlook("interactive").promised == 1


def test_without_a_token_rate_nothing_is_lent(reserving: Reserving) -> None:
    c, _ = reserving(4, interactive=2.0)
    [batch(c, 10) for _ in range(3)]
    assert batch(c, 10).state is TicketState.QUEUED  # no completion measured: no price
    assert c.estimator.token_rate is None


def test_through_the_shim_max_tokens_is_read_and_the_token_rate_measured(
    make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    config = SimConfig(max_num_seqs=2, ttft=0.01, itl=0.001, output_tokens=50, seed=3)
    with ServerThread(create_sim_app(config)) as sim:
        shim = make_shim(sim.url, max_concurrency=2)
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
        answer = httpx.post(shim.url + "/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200
        estimator = shim.runtime.controller.estimator
        # The slot is given back once the relay has ended, just after the client has its answer.
        waiter(lambda: estimator.token_rate is not None, what="the completion measured")
        assert estimator.run_time(7) == pytest.approx(estimator.service_time)
