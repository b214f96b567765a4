"""The retrying HTTP transports, one pair per HTTP library, and the engine they share.

- ``Httpx2RetryTransport`` / ``AsyncHttpx2RetryTransport`` (openai 3.x default),
- ``HttpxRetryTransport`` / ``AsyncHttpxRetryTransport`` (openai 2.x, anthropic, or a
  legacy ``httpx`` client given to openai 3.x).

``httpx2.Client(transport=Httpx2RetryTransport(httpx2.HTTPTransport(), policy))``
retries every request of that client under ``policy``. The classes are resolved on
first access, so neither HTTP library is imported unless it is used. What one attempt
does is described in `llm_backoff.engine` and decided in `llm_backoff.attempt_core`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .attempt_core import CALL_STARTED
from .attempts import REASON_KEY, annotate
from .bodies import StreamGuard
from .engine import RetryEngine

if TYPE_CHECKING:
    from ._httpx2_transport import AsyncHttpx2RetryTransport, Httpx2RetryTransport
    from ._httpx_transport import AsyncHttpxRetryTransport, HttpxRetryTransport

__all__ = [
    "CALL_STARTED",
    "REASON_KEY",
    "AsyncHttpx2RetryTransport",
    "AsyncHttpxRetryTransport",
    "Httpx2RetryTransport",
    "HttpxRetryTransport",
    "RetryEngine",
    "StreamGuard",
    "annotate",
]


def __getattr__(name: str) -> Any:
    # The transport classes import their HTTP library; resolve them only on demand.
    if name in ("Httpx2RetryTransport", "AsyncHttpx2RetryTransport"):
        from . import _httpx2_transport

        return getattr(_httpx2_transport, name)
    if name in ("HttpxRetryTransport", "AsyncHttpxRetryTransport"):
        from . import _httpx_transport

        return getattr(_httpx_transport, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
