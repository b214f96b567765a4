"""The relay: one admitted (or pass-through) request sent upstream and its answer streamed back.

Status, headers and body go to the client chunk by chunk as the upstream sends them (a
chunked answer straight onto the client's wire where the serving path offers it). What
the relay learns goes into the request's :class:`~llm_backoff_shim.serve.request_path.exchange.Exchange`.
The relay never asks the admission controller: where the upstream could not serve the
request it returns an :class:`~llm_backoff_shim.serve.request_path.exchange.UpstreamRefused`,
and the admission gate (gate.py) makes the refusal the proxy answers:

- any failure before the upstream's status line (refused, reset, timed out) is returned as
  unavailable (the gate's answer: 503 ``upstream_unavailable``, with a Retry-After from the
  outage's length so far); an invalid response head is a 502, nothing of it relayed;
- an upstream 503 on an admitted request (vLLM's ``--max-num-queued-reqs`` answer) is returned
  as overloaded (the gate's answer: a ``queue_full`` rejection with the configured status and
  an estimated Retry-After, the upstream's message kept in ours); other statuses pass through
  untouched;
- a failure mid-response ends an event stream with an error event and aborts the client
  connection, so a cut answer is never passed off as complete.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from llm_backoff_shim.decide.tickets import Outcome
from llm_backoff_shim.http.errors import error_body
from llm_backoff_shim.http.interface import (
    BODY_FOLLOWS,
    ChunkWriter,
    ClientWire,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeoutError,
)
from llm_backoff_shim.serve.api.rejection import server_error
from llm_backoff_shim.serve.observe.metrics import ShimMetrics
from llm_backoff_shim.serve.request_path.answer_meter import AnswerMeter
from llm_backoff_shim.serve.request_path.exchange import (
    VIA,
    Admitted,
    Clock,
    Exchange,
    ForwardRequest,
    Send,
    UpstreamRefused,
    answer,
    classify,
)
from llm_backoff_shim.serve.request_path.headers import strip_hop_by_hop
from llm_backoff_shim.serve.request_path.upstream import UpstreamClient

log = logging.getLogger("llm_backoff_shim.proxy")

#: How much of an upstream 503 body is read to explain the rejection.
_OVERLOAD_BODY_LIMIT = 64 * 1024


class UpstreamStreamBroken(Exception):  # noqa: N818 - reads better in logs than ...Error
    """The upstream failed after the response started; the client connection is aborted."""


class Relay:
    """Sends a request upstream and streams the answer back (module docstring)."""

    def __init__(
        self,
        *,
        upstream: UpstreamClient,
        metrics: ShimMetrics,
        clock: Clock,
        on_upstream_answer: Callable[[], None],
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock
        # Called whenever the upstream answers in HTTP (an outage, if any, is over).
        self.on_upstream_answer = on_upstream_answer

    async def __call__(
        self,
        forward: ForwardRequest,
        send: Send,
        admitted: Admitted | None,
        exchange: Exchange | None,
        arrival: float,
        wire: ClientWire | None = None,
    ) -> UpstreamRefused | None:
        """Relay the request (``admitted``: the slot it holds, None for a request admission does
        not gate) and its answer; an :class:`UpstreamRefused` when the upstream could not serve
        it and nothing was sent (the gate makes the answer)."""
        exchange = exchange if exchange is not None else Exchange()
        cls = admitted.cls if admitted is not None else None
        exchange.upstream_start = self.clock()
        try:
            response = await self.upstream.pool.request(
                forward.method, forward.target, forward.headers, forward.body
            )
        except UpstreamError as exc:
            # Nothing of a response arrived: the request may be retried elsewhere or later.
            exchange.upstream_end = self.clock()
            if isinstance(exc, UpstreamProtocolError):
                await self._bad_gateway(send, str(exc), exchange)
                return None
            return UpstreamRefused(str(exc))
        self.on_upstream_answer()
        started = False
        refused: UpstreamRefused | None = None
        exchange.first_byte = self.clock()
        meter: AnswerMeter | None = None
        first = True  # no body byte relayed yet
        try:
            if cls is not None:
                self.metrics.observe_first_byte(cls, exchange.first_byte - arrival)
            exchange.status = response.status
            if response.status == 503:
                refused = await self._upstream_overloaded(cls, response)
                return refused
            headers = strip_hop_by_hop(response.headers, lower=True)
            headers.append(VIA)
            observe = None
            if admitted is not None:
                headers += admitted.answer_headers()
                observe = admitted.observer()
            # A body already here goes out in the same write as the head (relay_cycle.py).
            start = {"type": "http.response.start", "status": response.status, "headers": headers}
            if response.body_ready():
                start[BODY_FOLLOWS] = True
            await send(start)
            started = True
            exchange.sent = response.status
            ended = False
            # Admitted answers' tokens are counted (answer_meter.py): the answer lengths learn from them.
            meter = AnswerMeter() if admitted is not None else None
            try:
                while True:
                    chunk = await response.read_chunk()
                    if not chunk:
                        break
                    if first:
                        first = False
                        if admitted is not None:
                            admitted.first_body_byte()
                    if observe is not None:
                        observe(chunk)
                    if meter is not None:
                        meter.feed(chunk)
                    # The upstream's last bytes often arrive with its end: finish in the same
                    # write instead of one more send (and syscall) per response.
                    ended = response.at_eof()
                    await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                    if ended:
                        break
                    if wire is not None:
                        # More to come: a chunked answer (a stream) goes straight to the client.
                        write = wire.chunk_writer()
                        if write is None:
                            wire = None  # an answer with a length: the plain path to its end
                        else:
                            await _splice(response, write, send, observe, meter)
                            ended = True
                            break
            except UpstreamError as exc:
                exchange.outcome, exchange.metric = Outcome.UPSTREAM_ERROR, "upstream_error"
                if response.event_stream:
                    # An error event first, as vLLM ends a stream that fails (the openai SDK raises
                    # APIError on it); the connection is then cut without the stream's last chunk.
                    await send({"type": "http.response.body", "body": _stream_error(exc), "more_body": True})
                raise UpstreamStreamBroken(f"upstream failed mid-response: {exc}") from exc
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            classify(exchange, response.status)
            if meter is not None and exchange.outcome is Outcome.COMPLETED:
                exchange.answer_tokens = meter.tokens(response.event_stream)
        finally:
            if not first and exchange.outcome is Outcome.ABORTED and 200 <= response.status < 300:
                # The client closed the answer after it began: the engine held the slot and made
                # these tokens, what the estimates learn (Outcome.ENDED_BY_CLIENT).
                exchange.outcome = Outcome.ENDED_BY_CLIENT
                if meter is not None:
                    exchange.answer_tokens = meter.tokens(response.event_stream, ended=False)
            # Back to the pool when the exchange ended cleanly; otherwise the connection is
            # closed, and the engine sees it drop and aborts the request.
            response.release()
            exchange.upstream_end = self.clock()
            if not started and refused is None and exchange.metric == "client_disconnected":
                log.debug("client left before the upstream answered")
        return None

    async def _bad_gateway(self, send: Send, detail: str, exchange: Exchange) -> None:
        # The upstream answered, but not in acceptable HTTP: nothing of it is relayed (nginx: 502).
        log.warning("upstream answered with an invalid response: %s", detail)
        self.on_upstream_answer()
        exchange.outcome, exchange.metric, exchange.detail = Outcome.UPSTREAM_ERROR, "upstream_error", detail
        response = server_error(f"invalid response from the upstream: {detail}", code="bad_upstream_response")
        await answer(send, response, exchange)

    async def _upstream_overloaded(self, cls: str | None, response: UpstreamResponse) -> UpstreamRefused:
        try:
            detail = _error_message(await response.read(_OVERLOAD_BODY_LIMIT))
        except UpstreamError as exc:
            detail = str(exc)
        if cls is None:
            return UpstreamRefused(f"upstream answered 503: {detail}")
        return UpstreamRefused(f"upstream answered 503: {detail}", overloaded=True)


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
        message = data["error"]["message"] if isinstance(data.get("error"), dict) else data.get("message")
        if isinstance(message, str) and message:
            return message[:300]
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    text = body.decode("utf-8", "replace").strip()
    return text[:300] or "no detail"


def _stream_error(exc: UpstreamError) -> bytes:
    code = "upstream_timeout" if isinstance(exc, UpstreamTimeoutError) else "upstream_error"
    return b"data: %b\n\n" % error_body(f"upstream failed mid-stream: {exc}", "server_error", code)


async def _splice(
    response: UpstreamResponse,
    write: ChunkWriter,
    send: Send,
    observe: Callable[[bytes], None] | None,
    meter: AnswerMeter | None = None,
) -> None:
    """Relay the rest of a chunked body with :meth:`UpstreamResponse.pipe` onto the client's wire.

    When the client falls behind, the engine's socket stops being read, and uvicorn's
    ``send`` (an empty chunk writes nothing) waits for the client to drain, as it does for
    every ``send`` of the plain path.
    """
    sink = write
    if observe is not None:

        def sink(chunk: bytes) -> bool:
            observe(chunk)
            return write(chunk)

    if meter is not None:
        feed, passed = meter.feed, sink

        def sink(chunk: bytes) -> bool:
            feed(chunk)
            return passed(chunk)

    while not await response.pipe(sink):
        await send({"type": "http.response.body", "body": b"", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
