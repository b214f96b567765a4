"""Checks on what a client sends, before anything is queued or forwarded: the proxy's intake.

:class:`Intake` runs them in one order, written once: :meth:`Intake.head` on the request's
head (path, operator route, API key, then for a generation request its class, tenant and
budget headers and content type, then the declared size), :meth:`Intake.body` on the body
read (a JSON object, and what it asks for: a stream, ``max_tokens``, and with a cost budget
its cost, :mod:`llm_backoff_shim.decide.cost`). The proxy's full path
and its refusal from the head (``Proxy.refuse_from_head``) both start from :meth:`Intake.head`,
so they cannot disagree on what passes.

Each check returns None (fine) or a :class:`~llm_backoff_shim.serve.api.rejection.Refusal`: an
OpenAI-format error answer with the ``reason`` under which it is counted
(``llm_backoff_shim_bad_requests_total``).
Choices, where the protocol leaves room:

- API keys are checked for every ``/v1/`` path (before queueing); ``/health``,
  ``/ready`` and ``/metrics`` stay open (orchestrators probe them; bind them
  on another port with ``--metrics-port``).
- Generation bodies must be a JSON object. A missing ``Content-Type`` is accepted
  (vLLM's FastAPI does the same); any other non-JSON media type is a 415.
- The body limit is enforced on the declared ``Content-Length`` before reading, and
  again while reading (chunked bodies); the read as a whole must finish within the
  body timeout (a slow-loris body gets a 408).
- Only POSTs to the route table's ``engine`` routes are admission-controlled; their
  ``x-request-class``, ``x-request-timeout-ms`` and ``x-request-timeout-scope`` are
  validated (400 when malformed) only there.
- A budget (``x-request-timeout-ms``) counts from when the load balancer first saw the call,
  its ``X-Request-Start`` stamp, when there is one: a call one replica queued and refused
  that the load balancer then sends to another replica arrives there with what is left of
  its budget, not all of it (without it, such calls queued again for a whole wait, and
  callers were refused later than they could use: docs/deploy.md, "A fleet"). Unreadable or
  implausible stamps are ignored; a caller can only shorten its own budget with one, so the
  stamp is believed from any peer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import replace
from typing import Any

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.cost import requested_max_tokens
from llm_backoff_shim.decide.requests import AdmissionRequest, UnknownClassError
from llm_backoff_shim.http.coarse_timers import CoarseTimers, MoveOnAfter
from llm_backoff_shim.serve.api.auth import ApiKeys, bearer_token, key_id
from llm_backoff_shim.serve.api.rejection import Refusal, client_error
from llm_backoff_shim.serve.api.routes import RouteTable
from llm_backoff_shim.serve.config.slices import IntakeSettings
from llm_backoff_shim.serve.policy.request_hooks import RequestHooks
from llm_backoff_shim.serve.request_path.exchange import ClientGone, Head

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
RawHeaders = list[tuple[bytes, bytes]]

log = logging.getLogger("llm_backoff_shim.intake")


def header(headers: RawHeaders, name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def operator_route_refused(path: str) -> Refusal:
    """The 403 of an operator route the operator did not allow (routes.py)."""
    return client_error(
        f"{path[:200]!r} is an operator route of the engine, not served through this shim; "
        "its operator may allow it with --allow-operator-route",
        code="operator_route",
        status=403,
        reason="operator_route",
    )


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
    response = client_error(message, code="invalid_api_key", status=401, reason="unauthorized")
    response.headers.append((b"www-authenticate", b'Bearer realm="llm-backoff-shim"'))
    return response


def check_content_type(headers: RawHeaders) -> Refusal | None:
    value = header(headers, b"content-type")
    if value is None:
        return None
    media = value.split(b";", 1)[0].strip().lower()
    if media == b"application/json" or media.endswith(b"+json"):
        return None
    shown = media.decode("latin-1")[:100]
    return client_error(
        f"unsupported content type {shown!r}: send application/json",
        param="content-type",
        code="unsupported_media_type",
        status=415,
        reason="unsupported_media_type",
    )


def _closing(response: Refusal) -> Refusal:
    # The rest of the body is never read: close the connection rather than drain it.
    response.headers.append((b"connection", b"close"))
    return response


def _too_large(limit: int) -> Refusal:
    return _closing(
        client_error(
            f"request body larger than {limit} bytes",
            code="request_too_large",
            status=413,
            reason="body_too_large",
        )
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
    return _closing(
        client_error(
            f"request body not received within {time_limit.delay:g} s",
            code="body_timeout",
            status=408,
            reason="body_timeout",
        )
    )


#: One decoder for every body; fed text, not bytes: ``json.loads(bytes)`` first guesses the
#: encoding, but JSON between systems is UTF-8 (RFC 8259 section 8.1).
_DECODER = json.JSONDecoder()


def parse_json_object(body: bytes) -> dict[str, Any] | Refusal:
    """The body as a JSON object (parsed once per request: a prompt can be megabytes)."""
    try:
        data = _DECODER.decode(body.decode())
    except UnicodeDecodeError:
        return client_error("request body is not UTF-8", code="invalid_json")
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        return client_error(f"request body is not valid JSON{where}", code="invalid_json")
    if not isinstance(data, dict):
        return client_error("request body must be a JSON object", code="invalid_json")
    return data


def asks_for_stream(body: dict[str, Any]) -> bool:
    """Whether a request body asks for a stream: only a JSON ``true`` does."""
    return body.get("stream") is True


def parse_budget(value: str | None) -> float | None:
    """``x-request-timeout-ms`` -> seconds; None when absent. Raises ValueError when malformed."""
    if value is None or not value.strip():
        return None
    millis = float(value.strip())
    if not math.isfinite(millis) or millis < 0:
        raise ValueError("must be a non-negative number of milliseconds")
    return millis / 1000.0


def parse_request_start(value: str | None) -> float | None:
    """``X-Request-Start`` -> when a load balancer first saw the call, in seconds since the
    epoch; None when absent or unreadable (the header is a proxy's note, not the caller's
    request: it is ignored, never refused). ``t=`` is optional; the number is read as
    seconds (nginx's ``$msec``: ``1733352000.123``), milliseconds (HAProxy's
    ``date(0,ms)``, New Relic's form) or microseconds (Apache's ``%t``) by its size."""
    if value is None:
        return None
    text = value.strip()
    if text[:2] in ("t=", "T="):
        text = text[2:]
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number) or number <= 0:
        return None
    if number > 1e14:
        return number / 1e6
    if number > 1e11:
        return number / 1e3
    return number


#: How far an ``X-Request-Start`` may lie ahead of this host's clock (the two hosts' clocks
#: differ a little) and how far behind it (older is no load balancer's stamp of a call in
#: progress) and still count; outside, the call is taken as arriving now.
REQUEST_START_AHEAD = 1.0
REQUEST_START_BEHIND = 3600.0


def waited_since(start: float | None, now: float) -> float:
    """Seconds a call stamped ``start`` (``X-Request-Start``) has already waited at ``now``."""
    if start is None:
        return 0.0
    waited = now - start
    if waited < -REQUEST_START_AHEAD or waited > REQUEST_START_BEHIND:
        return 0.0
    return max(0.0, waited)


#: ``x-request-timeout-scope`` values: the budget ends when the answer begins, or at its end.
BUDGET_SCOPES = {"start": True, "end": False}


def parse_budget_scope(value: str | None) -> bool:
    """``x-request-timeout-scope`` -> whether the budget is for the answer to begin (``start``);
    absent or blank is ``end``, the whole call. Raises ValueError for any other value."""
    if value is None or not value.strip():
        return False
    scope = BUDGET_SCOPES.get(value.strip().lower())
    if scope is None:
        raise ValueError("expected 'start' or 'end'")
    return scope


#: Larger claimed retry counts are read as this: the number only matters as ">= 1".
MAX_RETRY_COUNT = 1000


def parse_retry_count(value: str | None) -> int:
    """``x-stainless-retry-count`` as a count; absent or malformed is 0 (a fresh arrival).

    The openai SDKs send it (0 on a first attempt, n on the n-th retry) and ``llm_backoff``
    does too. It is a client library's header, not part of this shim's protocol, so a
    value it cannot read is not the client's mistake: no 400, the request is simply fresh.
    """
    if value is None:
        return 0
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 6:
        return 0
    return min(int(text), MAX_RETRY_COUNT)


def _text_header(headers: RawHeaders, name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


class Intake:
    """The checks on a request, in one order (module docstring); each step returns what the
    request is so far, or the one :class:`Refusal` that ends it."""

    def __init__(
        self,
        *,
        routes: RouteTable,
        api_keys: ApiKeys,
        hooks: RequestHooks,
        controller: AdmissionController,
        max_body_bytes: int,
        body_timeout: float | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.routes = routes
        self.wall = wall
        self.api_keys = api_keys
        self.hooks = hooks
        self.controller = controller
        self.max_body_bytes = max_body_bytes
        # Requests are priced only for a cost budget: without one, nothing reads the cost.
        self.pricing = controller.pricing
        # One shared timer for every request's body timeout (coarse_timers says why).
        self.body_timers = CoarseTimers(body_timeout) if body_timeout else None

    @classmethod
    def from_settings(
        cls, settings: IntakeSettings, *, hooks: RequestHooks, controller: AdmissionController
    ) -> Intake:
        """The intake for its slice of the settings."""
        return cls(
            routes=RouteTable(settings.allow_operator_route),
            api_keys=settings.api_keys,
            hooks=hooks,
            controller=controller,
            max_body_bytes=settings.max_body_bytes,
            body_timeout=settings.body_read_timeout,
        )

    def head(self, method: str, path: str, headers: RawHeaders) -> Head | Refusal:
        """The checks on the request's head, in order: path, operator route, API key, then for a
        generation request its class, tenant and budget headers and its content type, then the
        declared size. A refusal before the route is known to be served is OpenAI-shaped; after
        it, in the route's shape."""
        route = self.routes.lookup(path)
        if route is None:
            missing = client_error(
                f"no such path {path[:200]!r}: the shim serves the engine's API (docs/shim.md, routes)",
                status=404,
                reason="bad_path",
            )
            return missing
        if route.refused:
            return operator_route_refused(path)
        shape = route.shape
        refusal = check_api_key(self.api_keys, headers)
        if refusal is not None:
            return replace(refusal, shape=shape)
        request: AdmissionRequest | None = None
        if method == "POST" and route.admitted:
            parsed = self._admission_request(headers)
            if isinstance(parsed, Refusal):
                return replace(parsed, reason=parsed.reason or "invalid_header", shape=shape)
            request = parsed
            refusal = check_content_type(headers) if route.json_body else None
            if refusal is not None:
                return replace(refusal, shape=shape)
        refusal = check_declared_length(headers, self.max_body_bytes)
        if refusal is not None:
            return replace(refusal, shape=shape)
        return Head(route, headers, request)

    async def read(self, head: Head, receive: Receive, task: asyncio.Task[Any] | None) -> bytes | Refusal:
        """The request's body read whole within the size and time limits, or the refusal (in the
        route's shape) of one too large or too slow. Raises :class:`ClientGone`."""
        body = await read_body(receive, limit=self.max_body_bytes, time_limit=self.body_timers, task=task)
        return replace(body, shape=head.route.shape) if isinstance(body, Refusal) else body

    def body(
        self, head: Head, body: bytes
    ) -> tuple[AdmissionRequest | None, dict[str, Any] | None] | Refusal:
        """The checks on a generation request's body read whole: a JSON object where the route
        takes one, and what it asks for (a stream, ``max_tokens``, its cost under a cost budget)
        into its admission request. Returns the admission request and the parsed body (None for
        other requests)."""
        request = head.request
        if request is None or not head.route.json_body:
            return request, None
        data = parse_json_object(body)
        if isinstance(data, Refusal):
            return replace(data, shape=head.route.shape)
        stream, most = asks_for_stream(data), requested_max_tokens(data)
        pricing = self.pricing
        if pricing is not None:
            cost = pricing.price_body(request.cls, data)
            request = replace(request, stream=stream, max_tokens=most, cost=cost)
        elif stream or most is not None:
            request = replace(request, stream=stream, max_tokens=most)
        return request, data

    def _admission_request(self, headers: RawHeaders) -> AdmissionRequest | Refusal:
        class_header = _text_header(headers, b"x-request-class")
        try:
            chosen = self.hooks.choose_class(headers, class_header, self.controller)
        except UnknownClassError as exc:
            return client_error(str(exc), param="x-request-class", code="invalid_request_class")
        if isinstance(chosen, Refusal):
            return chosen
        cls, tenant = chosen
        name = "x-request-timeout-ms"
        try:
            budget = parse_budget(_text_header(headers, b"x-request-timeout-ms"))
            name = "x-request-timeout-scope"
            to_start = parse_budget_scope(_text_header(headers, b"x-request-timeout-scope"))
        except ValueError as exc:
            return client_error(
                f"invalid {name} header: {exc}", param=name, code="invalid_header", reason="invalid_header"
            )
        # A budget counts from the load balancer's X-Request-Start (module docstring).
        if budget is not None:
            start = parse_request_start(_text_header(headers, b"x-request-start"))
            if start is not None:
                budget = max(0.0, budget - waited_since(start, self.wall()))
        retry = parse_retry_count(_text_header(headers, b"x-stainless-retry-count"))
        return AdmissionRequest(
            cls=cls,
            budget=budget,
            tenant=tenant,
            retry=retry,
            budget_to_start=to_start and budget is not None,
        )
