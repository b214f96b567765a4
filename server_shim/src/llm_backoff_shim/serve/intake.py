"""Checks on what a client sends, before anything is queued or forwarded.

Each check returns None (fine) or a :class:`Refusal`: an OpenAI-format error answer
plus the ``reason`` under which it is counted (``llm_backoff_shim_bad_requests_total``).
Choices, where the issue leaves room:

- API keys are checked for every ``/v1/`` path (before queueing); ``/health``,
  ``/ready`` and ``/metrics`` stay open (orchestrators probe them; bind them
  elsewhere with ``--metrics-port``/``--metrics-host``).
- Generation bodies must be a JSON object. A missing ``Content-Type`` is accepted
  (vLLM's FastAPI does the same); any other non-JSON media type is a 415.
- The body limit is enforced on the declared ``Content-Length`` before reading, and
  again while reading (chunked bodies); the read as a whole must finish within the
  body timeout (a slow-loris body gets a 408).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from llm_backoff_shim.http.coarse_timers import CoarseTimers, MoveOnAfter
from llm_backoff_shim.serve.auth import ApiKeys, bearer_token, key_id
from llm_backoff_shim.serve.rejection import ErrorResponse, client_error

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
RawHeaders = list[tuple[bytes, bytes]]

log = logging.getLogger("llm_backoff_shim.intake")


@dataclass(frozen=True)
class Refusal:
    reason: str
    response: ErrorResponse


class ClientGone(Exception):  # noqa: N818 - an event, not an error of ours
    """The client disconnected before its body was complete."""


def header(headers: RawHeaders, name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def check_api_key(keys: ApiKeys, headers: RawHeaders) -> Refusal | None:
    if not keys.enabled:
        return None
    token = bearer_token(headers)
    if keys.check(token):
        return None
    if token is None:
        message = "missing API key: send it as 'Authorization: Bearer <key>'"
    else:
        message = "incorrect API key provided"
        log.info("refused a request with an unknown API key %s", key_id(token))
    response = client_error(message, code="invalid_api_key", status=401)
    response.headers.append((b"www-authenticate", b'Bearer realm="llm-backoff-shim"'))
    return Refusal("unauthorized", response)


def check_content_type(headers: RawHeaders) -> Refusal | None:
    value = header(headers, b"content-type")
    if value is None:
        return None
    media = value.split(b";", 1)[0].strip().lower()
    if media == b"application/json" or media.endswith(b"+json"):
        return None
    shown = media.decode("latin-1")[:100]
    return Refusal(
        "unsupported_media_type",
        client_error(
            f"unsupported content type {shown!r}: send application/json",
            param="content-type",
            code="unsupported_media_type",
            status=415,
        ),
    )


def _closing(response: ErrorResponse) -> ErrorResponse:
    # The rest of the body is never read: close the connection rather than drain it.
    response.headers.append((b"connection", b"close"))
    return response


def _too_large(limit: int) -> Refusal:
    return Refusal(
        "body_too_large",
        _closing(
            client_error(f"request body larger than {limit} bytes", code="request_too_large", status=413)
        ),
    )


def check_declared_length(headers: RawHeaders, limit: int) -> Refusal | None:
    value = header(headers, b"content-length")
    if value is not None and value.strip().isdigit() and int(value) > limit:
        return _too_large(limit)
    return None


async def read_body(
    receive: Receive,
    *,
    limit: int,
    time_limit: CoarseTimers | None,
    task: asyncio.Task[Any] | None = None,
) -> bytes | Refusal:
    """The whole body, or a refusal (too large, too slow). Raises :class:`ClientGone`.

    ``time_limit``: the shared body timeout (one ``CoarseTimers`` per proxy); None, no limit.
    ``task``: the current task, when the caller has it at hand (see ``MoveOnAfter``).
    """
    chunks: list[bytes] = []
    size = 0
    with MoveOnAfter(time_limit, task) as deadline:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    assert deadline.expired
    assert time_limit is not None
    return Refusal(
        "body_timeout",
        _closing(
            client_error(
                f"request body not received within {time_limit.delay:g} s", code="body_timeout", status=408
            )
        ),
    )


def reason_of(response: ErrorResponse) -> str:
    """The counting reason of an error the proxy built itself (by its ``code``)."""
    try:
        code = json.loads(response.body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return "unknown_class" if code == "invalid_request_class" else "invalid_header"


#: One decoder for every body; fed text, not bytes: ``json.loads(bytes)`` first guesses the
#: encoding, but JSON between systems is UTF-8 (RFC 8259 section 8.1).
_DECODER = json.JSONDecoder()


def parse_json_object(body: bytes) -> dict[str, Any] | Refusal:
    """The body as a JSON object (parsed once per request: a prompt can be megabytes)."""
    try:
        data = _DECODER.decode(body.decode())
    except UnicodeDecodeError:
        return Refusal("malformed_json", client_error("request body is not UTF-8", code="invalid_json"))
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        return Refusal(
            "malformed_json",
            client_error(f"request body is not valid JSON{where}", code="invalid_json"),
        )
    if not isinstance(data, dict):
        return Refusal(
            "malformed_json",
            client_error("request body must be a JSON object", code="invalid_json"),
        )
    return data
