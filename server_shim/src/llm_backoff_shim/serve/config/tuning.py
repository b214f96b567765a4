"""The shim's fixed values: what a deployment does not set.

None is a choice a deployment makes, so none is a flag, a variable or a key of the
``--config`` file, and neither ``--help-all`` nor the settings table of docs/reference.md
lists them. Each value says why it is what it is. :data:`TUNING` is what
``llm-backoff-shim serve`` runs with; tests hand ``create_app`` another :class:`Tuning`
to make a scrape or a timeout fast, or to take a path the defaults skip.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """The values the composition root (serve/app.py) and the serving path (serve/command.py)
    build the shim with besides its settings."""

    # -- the upstream ------------------------------------------------------------------------
    #: Seconds to open a connection to the engine: on the same host or network, a connect
    #: that takes longer is an engine that is down.
    upstream_connect_timeout: float = 5.0
    #: Seconds an idle pooled connection to the engine is kept: below the engine's own idle
    #: timeout (uvicorn's, so vLLM's: 5 s), so the shim never reuses one the engine closes.
    upstream_keepalive: float = 4.0
    #: Seconds an event stream may stay silent between events once its first has come (before
    #: it, ``--upstream-read-timeout``): an engine streams an event per decode step, so a
    #: silent minute is a stalled engine, and its slot is freed.
    upstream_stream_read_timeout: float = 60.0
    #: The engine's path that ``GET /ready`` probes (vLLM's and the simulator's).
    ready_path: str = "/health"

    # -- request heads, on the proxy's listener and the operations listener -------------------
    #: Seconds a client may take to send a request line and headers (408 after).
    header_read_timeout: float = 10.0
    #: Largest request line + headers (431 above): far above what an API client sends.
    max_header_bytes: int = 64 * 1024
    #: Answer a generation request that can only be refused (every slot taken, no queue place)
    #: from its head, before its body is read: the same answer for a quarter less CPU. Off only
    #: in tests of the refusal after the body, which serves the cases it cannot (a closing
    #: connection, ``Expect: 100-continue``, a token quota, the fleet's Retry-After).
    refuse_from_head: bool = True

    # -- the engine's metrics (``--engine-metrics``) -----------------------------------------
    #: The engine's Prometheus path (vLLM's).
    engine_metrics_path: str = "/metrics"
    #: Seconds between scrapes: a few per second, a few milliseconds of engine CPU each.
    engine_poll_interval: float = 0.25
    #: The engine is saturated when more requests than this wait in it: none, so waiting
    #: happens in the shim, where it is bounded and ordered by class.
    engine_max_waiting: int = 0
    #: ... or when its KV-cache usage (0..1) reaches this (vLLM preempts near full).
    engine_max_kv_cache: float = 0.95
    #: Metrics older than this many scrape intervals are ignored (the concurrency cap rules).
    engine_stale_polls: float = 8.0

    # -- admission -----------------------------------------------------------------------------
    #: Lower bound of the adaptive concurrency limit (``--adaptive-concurrency``).
    min_concurrency: int = 1
    #: At most this fraction of a queue bound is kept for callers told to come back while
    #: their returns are promised (docs/shim.md, returning callers).
    returning_share: float = 0.25
    #: With ``--ttft-slo``: a growing queue is YELLOW once its estimated wait passes this
    #: fraction of the class's budget ...
    slo_yellow_fraction: float = 0.4
    #: ... and "growing" is judged over this many seconds.
    slo_trend_window: float = 1.0

    @property
    def engine_stale_after(self) -> float:
        """Seconds after which the engine's metrics are ignored: :attr:`engine_stale_polls` scrapes."""
        return self.engine_stale_polls * self.engine_poll_interval


#: What ``llm-backoff-shim serve`` runs with.
TUNING = Tuning()
