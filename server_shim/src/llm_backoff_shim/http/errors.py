"""The shim's own error answers in OpenAI's error format: one renderer for every layer.

An error the shim makes itself carries ``{"error": {"message", "type", "param", "code"}}`` as
compact JSON, the shape the openai SDKs turn into their typed errors. The HTTP layer writes
the ones it answers for a connection (a head too large, too slow or malformed; an app that
failed) whole, with :func:`closing_error`; the request path renders its refusals' bodies
with :func:`error_body` (serve/api/rejection.py), and the relay a stream's last
error event.
"""

from __future__ import annotations

import json

from llm_backoff_shim.http.interface import wire_answer


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
        (b"connection", b"close"),
    ]
    return wire_answer(status, headers, body)
