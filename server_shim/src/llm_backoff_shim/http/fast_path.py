"""The fast path's protocol class: uvicorn's httptools protocol, guarded, with the direct relay.

Built here, apart from the choice between paths (paths.py), so the start-up check
(capability.py) can build the very class it vets without importing the chooser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llm_backoff_shim.http.coarse_timers import CoarseTimers
from llm_backoff_shim.http.interface import HeadRefusal
from llm_backoff_shim.http.limits import Limits


def fast_protocol(
    relay: Callable[..., Any],
    limits: Limits,
    *,
    refuse: HeadRefusal | None = None,
    body_timers: CoarseTimers | None = None,
) -> type[Any]:
    """The fast path's protocol class: uvicorn's httptools protocol, guarded, with the direct path."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from llm_backoff_shim.http.connection_guard import guarded_protocol
    from llm_backoff_shim.http.relay_protocol import relay_protocol

    guarded = guarded_protocol(
        HttpToolsProtocol,
        head_timeout=limits.head_timeout,
        max_head_bytes=limits.max_head_bytes,
        on_event=limits.on_event,
    )
    return relay_protocol(guarded, relay, refuse=refuse, body_timers=body_timers)
