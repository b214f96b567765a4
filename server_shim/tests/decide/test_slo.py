"""Queue-time SLO states and shedding: pure units with a fake clock, then end to end on loopback."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.classes import ClassShares, SharedSlots
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.slo import SloConfig, SloGate, SloState, SloTracker
from llm_backoff_shim.decide.tickets import Outcome, Rejection, Ticket, TicketState
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller
Make = Callable[..., tuple[AdmissionController, SloTracker, ManualClock]]


@pytest.fixture(scope="module")
def make(make_controller: MakeController) -> Make:
    """A controller with the SLO gate and hold wired in as the shim wires them, its tracker, its clock."""

    def build(
        *, limit: int = 2, service: float = 1.0, budgets: dict[str, float] | None = None
    ) -> tuple[AdmissionController, SloTracker, ManualClock]:
        scheduler = SharedSlots(ClassShares())
        controller, clock = make_controller(
            limit,
            max_wait=600.0,
            start=100.0,
            scheduler=scheduler,
            retry_after_min=0.5,
            retry_after_max=120.0,
            initial_service_time=service,
        )
        tracker = SloTracker(
            SloConfig(budgets=budgets or {"interactive": 2.0, "batch": 20.0}, trend_window=1.0),
            controller,
            clock,
        )
        controller.gates.append(SloGate(tracker))
        scheduler.add_hold(tracker.holds)
        return controller, tracker, clock

    return build


def fill(c: AdmissionController, cls: str, n: int) -> list[Ticket]:
    """Queue ``n`` requests past the SLO gate (the tests build the queue they need)."""
    gates, c.gates = c.gates, []
    out = []
    try:
        for _ in range(n):
            decision = c.submit(AdmissionRequest(cls))
            assert isinstance(decision, Ticket), decision
            out.append(decision)
    finally:
        c.gates = gates
    return out


def test_projected_wait_counts_work_ahead_and_free_slots(make: Make) -> None:
    c, slo, _ = make(limit=2, service=1.0)  # drains 2 requests per second
    assert slo.projected_wait("interactive") == 0.0
    fill(c, "interactive", 2)
    assert slo.projected_wait("interactive") == pytest.approx(0.5)
    fill(c, "interactive", 1)  # one queued: a newcomer waits for 2 completions
    assert slo.projected_wait("interactive") == pytest.approx(1.0)
    # Batch waits behind the interactive queue too.
    assert slo.projected_wait("batch") == pytest.approx(1.0)


def test_head_queue_time_makes_red_even_when_the_estimate_is_optimistic(make: Make) -> None:
    c, slo, clock = make(limit=2, service=0.1, budgets={"interactive": 2.0})
    fill(c, "interactive", 3)
    assert slo.state("interactive") is SloState.GREEN
    clock.now += 2.5  # the engine is stuck: the head has waited longer than the budget
    reading = slo.reading("interactive")
    assert reading.state is SloState.RED
    assert reading.projected_wait >= 2.5


def test_green_yellow_red_as_the_queue_grows(make: Make) -> None:
    c, slo, clock = make(limit=2, service=1.0, budgets={"interactive": 2.0})
    fill(c, "interactive", 2)
    assert slo.state("interactive") is SloState.GREEN  # 0.5 s < 0.8 s (40 %)
    clock.now += 0.1
    fill(c, "interactive", 1)
    assert slo.state("interactive") is SloState.YELLOW  # 1.0 s >= 0.8 s and growing
    clock.now += 0.1
    fill(c, "interactive", 2)  # 2.0 s: the budget
    reading = slo.reading("interactive")
    assert reading.state is SloState.RED
    assert reading.budget == 2.0


def test_yellow_needs_growth_holds_while_steady_and_ends_when_shrinking(make: Make) -> None:
    c, slo, clock = make(limit=2, service=1.0, budgets={"batch": 5.0})
    fill(c, "batch", 2)
    assert slo.state("batch") is SloState.GREEN
    tickets = fill(c, "batch", 4)  # 2.5 s >= 40 % of 5 s, up from 0.5 s
    assert slo.state("batch") is SloState.YELLOW
    clock.now += 1.5
    assert slo.projected_wait("batch") == pytest.approx(2.5)
    assert slo.state("batch") is SloState.YELLOW  # steady for a whole window: stays (hysteresis)
    c.cancel(tickets[-1])
    assert slo.projected_wait("batch") == pytest.approx(2.0)  # still above 40 %, but shrinking
    assert slo.state("batch") is SloState.GREEN


def test_a_steady_high_wait_never_turns_yellow(make: Make) -> None:
    c, slo, clock = make(limit=2, service=1.0, budgets={"batch": 5.0})
    fill(c, "batch", 6)  # 2.5 s from the first sample on: no growth seen
    for _ in range(5):
        assert slo.state("batch") is SloState.GREEN
        clock.now += 0.3


def test_red_sheds_new_requests_with_a_hint_past_the_excess(make: Make) -> None:
    c, _, _ = make(limit=1, service=1.0, budgets={"interactive": 2.0})
    fill(c, "interactive", 5)  # newcomer would wait 5 s against a 2 s budget
    refused = c.submit(AdmissionRequest("interactive"))
    assert isinstance(refused, Rejection)
    assert refused.code == "slo_shed"
    assert "RED" in refused.message
    assert refused.retry_after >= 5.0 - 2.0
    assert c.queued("interactive") == 4


def test_yellow_sheds_batch_but_admits_interactive(make: Make) -> None:
    c, slo, clock = make(limit=2, service=1.0, budgets={"interactive": 10.0, "batch": 10.0})
    fill(c, "interactive", 2)
    slo.state("batch")
    slo.state("interactive")
    clock.now += 0.1
    fill(c, "interactive", 8)  # 4.5 s ahead of everyone: >= 40 % of 10 s and growing
    assert slo.state("interactive") is SloState.YELLOW
    assert slo.state("batch") is SloState.YELLOW
    queued = c.submit(AdmissionRequest("interactive"))
    assert isinstance(queued, Ticket)
    refused = c.submit(AdmissionRequest("batch"))
    assert isinstance(refused, Rejection)
    assert refused.code == "slo_shed"
    # Shed until the wait is back under 40 % (4 s): at least 5 s - 4 s away.
    assert refused.retry_after >= 1.0


def test_batch_is_held_while_interactive_is_under_pressure(make: Make) -> None:
    c, slo, clock = make(limit=2, service=1.0, budgets={"interactive": 2.0})
    batch = fill(c, "batch", 1)  # admitted while all is calm
    holders = fill(c, "interactive", 1)
    slo.state("interactive")
    clock.now += 0.1
    more = fill(c, "interactive", 2) + fill(c, "batch", 1)
    assert slo.state("interactive") is not SloState.GREEN
    # Batch's slot frees: it goes to interactive even though batch was queued first.
    moved = c.release(batch[0], Outcome.COMPLETED)
    assert moved.admitted == [more[0]]
    assert more[2].state is TicketState.QUEUED
    c.release(holders[0], Outcome.COMPLETED)
    c.release(more[0], Outcome.COMPLETED)
    c.release(more[1], Outcome.COMPLETED)
    assert more[2].state.value == "admitted"  # (a fresh read: mypy narrowed .state above)


def test_classes_without_a_budget_stay_green(make: Make) -> None:
    c, slo, _ = make(limit=1, budgets={"interactive": 1.0})
    fill(c, "batch", 30)
    assert slo.state("batch") is SloState.GREEN
    assert isinstance(c.submit(AdmissionRequest("batch")), Ticket)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="positive"):
        SloConfig(budgets={"interactive": 0.0})
    with pytest.raises(ValueError, match="yellow_fraction"):
        SloConfig(budgets={}, yellow_fraction=1.0)


# --------------------------------------------------------------------------- end to end


def chat(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers=headers or {},
        timeout=30,
    )


HOLD = {"x-fake-hold": "1"}


def test_red_sheds_with_a_correct_retry_after_and_reports_the_state(
    upstream: Any, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    """The engine holds every request (deterministic): the queue grows one by one until a newcomer's
    estimated wait reaches the 5 s budget; from then on newcomers are shed with slo_shed."""
    shim = make_shim(
        upstream.url,
        max_concurrency=1,
        max_queue=50,
        ttft_slo="interactive=5",
        initial_service_time=1.0,  # one completion per second: k queued = about k + 1 s of wait
        retry_after_max=60,
    )
    # No request before the flood: a measured instant completion would replace the 1 s prior.
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(chat, shim.url, HOLD)]
        waiter(lambda: shim.state()["interactive"] == (1, 0), what="the engine busy")
        shed: httpx.Response | None = None
        for queued in range(1, 12):
            futures.append(pool.submit(chat, shim.url, HOLD))
            waiter(
                lambda q=queued: shim.state()["interactive"][1] == q or futures[-1].done(),
                what="queued or answered",
            )
            if futures[-1].done():
                shed = futures.pop().result()
                break
        assert shed is not None, "a queue of 11 one-second requests must exceed a 5 s budget"
        queue_length = shim.state()["interactive"][1]
        assert 3 <= queue_length <= 5  # RED at about 4 s of estimated wait + the head's time so far
        again = chat(shim.url)  # still RED: shed at once, never queued
        upstream.release()
        served = [f.result() for f in futures]
    assert [r.status_code for r in served] == [200] * len(served)
    for response in (shed, again):
        assert response.status_code == 429
        error = response.json()["error"]
        assert error["code"] == "slo_shed"
        assert "RED" in error["message"]
        assert response.headers["x-slo-state"] == "red"
        hint = error["retry_after_seconds"]
        # Whole seconds, never earlier than the estimate, and past the excess over the budget.
        assert int(response.headers["retry-after"]) >= hint
        assert int(response.headers["retry-after"]) - hint < 1
        assert int(response.headers["retry-after-ms"]) == pytest.approx(hint * 1000, abs=1)
        # A retry is useful once the queue ahead has drained: (queued + 1) slots at 1 s each.
        assert hint >= queue_length + 1 - 0.01
    waiter(lambda: shim.state() == {"interactive": (0, 0), "batch": (0, 0)}, what="queues drained")
    samples = shim.metrics()
    key = (
        "llm_backoff_shim_requests_total",
        (("class", "interactive"), ("code", "slo_shed"), ("outcome", "rejected")),
    )
    assert samples[key] == 2
    # The queue drained: GREEN again, in the gauge and on the next answer.
    assert samples[("llm_backoff_shim_slo_state", (("class", "interactive"),))] == 0
    after = chat(shim.url)
    assert after.status_code == 200
    assert after.headers["x-slo-state"] == "green"
