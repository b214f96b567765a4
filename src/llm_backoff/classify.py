"""Is this outcome worth another attempt, and why (a short reason for logs and history)?

Statuses, in order of precedence:

1. below 400: success, nothing to retry;
2. 400, 401, 403, 404, 422: never (the same request cannot succeed later), whatever
   the server's ``x-should-retry`` says;
3. ``x-should-retry: false``, or the shim's ``x-llm-backoff-refusal: final-...``: no;
4. a 429 whose body says ``insufficient_quota``: no (waiting does not refill an account);
5. ``x-should-retry: true``, or ``x-llm-backoff-refusal: retry-...``: yes, even for a status
   outside ``retry_statuses``;
6. otherwise: yes iff the status is in ``policy.retry_statuses``.

Exceptions: timeouts (connect, read, write, pool) are retried when
``retry_timeouts``; connection failures (refused, reset, closed without a response,
proxy) when ``retry_connection_errors``. Anything else (bad URL, local protocol
misuse, our own ``RateLimitTimeout``) is not retried. httpx, httpx2 and openai
exception types are recognised; a library that was never imported cannot have
raised anything, so each is looked up in ``sys.modules`` instead of imported.

A verdict also says whether no one could serve the attempt (``unreachable``), which
``max_connect_errors`` caps separately: the attempt never reached the server
(`never_connected`: refused, unreachable, DNS, TLS handshake, connect timeout), or the
server answered that what stands behind it cannot be reached (`upstream_unreachable`: the
shim's 503 ``upstream_unavailable``, a gateway's 502 or 504 without a hint). For the
caller both mean the same: nobody can serve the call now.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Literal, NamedTuple

from .policy import NEVER_RETRY_STATUSES, RetryPolicy
from .retry_after import MAX_HINT_BODY

ErrorKind = Literal["timeout", "connection"]


class Verdict(NamedTuple):
    """Retry or not, and a short reason for logs and the attempt history."""

    retryable: bool
    reason: str
    unreachable: bool = False
    """No one could serve the attempt: no connection could be made (`never_connected`), or the
    server answered that its upstream cannot be reached (`upstream_unreachable`)."""


#: The error code of the shim's answer when its engine (or its tenant-quota store) cannot be
#: reached: 503 with ``{"error": {"code": "upstream_unavailable", ...}}`` (docs/protocol.md).
UPSTREAM_UNAVAILABLE = "upstream_unavailable"

#: The shim's (and its shipped balancers') header on every answer it makes itself: ``retry-<code>``
#: when the same request may succeed later, ``final-<code>`` when it cannot (docs/protocol.md).
REFUSAL_HEADER = "x-llm-backoff-refusal"

#: A gateway's "the server behind me did not answer" (502 Bad Gateway, 504 Gateway Timeout):
#: counted as unreachable only without a hint, since a hint is a server's plan to be back.
GATEWAY_STATUSES = frozenset({502, 504})


def parse_error_body(body: bytes | str | Mapping[str, object] | None) -> Mapping[str, object] | None:
    """A JSON error body as a mapping; anything else (HTML, huge, broken) -> None."""
    if body is None or isinstance(body, Mapping):
        return body
    if not body or len(body) > MAX_HINT_BODY:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, Mapping) else None


def is_insufficient_quota(body: Mapping[str, object] | None) -> bool:
    """OpenAI's "you ran out of credit" 429: ``{"error": {"type"|"code": "insufficient_quota"}}``.

    Also accepts the inner ``error`` object alone, which is what ``openai`` exposes as ``exc.body``.
    """
    if body is None:
        return False
    error = body.get("error")
    for obj in (error if isinstance(error, Mapping) else None, body):
        if obj is not None and "insufficient_quota" in (obj.get("code"), obj.get("type")):
            return True
    return False


def error_code(body: Mapping[str, object] | None) -> object:
    """``error.code`` of an error body (OpenAI's and Anthropic's shapes), or a top-level ``code``
    (the inner ``error`` object alone, which is what ``openai`` exposes as ``exc.body``)."""
    if body is None:
        return None
    error = body.get("error")
    if isinstance(error, Mapping) and "code" in error:
        return error.get("code")
    return body.get("code")


def upstream_unreachable(status: int, body: Mapping[str, object] | None, hint: float | None) -> bool:
    """True when the answer says that no one behind the server can serve the request now.

    The shim's 503 ``upstream_unavailable`` (its engine, or its tenant-quota store, cannot be
    reached), and a gateway's 502 or 504 that gives no hint (nginx, HAProxy, a cloud load
    balancer that could not reach or hear from any server behind it). A 503 without that code
    is a busy server, and a gateway's answer with a hint a server with a plan: not counted.
    """
    if status == 503:
        return error_code(body) == UPSTREAM_UNAVAILABLE
    return status in GATEWAY_STATUSES and hint is None


def classify_status(
    policy: RetryPolicy,
    status: int,
    headers: Mapping[str, str],
    body: Mapping[str, object] | None = None,
    *,
    hint: float | None = None,
) -> Verdict:
    """The verdict on an answer; ``hint`` is the server's hint read from it (`retry_after.parse_hint`)."""
    if status < 400:
        return Verdict(False, f"status {status}")
    if status in NEVER_RETRY_STATUSES:
        return Verdict(False, f"status {status} is never retried")
    unreachable = upstream_unreachable(status, body, hint)
    what = f"status {status}"
    if unreachable:
        what += " upstream_unavailable" if status == 503 else " without a hint"
    should_retry = (headers.get("x-should-retry") or "").strip().lower()
    if should_retry == "false":
        return Verdict(False, f"{what}, server sent x-should-retry: false", unreachable)
    refusal = (headers.get(REFUSAL_HEADER) or "").strip().lower()
    if refusal.startswith("final-"):
        return Verdict(False, f"{what}, server sent {REFUSAL_HEADER}: {refusal}", unreachable)
    if status == 429 and is_insufficient_quota(body):
        return Verdict(False, "status 429 insufficient_quota (out of credit, not a rate limit)")
    if should_retry == "true":
        return Verdict(True, f"{what}, server sent x-should-retry: true", unreachable)
    if status in policy.retry_statuses:
        return Verdict(True, what, unreachable)
    if refusal.startswith("retry-"):
        return Verdict(True, f"{what}, server sent {REFUSAL_HEADER}: {refusal}", unreachable)
    return Verdict(False, f"{what} is not in retry_statuses", unreachable)


def error_kind(exc: BaseException) -> ErrorKind | None:
    """``"timeout"``, ``"connection"`` or None (not a transport failure) for an exception."""
    for name in ("httpx2", "httpx"):
        module = sys.modules.get(name)
        if module is None:
            continue
        if isinstance(exc, module.TimeoutException):
            return "timeout"
        if isinstance(exc, (module.NetworkError, module.RemoteProtocolError, module.ProxyError)):
            return "connection"
    openai = sys.modules.get("openai")
    if openai is not None:
        # APITimeoutError subclasses APIConnectionError: test it first.
        if isinstance(exc, openai.APITimeoutError):
            return "timeout"
        if isinstance(exc, openai.APIConnectionError):
            return "connection"
    anyio = sys.modules.get("anyio")
    # httpx2 lets anyio's EndOfStream through when a TLS peer vanishes (the openai SDK maps it too).
    if anyio is not None and isinstance(exc, anyio.EndOfStream):
        return "connection"
    if isinstance(exc, ConnectionError):
        return "connection"
    return None


def never_connected(exc: BaseException) -> bool:
    """True when ``exc`` says no connection to the server could be made.

    httpx/httpx2 ``ConnectError`` (refused, unreachable, DNS failure, TLS handshake) and
    ``ConnectTimeout``, a plain ``ConnectionRefusedError``, or an openai
    ``APIConnectionError`` caused by one of them. Failures after a connection was made
    (reset, closed without a response, read timeouts) reached the server: False.
    """
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 4:  # openai wraps the transport's error as __cause__
        for name in ("httpx2", "httpx"):
            module = sys.modules.get(name)
            if module is not None and isinstance(current, (module.ConnectError, module.ConnectTimeout)):
                return True
        if isinstance(current, ConnectionRefusedError):
            return True
        current = current.__cause__
        seen += 1
    return False


def classify_exception(policy: RetryPolicy, exc: BaseException) -> Verdict:
    kind = error_kind(exc)
    name = type(exc).__name__
    if kind == "timeout":
        return Verdict(policy.retry_timeouts, f"timeout ({name})", never_connected(exc))
    if kind == "connection":
        return Verdict(policy.retry_connection_errors, f"connection error ({name})", never_connected(exc))
    return Verdict(False, f"{name} is not a transport failure")
