"""What a soak is asked to do (:class:`SoakConfig`) and what it found (:class:`SoakReport`).

The report's :meth:`~SoakReport.leaks` is the audit's verdict: everything that did not come
back after the load; :meth:`~SoakReport.summary` the figures as JSON-ready values.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

KINDS: dict[str, float] = {
    "plain": 0.30,
    "plain_budget": 0.10,
    "stream": 0.15,
    "leave_queued": 0.10,
    "leave_streaming": 0.10,
    "sdk": 0.15,
    "sdk_stream": 0.10,
}


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 2000
    seconds: float | None = None
    concurrency: int = 48
    seed: int = 7
    sdk_deadline: float = 3.0
    grace: float = 2.0
    raw_limit: float = 15.0
    warmup: int = 150
    error_rate: float = 0.04
    reset_rate: float = 0.03
    slow_first_byte_rate: float = 0.03
    slow_first_byte_delay: float = 0.3
    stream_cut_rate: float = 0.10
    output_tokens: int = 12
    long_output_tokens: int = 200
    max_concurrency: int = 8
    max_queue: int = 16
    max_queue_wait: float = 1.5
    settle_timeout: float = 20.0
    #: (kind, weight) pairs; default :data:`KINDS`.
    kinds: tuple[tuple[str, float], ...] = tuple(KINDS.items())
    #: False: clients call the simulator directly (the SDK alone against the faults).
    through_shim: bool = True


@dataclass
class Snapshot:
    tasks_shim: int
    tasks_sim: int
    fds: int
    rss_mib: float
    #: open client connections of the shim's and the simulator's HTTP servers
    connections_shim: int = 0
    connections_sim: int = 0


@dataclass
class SoakReport:
    config: SoakConfig
    requests: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    faults: dict[str, int] = field(default_factory=dict)
    hangs: int = 0
    late: int = 0
    untyped: list[str] = field(default_factory=list)
    duplicate_streams: int = 0
    retries_after_stream_start: int = 0
    shim_errors_without_retry_after: int = 0
    seconds: float = 0.0
    baseline: Snapshot | None = None
    after: Snapshot | None = None
    gauges_after: dict[str, float] = field(default_factory=dict)
    waiting_futures_after: int = -1
    bad_requests: dict[str, float] = field(default_factory=dict)
    shim_counts: dict[str, float] = field(default_factory=dict)
    #: (requests sent, resident MiB) every tenth of the run: flat means no growth per request.
    rss_samples: list[tuple[int, float]] = field(default_factory=list)

    @property
    def disconnects(self) -> int:
        return self.outcomes["client_left"] + self.outcomes["client_left_stream"]

    def leaks(self) -> list[str]:
        """Everything the audit found wrong; empty when nothing leaked."""
        found: list[str] = []
        if any(self.gauges_after.values()):
            found.append(f"gauges not at zero: {self.gauges_after}")
        if self.waiting_futures_after != 0:
            found.append(f"{self.waiting_futures_after} admission futures still waiting")
        if self.baseline is not None and self.after is not None:
            b, a = self.baseline, self.after
            if a.tasks_shim > b.tasks_shim:
                found.append(f"shim tasks {b.tasks_shim} -> {a.tasks_shim}")
            if a.tasks_sim > b.tasks_sim:
                found.append(f"sim tasks {b.tasks_sim} -> {a.tasks_sim}")
            if a.fds > b.fds:
                found.append(f"file descriptors {b.fds} -> {a.fds}")
            if a.connections_shim or a.connections_sim:
                found.append(f"open connections: shim {a.connections_shim}, sim {a.connections_sim}")
        return found

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "seconds": round(self.seconds, 1),
            "by_kind": dict(sorted(self.by_kind.items())),
            "outcomes": dict(sorted(self.outcomes.items())),
            "faults_injected": self.faults,
            "disconnects": self.disconnects,
            "hangs": self.hangs,
            "late": self.late,
            "untyped_errors": len(self.untyped),
            "duplicate_streams": self.duplicate_streams,
            "retries_after_stream_start": self.retries_after_stream_start,
            "shim_rejections_without_retry_after": self.shim_errors_without_retry_after,
            "shim_counts": self.shim_counts,
            "bad_requests": self.bad_requests,
            "gauges_after": self.gauges_after,
            "baseline": None if self.baseline is None else vars(self.baseline),
            "after": None if self.after is None else vars(self.after),
            "rss_samples": self.rss_samples,
            "leaks": self.leaks(),
        }
