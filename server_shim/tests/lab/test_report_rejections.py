"""The overload bench's breakdown of the shim's rejections, read from real admission messages."""

from __future__ import annotations

import json
from collections.abc import Callable

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.tickets import Outcome, Rejection, Ticket
from llm_backoff_shim.lab.figures import rejections_by_when
from llm_backoff_shim.testing import ManualClock

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller


def _line(rejection: Rejection | None) -> str:
    # What the proxy logs for a rejection: the message (without its hint) as ``detail``.
    assert rejection is not None
    return json.dumps({"outcome": "rejected", "code": rejection.code, "detail": rejection.message})


def _measured(make_controller: MakeController) -> tuple[AdmissionController, ManualClock, Ticket]:
    """One slot, 1 s measured per request, a request in flight since now."""
    c, clock = make_controller(
        1, classes=("interactive",), max_queue=4, max_wait=3.5, start=50.0, retry_after_min=0.1
    )
    first = c.submit(AdmissionRequest("interactive"))
    assert isinstance(first, Ticket)
    clock.now += 1.0
    c.release(first, Outcome.COMPLETED)
    running = c.submit(AdmissionRequest("interactive"))
    assert isinstance(running, Ticket)
    return c, clock, running


def test_each_way_a_request_is_refused_is_told_apart(make_controller: MakeController) -> None:
    c, clock, running = _measured(make_controller)
    at_arrival = c.submit(AdmissionRequest("interactive", budget=0.5))  # cannot cover 1 s of service
    queued = [c.submit(AdmissionRequest("interactive")) for _ in range(3)]  # 1, 2, 3 s
    assert all(isinstance(t, Ticket) for t in queued)
    clock.now += 2.4
    moved = c.release(running, Outcome.COMPLETED)  # 2.4 s: the last is 1.3 s away with 1.1 s left
    assert [t.rejection.message.split(":")[0] for t in moved.expired if t.rejection] == [
        "overtaken in the queue"
    ]
    head = queued[1]
    assert isinstance(head, Ticket)
    timed_out = c.expire(head)

    c2, clock2, running2 = _measured(make_controller)
    short = c2.submit(AdmissionRequest("interactive", budget=2.5))  # 1 s wait + 1 s service: fits
    assert isinstance(short, Ticket)
    clock2.now += 1.8  # 0.7 s left: less than the service when it reaches the head
    dropped = c2.release(running2, Outcome.COMPLETED).expired

    lines = [_line(at_arrival if isinstance(at_arrival, Rejection) else None)]
    lines += [_line(t.rejection) for t in moved.expired]
    lines += [_line(timed_out), *(_line(t.rejection) for t in dropped)]
    log = "\n".join(["not json", '{"outcome": "completed"}', *lines])
    assert rejections_by_when(log) == {"arrival": 1, "recheck": 1, "timer": 1, "head": 1}
