"""The two serving paths and the choice between them: the ASGI app and uvicorn options for each.

- **fast**: uvicorn's httptools protocol, extended (fast_path.py builds it from relay_protocol.py,
  relay_cycle.py, connection_guard.py): ``/v1/`` requests go from the parser to the relay directly.
  Cheapest in CPU; depends on uvicorn internals (internals.py).
- **public**: uvicorn's h11 protocol behind an :class:`asyncio.Protocol` wrapper and an
  ASGI wrapper (public_path.py), on public interfaces only. Same limits and answers.

``--http-path auto`` (the default) takes the fast path when the start-up check
(capability.py) passes, and otherwise logs one warning and takes the public path;
``fast`` refuses to start without the fast path; ``public`` never tries it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.fast_path import fast_protocol
from llm_backoff_shim.http.interface import HeadRefusal
from llm_backoff_shim.http.limits import Limits

HttpPath = Literal["auto", "fast", "public"]

log = logging.getLogger("llm_backoff_shim.http")


class FastPathUnavailable(RuntimeError):  # noqa: N818 - reads as the condition it reports
    """``--http-path fast`` was asked for, and the start-up check refused the fast path."""


#: The shim is the first hop: uvicorn's default (proxy_headers) would take the client's
#: address from X-Forwarded-For sent by 127.0.0.1, and the public path matches requests
#: to connections by the socket's peer.
_FIRST_HOP: dict[str, Any] = {"proxy_headers": False}


@dataclass(frozen=True)
class Serving:
    """What uvicorn runs: ``uvicorn.Config(serving.app, **serving.options)``."""

    app: Any
    options: dict[str, Any]
    path: Literal["fast", "public"]


def public_serving(app: Any, limits: Limits, *, refuse: HeadRefusal | None = None) -> Serving:
    """The public path: ``app`` behind :class:`~llm_backoff_shim.http.public_app.PublicApp`, on h11."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    from llm_backoff_shim.http.public_app import PublicApp
    from llm_backoff_shim.http.public_path import public_protocol

    connections: dict[Any, Any] = {}
    protocol = public_protocol(
        import_from_string(HTTP_PROTOCOLS["h11"]),
        connections,
        head_timeout=limits.head_timeout,
        max_head_bytes=limits.max_head_bytes,
        body_timeout=limits.body_timeout,
        on_event=limits.on_event,
    )
    options = {
        "http": protocol,
        "h11_max_incomplete_event_size": limits.max_head_bytes,
        "ws": "none",
        **_FIRST_HOP,
    }
    return Serving(PublicApp(app, connections, refuse=refuse, on_event=limits.on_event), options, "public")


def choose_path(requested: HttpPath) -> Literal["fast", "public"]:
    """The path to serve on; raises :class:`FastPathUnavailable` for ``fast`` when the check fails."""
    if requested == "public":
        return "public"
    from llm_backoff_shim.http.capability import fast_path_problem

    problem = fast_path_problem()
    if problem is None:
        return "fast"
    if requested == "fast":
        raise FastPathUnavailable(f"the fast HTTP path is unavailable: {problem}")
    _warn_fallback(problem)
    return "public"


@functools.cache
def _warn_fallback(problem: str) -> None:
    from llm_backoff_shim.http.capability import versions

    log.warning(
        "the fast HTTP path is unavailable with %s (%s); serving through the public path "
        "(uvicorn's h11 protocol, public interfaces only): the same limits and answers, more CPU "
        "per request (docs/shim.md, 'Serving paths'). --http-path public skips the check.",
        versions(),
        problem,
    )


def serving(
    app: Any,
    relay: Callable[..., Any],
    limits: Limits,
    *,
    requested: HttpPath = "auto",
    refuse: HeadRefusal | None = None,
    body_timers: CoarseTimers | None = None,
) -> Serving:
    """How to serve ``app`` (the shim's ASGI app, whose ``/v1/`` requests ``relay`` answers)."""
    if choose_path(requested) == "fast":
        protocol = fast_protocol(relay, limits, refuse=refuse, body_timers=body_timers)
        return Serving(app, {"http": protocol, **_FIRST_HOP}, "fast")
    return public_serving(app, limits, refuse=refuse)
