"""The shim's own error answers in OpenAI's error format: one renderer for every layer.

An error the shim makes itself carries ``{"error": {"message", "type", "param", "code"}}`` as
compact JSON, the shape the openai SDKs turn into their typed errors. The HTTP layer writes
the ones it answers for a connection (a head too large, too slow or malformed; an app that
failed) whole, with :func:`closing_error`; the request path renders its refusals' bodies
with :func:`error_body` (serve/api/rejection.py), and the relay a stream's last
error event.

Every such answer carries one :data:`REFUSAL_HEADER` saying why and whether the same request can
succeed later (:func:`refusal_reason`), so a client or a balancer need not guess from the status.
"""

from __future__ import annotations

import json

from llm_backoff_shim.http.interface import wire_answer

#: The header on every answer the shim makes itself instead of the engine's (docs/protocol.md).
REFUSAL_HEADER = b"x-llm-backoff-refusal"

#: Statuses of the shim's own answers after which the same request may succeed: a client
#: that was too slow (408), a refusal for load or quota (429), the shim's or its upstream's
#: trouble (5xx). Every other 4xx is about the request itself: sending it again cannot help.
_MAY_SUCCEED_LATER = frozenset({408, 429})


def refusal_reason(status: int, code: str | None, *, retry: bool | None = None) -> bytes:
    """The :data:`REFUSAL_HEADER` value: ``retry-`` or ``final-`` and the error's code, dashed
    (``retry-queue-full``, ``final-class-not-allowed``); ``retry`` overrides the status's verdict
    (a refusal for load is worth retrying whatever ``--reject-status`` says)."""
    if retry is None:
        retry = status in _MAY_SUCCEED_LATER or status >= 500
    name = (code or f"status-{status}").replace("_", "-")
    return f"{'retry' if retry else 'final'}-{name}".encode()


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> bytes:
    """The error's JSON body: ``kind`` is its ``type`` (``invalid_request_error``, ``server_error``...)."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


def closing_error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    """A whole error answer (status line, headers, body) after which the connection is closed."""
    body = error_body(message, kind, code)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (REFUSAL_HEADER, refusal_reason(status, code)),
        (b"connection", b"close"),
    ]
    return wire_answer(status, headers, body)
