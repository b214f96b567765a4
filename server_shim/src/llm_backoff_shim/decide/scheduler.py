"""Who takes a free slot: the scheduler interface, the capabilities the controller asks of it,
and the plain strict-priority scheduler.

The shim runs :class:`~llm_backoff_shim.decide.classes.SharedSlots` (reserved and minimum
shares, holds); a scheduler that guarantees or reserves slots says so by implementing
:class:`MinimumShares` / :class:`ReservedShares`, and the wait estimates count those slots
(:mod:`llm_backoff_shim.decide.waits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from llm_backoff_shim.decide.view import AdmissionView


class ClassScheduler(Protocol):
    """Chooses whose queue head takes the next free slot.

    ``waiting`` lists the classes with queued requests in the order their queue heads are
    due: highest priority first, unless a request was placed behind a lower class's queued
    request to keep that one's promise (:mod:`llm_backoff_shim.decide.placement`). Return one
    of them, or None to keep the slot free (e.g. reserved for another class).
    """

    def pick(self, waiting: Sequence[str], view: AdmissionView) -> str | None: ...


@runtime_checkable
class MinimumShares(Protocol):
    """A scheduler that guarantees a class some slots whatever higher classes want, once the
    head of its queue has spent ``due_after`` of its queue wait (0: at once)."""

    def minimum_slots(self, cls: str, limit: int) -> int: ...

    @property
    def due_after(self) -> float: ...


@runtime_checkable
class ReservedShares(Protocol):
    """A scheduler that keeps some slots of a class from the classes below it."""

    def reserved_slots(self, cls: str, limit: int) -> int: ...


class StrictPriority:
    """Serve the highest-priority class with a queue; no shares, no holds."""

    def pick(self, waiting: Sequence[str], view: AdmissionView) -> str | None:
        return waiting[0] if waiting else None
