"""The places given to callers told to come back, on one timeline, and the promises among them.

Spreading: callers rejected in one burst are each told a different future slot. The timeline
remembers the places given, whatever the class; the next refusal gets the first time at or
after its earliest slot that is at least one step (``1 / drain rate``) from every place already
given (:meth:`PromiseTimeline.first_gap`), so the k-th caller of a burst hears roughly
``(ahead + k) / rate`` and retries come back at about the drain rate instead of in one wave. A
place given far ahead (a lower class kept out of the next seconds, a capped hint) leaves the
slots before it to later callers (with every place after the last one, batch callers took the
near slots and interactive callers refused after them were told slots past their budget).
Once time passes the last place the burst is over and hints start again from the queue
alone. One timeline for all
classes, not one per class: each promise claims one slot freeing on the one engine, so the
promised returns of all classes together come back no faster than the engine drains. With a
timeline per class, two classes refused together were promised about twice the drain rate
between them, and the returning callers found the queue full (measured under 2x overload).

Promises are also remembered one by one per class (until they fall due), so that a *fresh*
arrival's expected wait can count the callers already told to come back before it would be
served (:meth:`~llm_backoff_shim.decide.drain_estimate.DrainEstimator.expected_wait`): the
admission decision serves a returning caller before the fresh arrivals of its class, so under
sustained overload each promise takes a slot that a fresh arrival would otherwise have had.
Without that, a fresh arrival would be queued on the strength of the queue alone and then
overtaken by the returners, to be told ``queue_timeout`` after its whole wait; with it, it is
told at once, and its hint comes after the last promise. A promise the caller cannot keep is
not remembered: it will not come back.

Behind a load balancer that asks every replica before it refuses, a call refused by the fleet
is placed on every replica's timeline but comes back once, to one of them
(:mod:`llm_backoff_shim.decide.fleet_size`). Given the fleet's size, the timeline counts each
promise as ``1 / replicas`` of a return (rounded to the nearest whole return), and a caller
back redeems ``replicas`` of them; the spacing of places is the caller's
(:func:`~llm_backoff_shim.decide.retry_after.retry_after` spaces them at the fleet's drain rate).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable

from llm_backoff_shim.decide.fleet_size import FleetSize

Clock = Callable[[], float]


class PromiseTimeline:
    """Places taken on the one timeline, and the promised returns per class (module docstring).

    A promise counts until ``grace`` seconds after it fell due: a caller comes back a little
    after its hint (whole seconds rounded up, a client's jitter). ``fleet``: how many replicas
    each promise is shared by (module docstring); none, one.
    """

    def __init__(self, clock: Clock, grace: float, fleet: FleetSize | None = None) -> None:
        self._clock = clock
        self._grace = grace
        self.fleet = fleet
        # Every place taken, any class, kept promise or not, ascending; dropped once past. A new
        # place goes into the first gap of one step at or after its earliest slot.
        self._places: list[float] = []
        # (start, end, step): no place fits anywhere in [start, end) of the timeline at that
        # step. Places are only ever added there (and pruned behind now), so it stays true,
        # and a search that starts inside jumps to its end instead of walking a full run.
        self._packed: tuple[float, float, float] = (0.0, 0.0, 0.0)
        # Promised return times per class, ascending (each at least one step from any other
        # place, and none beyond the clamp), dropped once due: at most max / step entries.
        self._promises: dict[str, deque[float]] = {}

    @property
    def replicas(self) -> int:
        """The replicas each promise is shared by (1 without a fleet)."""
        return 1 if self.fleet is None else self.fleet.replicas

    def _returns(self, promises: int) -> int:
        """The returns ``promises`` stand for: each a ``1 / replicas`` share, to the nearest whole
        (all of them for one replica)."""
        n = self.replicas
        return (2 * promises + n) // (2 * n)

    def __len__(self) -> int:
        """Places on the timeline (those behind now are pruned on the next :meth:`first_gap`)."""
        return len(self._places)

    def first_gap(self, now: float, earliest: float, step: float) -> float:
        """The first time at or after ``earliest`` at least one step from every place taken."""
        line = self._places
        past = bisect.bisect_left(line, now - step)
        if past:
            del line[:past]
        at = start = earliest
        lo, hi, packed_step = self._packed
        if packed_step == step and lo <= at < hi:
            at, start = hi, lo
        # By index, not over a slice: a slice copies the rest of the timeline on every call.
        for i in range(bisect.bisect_left(line, at - step + 1e-12), len(line)):
            taken = line[i]
            if taken >= at + step:
                break
            at = max(at, taken + step)
        if at > start:
            self._packed = (start, at, step)
        return at

    def take(self, at: float) -> None:
        """Take the place at ``at`` (a time :meth:`first_gap` gave): later callers are spread after it."""
        bisect.insort(self._places, at)

    def promise(self, cls: str, at: float, now: float) -> None:
        """Remember that a caller of ``cls`` was promised the place at ``at``."""
        promises = self._promises.setdefault(cls, deque())
        self._forget_due(promises, now)
        # In order, not only after the last: a place filling a gap of the timeline is earlier
        # than the promises already given, and a promise left out is a slot counted for nobody.
        bisect.insort(promises, at)

    def promised_within(self, classes: Iterable[str], start: float, end: float) -> int:
        """Callers of ``classes`` told to come back in ``(start, end]`` (promises not yet due)."""
        count = 0
        for cls in classes:
            promises = self._promises.get(cls)
            if not promises:
                continue
            self._forget_due(promises, self._clock())
            count += bisect.bisect_right(promises, end) - bisect.bisect_right(promises, start)
        return self._returns(count)

    def outstanding(self, cls: str) -> int:
        """Promises of ``cls`` not yet due, or due less than the grace ago (class docstring)."""
        promises = self._promises.get(cls)
        if not promises:
            return 0
        self._forget_due(promises, self._clock())
        return self._returns(len(promises))

    def redeem(self, cls: str) -> None:
        """A caller of ``cls`` told to come back has come back: its promise is kept no longer.

        Which caller it is the shim cannot tell, so the promise nearest to now goes (callers
        come back around their slot). Without this, a caller back early for its slot counted
        twice in the waits of those behind it, queued and still promised: in the tail of a
        burst, lower-class callers back at their slot were refused on that doubled wait.
        """
        promises = self._promises.get(cls)
        if not promises:
            return
        now = self._clock()
        self._forget_due(promises, now)
        # In a fleet every replica holds this caller's promise and it came back to this one:
        # its share of each replica's promises, ``replicas`` shares, goes from here.
        for _ in range(self.replicas):
            if not promises:
                return
            i = bisect.bisect_left(promises, now)
            if i == len(promises) or (i > 0 and now - promises[i - 1] <= promises[i] - now):
                i -= 1
            del promises[i]

    def _forget_due(self, promises: deque[float], now: float) -> None:
        while promises and promises[0] <= now - self._grace:
            promises.popleft()
