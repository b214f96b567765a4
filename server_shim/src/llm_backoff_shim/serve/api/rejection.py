"""The shim's "no": one type, built and rendered here (docs/protocol.md, "The protocol between shim and SDK").

Every answer the shim makes itself instead of relaying the engine's is a :class:`Refusal`:
its status, raw headers and body as they go on the wire, the reason or rejection code it is
counted under, a rejection's Retry-After (for the metrics and the access log) and the error
shape it is answered in. The intake's 4xx, a tenant over quota, an admission rejection and
an upstream failure are all one. It leaves the shim through
:func:`~llm_backoff_shim.serve.request_path.exchange.answer` (ASGI messages) or :func:`wire_form`
(the bytes of a whole response, for a serving path that writes them).

Rejections are 429 (or the configured 503) with ``Retry-After`` (integer seconds, >= 1,
rounded up so a client that honours it never comes back early), ``retry-after-ms``
(the same estimate in milliseconds, which the openai SDK reads first) and an
OpenAI-format body whose ``error`` carries ``code``, ``retry_after_seconds`` and
``queue_depth``. Client mistakes are 400s in the same OpenAI error shape, their bodies written
by the renderer the HTTP layer's own answers use (:mod:`llm_backoff_shim.http.errors`).

On Anthropic routes (``/v1/messages``) :func:`in_shape` re-renders any of these answers in
Anthropic's error shape, ``{"type": "error", "error": {"type": ..., "message": ...}}``, with the
same headers, so the ``anthropic`` SDK retries them and raises its own typed errors: a shim at
capacity is Anthropic's 529 ``overloaded_error`` (``OverloadedError``), whatever
``--reject-status`` says; a tenant over quota is 429 ``rate_limit_error`` (``RateLimitError``);
no upstream is 503 ``overloaded_error`` (``ServiceUnavailableError``). The protocol's ``code``,
``retry_after_seconds`` and ``queue_depth`` stay in ``error``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace

from llm_backoff_shim.decide.tickets import Rejection
from llm_backoff_shim.http.errors import REFUSAL_HEADER, error_body, refusal_reason
from llm_backoff_shim.http.interface import wire_answer
from llm_backoff_shim.serve.api.routes import Shape

RawHeaders = list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class Refusal:
    """An answer the shim makes itself: status, raw headers and body (OpenAI-shaped as built;
    :func:`in_shape` renders it in a route's shape), and what it is counted and logged as.

    ``reason``: the bad-request reason (``llm_backoff_shim_bad_requests_total``) or the
    rejection code; ``retry_after``: a rejection's hint in seconds (None for other answers);
    ``shape``: the error shape it is answered in, where its maker knows the route's;
    ``detail``: a rejection's message, for the access log.
    """

    status: int
    headers: RawHeaders
    body: bytes
    reason: str = ""
    retry_after: float | None = None
    shape: Shape = Shape.OPENAI
    detail: str | None = None

    def with_headers(self, extra: RawHeaders) -> Refusal:
        """The same answer with ``extra`` headers after its own."""
        return replace(self, headers=[*self.headers, *extra]) if extra else self


def retry_after_header(seconds: float) -> int:
    """RFC 9110 delay-seconds: a whole number >= 1, never below the estimate."""
    if not math.isfinite(seconds):
        return 1
    return max(1, math.ceil(seconds - 1e-9))


def rejection_response(rejection: Rejection, default_status: int) -> Refusal:
    """The answer to ``rejection`` (``default_status`` unless it names its own): a new object
    each call, its parts remembered by the values they are written from (:data:`_RENDERED`)."""
    retry_after = rejection.retry_after
    whole = retry_after_header(retry_after)
    millis = max(1, round(retry_after * 1000))
    seconds = round(retry_after, 3)
    key = (
        rejection.code,
        rejection.message,
        rejection.type,
        rejection.status,
        default_status,
        whole,
        millis,
        seconds,
        rejection.queue_depth,
    )
    parts = _RENDERED.get(key)
    if parts is None:
        parts = _render_rejection(rejection, default_status, whole, millis, seconds)
        # Only positive finite hints are remembered: NaN never equals itself, and 0.0 equals
        # -0.0 while the body writes them apart.
        if seconds > 0 and math.isfinite(seconds):
            if len(_RENDERED) >= _RENDERED_MAX:
                _RENDERED.clear()
            _RENDERED[key] = parts
    status, headers, body = parts
    return Refusal(
        status, list(headers), body, rejection.code, rejection.retry_after, detail=rejection.message
    )


#: Rendered refusals by the values they are written from: under overload most answers are
#: refusals, and consecutive ones mostly write the same code, hint (to the millisecond) and
#: queue depth; rendering one was about a fifth of a refusal's CPU in the shim.
_RENDERED: dict[tuple[object, ...], tuple[int, tuple[tuple[bytes, bytes], ...], bytes]] = {}
_RENDERED_MAX = 512


def _render_rejection(
    rejection: Rejection, default_status: int, whole: int, millis: int, seconds: float
) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
    status = rejection.status if rejection.status is not None else default_status
    # The body json.dumps would write for {"error": {...}} (keys in this order), built from a
    # template rather than by the generic encoder.
    payload = _REJECTION_BODY % (
        _json_text(f"{rejection.message}, retry in {whole} s"),
        _json_text(rejection.type),
        _json_text(rejection.code),
        float.__repr__(seconds) if math.isfinite(seconds) else json.dumps(seconds),
        int(rejection.queue_depth),
    )
    body = payload.encode()
    headers = (
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(whole).encode()),
        (b"retry-after-ms", str(millis).encode()),
        (REFUSAL_HEADER, refusal_reason(status, rejection.code, retry=True)),
    )
    return status, headers, body


_REJECTION_BODY = (
    '{"error":{"message":%s,"type":%s,"param":null,"code":%s,"retry_after_seconds":%s,"queue_depth":%d}}'
)


@functools.lru_cache(maxsize=512)
def _json_text(text: str) -> str:
    """``text`` as a JSON string (messages repeat: the same few per limit and wait)."""
    return json.dumps(text)


def client_error(
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    status: int = 400,
    reason: str | None = None,
) -> Refusal:
    """An OpenAI-format error for a request the shim will not forward, counted as ``reason``
    (by default its ``code``: a metric's reason and the wire's code name one thing alike)."""
    body = error_body(message, "invalid_request_error", code, param)
    return _json(
        status,
        body,
        [(REFUSAL_HEADER, refusal_reason(status, code))],
        (code or "") if reason is None else reason,
    )


#: Anthropic's status for "overloaded": its SDKs retry it and raise ``OverloadedError``.
ANTHROPIC_OVERLOADED = 529

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
_KEPT = ("code", "retry_after_seconds", "queue_depth")


def in_shape(response: Refusal, shape: Shape) -> Refusal:
    """``response`` (OpenAI-shaped, as every function here builds it) in the route's error shape:
    the one place a refusal's wire form is chosen."""
    if shape is Shape.OPENAI:
        return response
    try:
        error = json.loads(response.body)["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        return response  # not one of ours: leave it as it is
    status = response.status
    kind = error.get("type")
    if kind == "server_overloaded":
        kind = "overloaded_error"
        if error.get("code") != "upstream_unavailable":
            status = ANTHROPIC_OVERLOADED
    elif kind == "rate_limit_exceeded":
        kind = "rate_limit_error"
    else:
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    detail = {"type": kind, "message": message, **{k: error[k] for k in _KEPT if error.get(k) is not None}}
    headers = [(k, v) for k, v in response.headers if k not in (b"content-type", b"content-length")]
    body = json.dumps({"type": "error", "error": detail}, separators=(",", ":")).encode()
    shaped = _json(status, body, headers, response.reason)
    return replace(shaped, retry_after=response.retry_after, shape=shape, detail=response.detail)


def wire_form(response: Refusal, shape: Shape) -> tuple[int, bytes]:
    """``response`` as written on a route of ``shape``: its status, and the whole response
    (status line, headers, body) in bytes, for a serving path that writes it itself."""
    if shape is not Shape.OPENAI:
        response = in_shape(response, shape)
    return response.status, wire_answer(response.status, response.headers, response.body)


def server_error(message: str, *, code: str, status: int = 502) -> Refusal:
    """An OpenAI-format error for an upstream answer the shim will not relay (nginx: 502)."""
    return _json(
        status, error_body(message, "server_error", code), [(REFUSAL_HEADER, refusal_reason(status, code))]
    )


def _json(status: int, payload: bytes, headers: RawHeaders, reason: str = "") -> Refusal:
    return Refusal(
        status=status,
        headers=[
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            *headers,
        ],
        body=payload,
        reason=reason,
    )
