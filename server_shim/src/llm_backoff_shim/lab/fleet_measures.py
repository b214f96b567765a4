"""The figures of a fleet run (pure: records in, numbers out; no load, no servers).

A fleet here is N replicas (an engine and its shim each) behind a load balancer. The load
generator sends every HTTP attempt of a caller with its own ``x-request-id``
(:func:`~llm_backoff_shim.lab.load_records.attempt_id`), the load balancer passes it on to each
replica it tries, and each shim logs it in its JSON access log. So the shims' logs, read
together, say which replicas one attempt was asked of and which of them answered it last:

- :func:`refused_with_room`: attempts every replica asked refused, how many replicas each was
  asked of, and how many of them came while a replica had a free slot;
- :func:`requeued_after_wait`: attempts a replica queued, then refused, sent on to another;
- :func:`dead_replica_answers` and :func:`streams_cut`: what an engine that died did to callers;
- :func:`lost_calls`: calls that ended neither served nor refused with a hint;
- :func:`refused_share`: the share of callers' attempts refused, as callers saw it;
- :func:`split_trace` and :func:`conservation`: the fleet against one replica on each part.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from llm_backoff_shim.lab.load_records import CallRecord, attempt_id
from llm_backoff_shim.lab.scenario import Arrival

#: Outcomes of a request that held one of the shim's slots (it reached the engine).
ADMITTED = frozenset({"completed", "client_disconnected", "upstream_error"})
#: Rejection codes of a refusal that tells the caller to come back (capacity or its quota):
#: the answer a fleet under overload is meant to give. ``upstream_unavailable`` is not one.
REFUSAL_CODES = frozenset({"queue_full", "queue_timeout", "slo_shed", "tenant_rate_limited"})
#: A refusal answered later than this came after a wait in the shim's queue, not at arrival.
QUEUED_REFUSAL = 0.5


def split_trace(calls: Sequence[Arrival], parts: int, rng: random.Random) -> list[list[Arrival]]:
    """``calls`` dealt at random into ``parts`` traces (each call to one part, equal chances),
    each renumbered from 0 in time order."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    dealt: list[list[Arrival]] = [[] for _ in range(parts)]
    for call in calls:
        dealt[rng.randrange(parts)].append(call)
    return [[replace(call, index=i) for i, call in enumerate(part)] for part in dealt]


def conservation(fleet_useful: float, single_useful: float, replicas: int) -> float | None:
    """Useful tokens of the fleet over ``replicas`` x one replica's; None without a reference."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if single_useful <= 0:
        return None
    return fleet_useful / (replicas * single_useful)


# -- the shims' access logs ---------------------------------------------------------------------


@dataclass(frozen=True)
class Visit:
    """One request as one shim logged it: arrival and end (wall-clock seconds), when it took a
    slot (None: it never did), its outcome, rejection code and hint, and the caller's request id."""

    replica: int
    arrival: float
    end: float
    admitted_at: float | None
    outcome: str
    code: str | None
    retry_after: float | None
    request_id: str | None


def _wall(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _seconds(record: Mapping[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) / 1000.0 if isinstance(value, (int, float)) else None


def visits(replica: int, records: Iterable[Mapping[str, Any]]) -> list[Visit]:
    """The generation requests of one shim's parsed JSON access records (others are skipped)."""
    found = []
    for r in records:
        total, path, stamp = _seconds(r, "total_ms"), str(r.get("path", "")), r.get("time")
        if not isinstance(stamp, str) or total is None or not path.startswith("/v1/"):
            continue
        end = _wall(stamp)
        arrival = end - total
        outcome = str(r.get("outcome"))
        admitted = arrival + (_seconds(r, "queue_ms") or 0.0) if outcome in ADMITTED else None
        hint = float(h) if isinstance(h := r.get("retry_after_s"), (int, float)) else None
        code, rid = r.get("code"), r.get("request_id")
        found.append(
            Visit(
                replica,
                arrival,
                end,
                admitted,
                outcome,
                code if isinstance(code, str) else None,
                hint,
                rid if isinstance(rid, str) else None,
            )
        )
    return found


class Occupancy:
    """Requests holding a slot of each replica over time, from its admitted visits."""

    def __init__(self, all_visits: Iterable[Visit], replicas: int) -> None:
        self._starts: list[list[float]] = [[] for _ in range(replicas)]
        self._ends: list[list[float]] = [[] for _ in range(replicas)]
        for v in all_visits:
            if v.admitted_at is not None:
                self._starts[v.replica].append(v.admitted_at)
                self._ends[v.replica].append(v.end)
        for lst in (*self._starts, *self._ends):
            lst.sort()

    def at(self, replica: int, t: float) -> int:
        """Requests holding a slot of ``replica`` at ``t`` (taken at or before, not yet ended)."""
        return bisect.bisect_right(self._starts[replica], t) - bisect.bisect_right(self._ends[replica], t)


def by_request(all_visits: Iterable[Visit]) -> dict[str, list[Visit]]:
    """The visits of each request id, in order of arrival (visits without one are left out)."""
    by_id: dict[str, list[Visit]] = {}
    for v in all_visits:
        if v.request_id:
            by_id.setdefault(v.request_id, []).append(v)
    for group in by_id.values():
        group.sort(key=lambda v: v.arrival)
    return by_id


@dataclass(frozen=True)
class Refusals:
    """Attempts the fleet refused (every replica tried refused them): how many, how many of
    those were refused while some replica had a free slot, how many were asked of every
    replica; ``tries`` how many tries such an attempt took, ``asked`` how many distinct
    replicas it was asked of (each: attempts)."""

    refused: int
    with_room: int
    asked_all: int
    tries: dict[int, int]
    asked: dict[int, int]

    @property
    def share_with_room(self) -> float | None:
        return self.with_room / self.refused if self.refused else None

    @property
    def share_asked_all(self) -> float | None:
        return self.asked_all / self.refused if self.refused else None


def refused_with_room(
    all_visits: Sequence[Visit], replicas: int, slots: int, *, margin: float = 0.005
) -> Refusals:
    """Among the request ids whose every visit was refused: those asked of all ``replicas``,
    and those for which some replica had fewer than ``slots`` requests holding a slot from
    ``margin`` s before the last refusal's answer to ``margin`` s after (free for that whole
    span). Visits without a request id are left out."""
    occupancy = Occupancy(all_visits, replicas)
    refused = with_room = asked_all = 0
    tries: dict[int, int] = {}
    asked: dict[int, int] = {}
    for group in by_request(all_visits).values():
        if any(v.outcome != "rejected" for v in group):
            continue
        refused += 1
        tries[len(group)] = tries.get(len(group), 0) + 1
        distinct = len({v.replica for v in group})
        asked[distinct] = asked.get(distinct, 0) + 1
        asked_all += distinct >= replicas
        t = max(v.end for v in group)
        if any(
            max(occupancy.at(r, t - margin), occupancy.at(r, t), occupancy.at(r, t + margin)) < slots
            for r in range(replicas)
        ):
            with_room += 1
    return Refusals(refused, with_room, asked_all, dict(sorted(tries.items())), dict(sorted(asked.items())))


@dataclass(frozen=True)
class Requeued:
    """Load-balancer attempts sent on to another replica after a replica had queued them and
    then refused them (a wait of more than :data:`QUEUED_REFUSAL` s): how many, how many of
    those were then served, and each one's time in the fleet (first arrival to last answer)."""

    count: int
    served: int
    spans: list[float]


def requeued_after_wait(all_visits: Sequence[Visit]) -> Requeued:
    """Among the request ids visiting several replicas, those whose visit before the last was a
    refusal after a queue wait (the load balancer tried again after the shim's wait ran out)."""
    count = served = 0
    spans = []
    for group in by_request(all_visits).values():
        waited = [v for v in group[:-1] if v.outcome == "rejected" and v.end - v.arrival > QUEUED_REFUSAL]
        if not waited:
            continue
        count += 1
        served += group[-1].outcome != "rejected"
        spans.append(group[-1].end - group[0].arrival)
    return Requeued(count, served, sorted(spans))


# -- faults -------------------------------------------------------------------------------------


def final_attempt_id(call: CallRecord) -> str | None:
    """The request id of ``call``'s last HTTP attempt (None: it made none)."""
    return attempt_id(call.index, call.attempts[-1].number) if call.attempts else None


def dead_engine_answer(visit: Visit) -> bool:
    """The shim answered for an engine it could not use: ``upstream_unavailable``, or an
    upstream error."""
    return visit.code == "upstream_unavailable" or visit.outcome == "upstream_error"


def dead_replica_answers(
    calls: Iterable[CallRecord], all_visits: Sequence[Visit], replica: int, died: float
) -> list[int]:
    """Indices of the calls whose final answer came from ``replica`` for its dead engine: their
    last attempt's last try (by arrival) was at ``replica``, arrived from ``died`` on (wall-clock
    seconds: the engine killed) and was a :func:`dead_engine_answer`, also after the engine was
    started again while its shim still saw it down."""
    tries = by_request(all_visits)
    found = []
    for call in calls:
        rid = final_attempt_id(call)
        group = tries.get(rid) if rid is not None else None
        if not group:
            continue
        last = group[-1]
        if last.replica == replica and last.arrival >= died and dead_engine_answer(last):
            found.append(call.index)
    return found


def streams_cut(all_visits: Iterable[Visit], replica: int, died: float, back: float) -> int:
    """Requests ``replica``'s shim had relayed to its engine (taken a slot before ``died``) and
    that ended in an upstream error from ``died`` up to ``back``: answers the engine's death cut."""
    return sum(
        1
        for v in all_visits
        if v.replica == replica
        and v.outcome == "upstream_error"
        and v.admitted_at is not None
        and v.admitted_at <= died <= v.end < back
    )


def refused_with_hint(call: CallRecord) -> bool:
    """``call``'s last attempt was a refusal with one of :data:`REFUSAL_CODES`."""
    last = call.attempts[-1] if call.attempts else None
    return last is not None and last.rejected and last.code in REFUSAL_CODES


def own_deadline(call: CallRecord) -> bool:
    """``call`` ended at its caller's own deadline: cut by the caller, or its client's timeout
    (plain openai's is the deadline) or the SDK's deadline raised first."""
    error = call.error or ""
    return call.outcome == "deadline" or error == "client timeout" or "deadline" in error


def lost_calls(
    calls: Iterable[CallRecord], start: float, end: float, *, besides: Iterable[int] = ()
) -> list[int]:
    """Indices of the calls that failed between ``start`` and ``end`` (the run's clock) with no
    refusal to go by: no answer, a cut answer, or an error that is not a capacity refusal (e.g.
    ``upstream_unavailable``); not at their own deadline (:func:`own_deadline`). Calls in
    ``besides`` (already counted against another fault) are left out."""
    skip = set(besides)
    return [
        c.index
        for c in calls
        if c.outcome == "error"
        and not own_deadline(c)
        and c.end is not None
        and start <= c.end <= end
        and not refused_with_hint(c)
        and c.index not in skip
    ]


def how_they_ended(calls: Iterable[CallRecord], indices: Iterable[int]) -> dict[str, int]:
    """How the calls of ``indices`` ended, by their last attempt: ``"<status> <code>"`` for an
    answer (``"200"``: cut after it began), ``"no answer: <the call's error>"`` when none came;
    each with its count."""
    wanted = set(indices)
    ended: dict[str, int] = {}
    for call in calls:
        if call.index not in wanted:
            continue
        last = call.attempts[-1] if call.attempts else None
        if last is None or last.status is None:
            key = f"no answer: {call.error}"
        else:
            key = f"{last.status} {last.code}" if last.code else str(last.status)
        ended[key] = ended.get(key, 0) + 1
    return dict(sorted(ended.items()))


def refused_share(calls: Iterable[CallRecord]) -> float | None:
    """Callers' attempts refused (429 or 503) over their attempts answered; None with none."""
    answered = refused = 0
    for call in calls:
        for a in call.attempts:
            if a.status is not None:
                answered += 1
                refused += a.rejected
    return refused / answered if answered else None


__all__ = [
    "ADMITTED",
    "QUEUED_REFUSAL",
    "REFUSAL_CODES",
    "Occupancy",
    "Refusals",
    "Requeued",
    "Visit",
    "by_request",
    "conservation",
    "dead_engine_answer",
    "dead_replica_answers",
    "final_attempt_id",
    "how_they_ended",
    "lost_calls",
    "own_deadline",
    "refused_share",
    "refused_with_hint",
    "refused_with_room",
    "requeued_after_wait",
    "split_trace",
    "streams_cut",
    "visits",
]
