"""What the admission controller shows the pieces that plug into it: gates and schedulers.

:class:`AdmissionView` is read-only; :class:`AdmissionGate` checks run before a request may
queue (SLO shedding, tenant quotas, engine saturation plug in here) and may refuse it with
their own code. Schedulers (:mod:`llm_backoff_shim.decide.scheduler`) read the same view.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from llm_backoff_shim.decide.requests import AdmissionRequest, ClassPolicy
from llm_backoff_shim.decide.tickets import Rejection


class ClassOutlook(NamedTuple):
    """The requests of one class the shim can foresee, for schedulers.

    ``promised``: callers told to come back and not back yet; ``due_soon``: those of them due
    within one service time, or already due (a client's jitter brings one back a little late);
    ``fresh_recently``: a fresh request (not a retry) arrived within the last service time.
    """

    promised: int
    due_soon: int
    fresh_recently: bool


class AdmissionView(Protocol):
    """Read-only state offered to gates and schedulers."""

    @property
    def classes(self) -> tuple[str, ...]: ...

    @property
    def limit(self) -> int: ...

    def now(self) -> float: ...

    def in_flight(self, cls: str | None = None) -> int: ...

    def queued(self, cls: str | None = None) -> int: ...

    def policy(self, cls: str) -> ClassPolicy: ...

    def outlook(self, cls: str) -> ClassOutlook: ...

    def next_run(self, cls: str) -> float | None: ...

    def head_waited(self, cls: str) -> float:
        """Share of its queue wait (arrival to deadline) the head of ``cls``'s queue has spent:
        0 for an empty queue, 1 at its deadline."""
        ...

    def share_due_in(self, cls: str) -> float:
        """Seconds before ``cls``'s minimum share is due to serve its queue's head (0: due now;
        :meth:`~llm_backoff_shim.decide.admission.AdmissionController.share_due_in`)."""
        ...


class AdmissionGate(Protocol):
    """A pre-admission check; return a refusal, its code and Retry-After its own, to turn the
    request away before it queues (the controller sets its queue depth)."""

    def check(self, request: AdmissionRequest, view: AdmissionView) -> Rejection | None: ...
