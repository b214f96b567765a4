"""The Retry-After hint: when a caller turned away should come back, in one place.

Every hint the controller gives from the queue is computed here from the drain estimates
(:mod:`llm_backoff_shim.decide.drain_estimate`) and the promise timeline
(:mod:`llm_backoff_shim.decide.promises`). What a hint is asked for is one
:class:`HintRequest`; :func:`retry_after` answers it. :class:`RefusalHints` asks it for a
caller the admission controller refuses, from that caller's place and budget. The hint of
an unreachable upstream is :class:`OutageClock`'s (below); a tenant over quota is told when
its buckets refill (:mod:`llm_backoff_shim.serve.policy.quota`, where the buckets are).

The hint is the first free place on the one timeline at or after the wait a retry would have
(behind what is queued now in its class and above), aimed so that a client adding jitter
above it comes back at its slot on average, and remembered as a promise the queues keep
places for (:mod:`llm_backoff_shim.decide.queues`) when the caller said how long it will wait.
A caller whose retry at the hint could no longer be served (less budget left when it comes
back than the time it needs once admitted) is told so instead, with a hint at least its
remaining budget: a client that honours its deadline (``llm_backoff`` does) then gives up now
with a typed error rather than spend an attempt, and the hint is not remembered as a promise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llm_backoff_shim.decide.drain_estimate import DrainEstimator
from llm_backoff_shim.decide.limit import ConcurrencyLimit
from llm_backoff_shim.decide.queues import ClassQueues
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.waits import QueueWaits, service_needed


@dataclass(frozen=True, slots=True)
class HintRequest:
    """What a hint is asked for: the next caller of ``cls`` turned away, with ``ahead`` requests
    that would be served before a retry of it, on ``slots`` slots.

    ``promised_by``: classes (higher ones) whose promised returns due before then come first.
    ``keep_within`` (seconds): the caller's remaining budget less the time it needs once
    admitted; a hint whose latest return is beyond it is not remembered as a promise (that
    caller may not come back in time). ``wait``, when given, replaces the estimate from
    ``ahead`` (the caller knows better, e.g. a class whose guaranteed share serves it sooner
    than strict priority would). ``aimed``: the hint told is :meth:`DrainEstimator.aim` of the
    slot's delay, for clients that add jitter above a hint (the admission controller's
    refusals); otherwise the slot's delay itself. ``reserve=False``: the caller takes its place
    on the timeline (later callers are spread after it) but its return is not remembered as a
    promise, so fresh arrivals do not keep its slot for it: for a caller the shim will not
    recognise as returning when it comes back (it sent no budget), which would compete for
    the slot as a fresh arrival, with the slot kept for nobody. ``reach`` (seconds from now,
    with ``keep_within``): the latest slot at which the caller can still be served (its
    remaining budget less the service it needs, the prior included). ``not_before`` (seconds
    from now): the earliest slot to give, e.g. a lower class kept out of the slots higher
    classes may need; the slots before it stay free for others.
    """

    cls: str
    ahead: int
    slots: int
    promised_by: tuple[str, ...] = ()
    keep_within: float | None = None
    wait: float | None = None
    aimed: bool = False
    reserve: bool = True
    reach: float | None = None
    not_before: float = 0.0


def retry_after(estimator: DrainEstimator, ask: HintRequest) -> float:
    """The spread, clamped hint (seconds) for ``ask`` (see :class:`HintRequest`).

    Grows with ``ahead`` (the queued work that would be served before a retry), with the
    promises of ``promised_by`` due before then, and with the number of callers (of any class)
    already told a slot in the current burst.

    A slot within ``reach`` whose aimed hint the caller might come back too late for is still
    promised, with the hint brought forward so that its latest return is ``reach`` (or
    ``keep_within`` if sooner): it comes back before its slot and waits in the queue for it.
    Without this, the last slots a caller's budget could use were promised to nobody, and the
    engine idled for them at the end of a burst.
    """
    est = estimator
    now = est.now()
    cfg = est.config
    timeline = est.promises
    # In a fleet every replica places each caller the fleet refuses, so each spaces its places
    # at the fleet's drain rate (promises.py, fleet_size.py); alone, at its own.
    rate = est.capacity_rate(ask.slots) * timeline.replicas
    step = 1.0 / rate
    # Nobody may come back before the minimum, so the burst's slots start there:
    # with a fast drain the k-th caller hears min + (k - 1) / rate, not min for all.
    wait = ask.wait
    if wait is None:
        wait = est.expected_wait(max(0, ask.ahead), ask.slots, 0, promised_by=ask.promised_by)
    earliest = max(cfg.retry_after_min, min(max(wait, ask.not_before), cfg.retry_after_max))
    promised = timeline.first_gap(now, now + earliest, step)
    delay = est.aim(promised - now) if ask.aimed else promised - now
    hint = min(cfg.retry_after_max, max(cfg.retry_after_min, delay))
    keep_within, reach = ask.keep_within, ask.reach
    latest = keep_within if reach is None or keep_within is None else min(keep_within, reach)
    if latest is not None and est.latest_return(hint) > latest:
        if reach is None or keep_within is None or promised - now > reach:
            return hint
        early = min(keep_within, reach) / (1.0 + cfg.return_jitter)
        if early < cfg.retry_after_min:
            return hint
        hint = early
    # Slots beyond the clamp are not kept, not even at the clamp: after a long overload
    # the next burst should not inherit a backlog of hints nobody will honour, and every
    # refusal past a full timeline would otherwise pile one more place at the clamp, so
    # that each refusal scanned all the ones before it (a storm of refusals cost more
    # and more: 100 -> 390 us each over 2,000 refusals at one instant, 8 slots). Places
    # are then at least a step apart within the clamp: at most retry_after_max * rate.
    if promised > now + cfg.retry_after_max:
        return hint
    timeline.take(promised)
    if ask.reserve:
        timeline.promise(ask.cls, promised, now)
    return hint


class RefusalHints:
    """The hint for each caller the admission controller refuses, from its place and budget
    (module docstring)."""

    def __init__(
        self,
        queues: ClassQueues,
        waits: QueueWaits,
        estimator: DrainEstimator,
        limit: ConcurrencyLimit,
        places_of: Callable[[AdmissionRequest], int] | None = None,
    ) -> None:
        self._places_of = places_of
        self._policies = queues.policies
        self._queues = queues
        self._waits = waits
        self._estimator = estimator
        self._limit = limit

    def for_caller(
        self, cls: str, budget_left: float | None = None, request: AdmissionRequest | None = None
    ) -> float:
        """The hint for a refused caller of ``cls``; ``budget_left``: its remaining budget, if
        known; ``request``: what it asked for (whether it needs the whole answer within that
        budget).

        The hint is aimed (:meth:`DrainEstimator.aim`): a client that adds jitter above it
        comes back at its slot on average. A retry at the hint (plus the client's jitter above
        it, :meth:`DrainEstimator.latest_return`) that would have less budget left than the
        time it needs once admitted cannot be served: such a caller is told a hint at least
        its remaining budget, not remembered as a promise (module docstring).
        """
        # A retry would come back returning, behind what is queued now in its class and above
        # (in queue places: a queued request costing several slots' share of a cost budget
        # stands for several, and so may the caller itself; waits.py).
        higher = self._queues.above(cls)
        queues = self._queues
        ahead, in_class = queues.places_ahead_of(cls), queues.places[cls]
        places = 1 if request is None or self._places_of is None else self._places_of(request)
        wait = self._waits.at(cls, ahead, in_class, higher, places)
        est = self._estimator
        usable = reach = None
        if budget_left is not None:
            need = est.expected_service(False) if request is None else service_needed(est, request)
            usable = budget_left - need
            # Whether its slot is within reach rests on the prior too: a slot promised on the
            # prior alone would otherwise run up to the end of the budget at a cold start.
            reach = budget_left - (need or est.service_time)
        # A lower-class caller that sent a budget reaching past the longest queue wait of the
        # classes above it is promised no slot before then: those slots are left to
        # higher-class callers (refused now or arriving meanwhile), whose budgets are usually
        # the shorter; the timeline fills gaps, so they can still be promised them.
        horizon = 0.0
        if usable is not None and higher:
            horizon = max(self._policies[c].max_queue_wait for c in higher)
            if est.latest_return(est.aim(horizon)) > usable:
                horizon = 0.0
        # Only a caller that says how long it will wait is served as returning when it comes
        # back (ClassQueues.is_returning); a slot kept for any other would be kept for nobody.
        hint = retry_after(
            est,
            HintRequest(
                cls,
                ahead,
                self._limit.limit,
                keep_within=usable,
                wait=wait,
                aimed=True,
                reserve=budget_left is not None,
                reach=reach,
                not_before=horizon,
            ),
        )
        # (1e-9: a hint brought forward to return by ``reach`` exactly, less rounding.)
        if reach is not None and budget_left is not None and est.latest_return(hint) > reach + 1e-9:
            hint = min(est.config.retry_after_max, max(hint, budget_left))
        return hint


class OutageClock:
    """The Retry-After of ``upstream_unavailable``: how long the engine has been unreachable.

    The queue estimate cannot help there (nothing drains while the engine is down), and a
    constant hint sends every caller back at the same short interval for as long as an outage
    lasts. The rule: an outage seen for ``t`` seconds is expected to last about ``t`` more, so
    callers are told to come back in ``t`` (clamped to ``[minimum, maximum]``). Callers
    retrying through a long outage then back off geometrically, as exponential backoff would,
    while a blip costs them only the minimum. Any answer from the engine ends the outage.
    Pure and clock-injected: :meth:`failed` returns the hint, :meth:`answered` resets.
    """

    def __init__(self, clock: Callable[[], float], minimum: float, maximum: float) -> None:
        if not 0 < minimum <= maximum:
            raise ValueError("need 0 < minimum <= maximum")
        self._clock = clock
        self._minimum = minimum
        self._maximum = maximum
        self._since: float | None = None

    @property
    def down_for(self) -> float:
        """Seconds since the first failure of the current outage (0 when the engine answers)."""
        return 0.0 if self._since is None else max(0.0, self._clock() - self._since)

    def failed(self) -> float:
        """Record a failure to reach the engine; the Retry-After to give, in seconds."""
        if self._since is None:
            self._since = self._clock()
        return min(self._maximum, max(self._minimum, self.down_for))

    def answered(self) -> None:
        self._since = None
