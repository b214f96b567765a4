"""The fleet benchmark's own figures (pure: records in, numbers out); bench_fleet.py runs the load.

- **the per-replica trace**: one replica alone faces a random third of the fleet's arrivals
  (:func:`split_trace`: each call goes to one of ``n`` parts with equal chance, from a seeded
  RNG), so its load is a Poisson process at the fleet's rate / ``n`` with the same mix;
- **work conserved**: useful tokens of the fleet over ``n`` times those of one replica alone
  under its share of the load (:func:`conservation`), 1.0 when the load balancer loses nothing;
- **the oracle's bound**: the earliest-deadline-first scheduler of ``bench_admission_model.py`` on the
  same trace, with every request's service time known in advance and all ``n x slots`` slots in
  one pool (:func:`oracle_jobs`): no fleet of ``n`` engines serves more usefully than that pool;
- **refused while a replica had room**: from the shims' JSON access logs, the calls the fleet
  turned away (every replica the load balancer tried refused) at a moment when some replica had
  fewer than ``slots`` requests in its engine (:func:`refused_with_room`).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from llm_backoff_shim.lab.scenario import Arrival, EngineShape, Scenario
from bench_admission_model import Job, job

#: Tokens the simulator counts for a prompt of ``w`` words: 1.3 per word plus the chat template's 4.
TOKENS_PER_WORD = 1.3
TEMPLATE_TOKENS = 4


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


def prompt_tokens(prompt: str | None) -> int:
    """The simulator's token count of a prompt (the load generator's fixed prompt when None)."""
    words = len((prompt or "call 0").split())
    return round(TOKENS_PER_WORD * words + TEMPLATE_TOKENS)


def oracle_jobs(calls: Iterable[Arrival], shape: EngineShape, scenario: Scenario) -> list[Job]:
    """The trace as ``bench_admission_model.schedule`` takes it: each call's answer length, its slot time on
    the simulator (first token ``ttft`` plus its prompt's prefill after the start, then one token per
    ``itl``) and the latest start that is still useful (its class's TTFT budget and deadline)."""
    jobs = []
    for call in calls:
        tokens = call.max_tokens or shape.output_tokens
        ttft = shape.ttft + prompt_tokens(call.prompt) * shape.prefill_time_per_token
        jobs.append(
            job(
                call.at,
                tokens,
                call.cls,
                ttft=ttft,
                itl=shape.itl,
                deadline=scenario.deadline_of(call.cls),
                ttft_budget=scenario.ttft_budget if call.cls == "interactive" else None,
            )
        )
    return jobs


# -- the shims' access logs ---------------------------------------------------------------------

#: Outcomes of a request that held one of the shim's slots (it reached the engine).
ADMITTED = frozenset({"completed", "client_disconnected", "upstream_error"})


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


def _seconds(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) / 1000.0 if isinstance(value, (int, float)) else None


def visits(replica: int, records: Iterable[dict[str, Any]]) -> list[Visit]:
    """The generation requests of one shim's parsed JSON access records (others are skipped)."""
    found = []
    for r in records:
        total = _seconds(r, "total_ms")
        if (
            not isinstance(r.get("time"), str)
            or total is None
            or not str(r.get("path", "")).startswith("/v1/")
        ):
            continue
        end = _wall(r["time"])
        arrival = end - total
        outcome = str(r.get("outcome"))
        admitted = None
        if outcome in ADMITTED:
            admitted = arrival + (_seconds(r, "queue_ms") or 0.0)
        hint = r.get("retry_after_s")
        found.append(
            Visit(
                replica,
                arrival,
                end,
                admitted,
                outcome,
                r.get("code"),
                float(hint) if isinstance(hint, (int, float)) else None,
                r.get("request_id"),
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


@dataclass(frozen=True)
class RefusalsWithRoom:
    """Calls the fleet refused (every replica tried refused them), and how many of those were
    refused while some replica had a free slot; ``tries`` how many replicas such a call visited."""

    refused: int
    with_room: int
    tries: dict[int, int]

    @property
    def share(self) -> float | None:
        return self.with_room / self.refused if self.refused else None


def refused_with_room(
    all_visits: Sequence[Visit], replicas: int, slots: int, *, margin: float = 0.005
) -> RefusalsWithRoom:
    """Among the request ids whose every visit was refused, those for which some replica had
    fewer than ``slots`` requests holding a slot from ``margin`` s before the last refusal's
    answer to ``margin`` s after (a slot freed for that whole span, not one freeing at the
    instant). Visits without a request id are left out."""
    occupancy = Occupancy(all_visits, replicas)
    by_id: dict[str, list[Visit]] = {}
    for v in all_visits:
        if v.request_id:
            by_id.setdefault(v.request_id, []).append(v)
    refused = with_room = 0
    tries: dict[int, int] = {}
    for group in by_id.values():
        if any(v.outcome != "rejected" for v in group):
            continue
        refused += 1
        tries[len(group)] = tries.get(len(group), 0) + 1
        t = max(v.end for v in group)
        if any(
            max(occupancy.at(r, t - margin), occupancy.at(r, t), occupancy.at(r, t + margin)) < slots
            for r in range(replicas)
        ):
            with_room += 1
    return RefusalsWithRoom(refused, with_room, dict(sorted(tries.items())))


#: A refusal answered later than this came after a wait in the shim's queue, not at arrival.
QUEUED_REFUSAL = 0.5


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
    by_id: dict[str, list[Visit]] = {}
    for v in all_visits:
        if v.request_id:
            by_id.setdefault(v.request_id, []).append(v)
    count = served = 0
    spans = []
    for group in by_id.values():
        group.sort(key=lambda v: v.arrival)
        waited = [v for v in group[:-1] if v.outcome == "rejected" and v.end - v.arrival > QUEUED_REFUSAL]
        if not waited:
            continue
        count += 1
        served += group[-1].outcome != "rejected"
        spans.append(group[-1].end - group[0].arrival)
    return Requeued(count, served, sorted(spans))


def spread(values: Sequence[float]) -> float | None:
    """Largest over smallest of ``values`` (1.0 when even); None without a positive smallest."""
    if not values or min(values) <= 0:
        return None
    return max(values) / min(values)


__all__ = [
    "ADMITTED",
    "Occupancy",
    "RefusalsWithRoom",
    "Requeued",
    "Visit",
    "conservation",
    "oracle_jobs",
    "prompt_tokens",
    "refused_with_room",
    "requeued_after_wait",
    "split_trace",
    "spread",
    "visits",
]
