"""The continuation of a streamed generation cut after content (`RetryPolicy.continue_cut_streams`).

A stream cannot be resumed where it broke: the server that generated it is gone (an
engine that died, a replica restarted). What can be done is to ask again, with the text
received so far as the start of the answer, and to hand the caller what comes next as
the rest of the same stream. The transport does that for a 200 event stream of a
generation, when the policy says so:

- the stream is cut when it breaks off, when it ends before its end (``data: [DONE]``,
  Anthropic's ``message_stop``), or when an error event comes after content. A cut after
  the generation finished (a ``finish_reason`` or ``stop_reason`` seen), or after anything
  but text (tool calls, reasoning, a second choice), is the caller's, as without the policy;
- the cut is decided as a failed attempt of the call (`attempts.RetryState.cut`): it is
  retried under the call's deadline, attempts and retry budget, after the usual wait;
- the continuation asks for the same generation with the received text as the start of
  the answer (`Generation.continued`), its token limit reduced by what was received
  (`Transcript.tokens`). Per API: a chat completion gets it as a final assistant message
  with vLLM's ``continue_final_message: true`` and ``add_generation_prompt: false`` (fields
  of vLLM's; OpenAI's own API has no prefill, so chat streams to ``api.openai.com`` or
  Azure OpenAI are not continued); a legacy completion appends it to ``prompt``; an
  Anthropic message gets it as a final assistant message (prefill), without its trailing
  whitespace, which Anthropic refuses there, and that much leading whitespace is taken
  off the continuation's text;
- the caller's stream gets the continuation's events from its first content on: the
  events before it (the role chunk, ``message_start``, the text block reopened) are
  dropped and Anthropic's block indexes carried on, so an SDK's stream sees one answer,
  every piece of text once. Bytes reach the caller event by event (an event cut in half
  is never handed over). The continuation's own stream is continued the same way if it
  is cut in turn;
- when the cut is not retried (the deadline, attempts or budget end it, a continuation
  is refused), the caller gets the cut: the error it broke with, the error event, or for
  a stream that ended early the HTTP library's ``RemoteProtocolError`` (an early end is
  not passed off as a whole answer), each with the call's attempt history.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .attempt_core import continuing, report
from .attempt_request import mark_retry
from .attempts import EXTENSION_KEY, REASON_KEY, GiveUp, RetryState, annotate, describe_error
from .bodies import Flavor, is_event_stream
from .classify import Verdict, classify_exception, classify_status
from .retry_after import parse_hint
from .stream_start import ErrorEvent, classify_event, ended_error
from .testing import current_mode
from .tokens import CHARS_PER_TOKEN

if TYPE_CHECKING:
    from collections.abc import Callable

    from .engine import RetryEngine

__all__ = ["Continued", "Generation", "Transcript", "generation_of"]

#: Hosts whose chat completions have no way to continue an answer (no prefill).
_NO_PREFILL_HOSTS = ("api.openai.com",)
_NO_PREFILL_SUFFIXES = (".openai.azure.com",)
_EMPTY: tuple[object, ...] = (None, "", [], {})


@dataclass(frozen=True, slots=True)
class Generation:
    """A streamed generation request that can be continued: its API and its JSON body."""

    api: str
    """``"chat"``, ``"completions"`` or ``"messages"``."""
    body: Mapping[str, Any]

    def continued(self, transcript: Transcript) -> tuple[dict[str, Any], str]:
        """The body that asks for the rest after ``transcript``'s text, and the leading
        whitespace to take off the continuation's text (Anthropic's prefill drops it)."""
        body = dict(self.body)
        text = transcript.text
        limit = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if isinstance(body.get(limit), int):
            body[limit] = max(1, body[limit] - transcript.tokens())
        if self.api == "completions":
            body["prompt"] = body["prompt"] + text
            return body, ""
        messages = list(body["messages"])
        last: Any = messages[-1] if messages else None
        prefilled = isinstance(last, Mapping) and last.get("role") == "assistant"
        if self.api == "chat":
            if prefilled and body.get("continue_final_message") and isinstance(last["content"], str):
                messages[-1] = {**last, "content": last["content"] + text}
            else:
                messages.append({"role": "assistant", "content": text})
            body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
            return body, ""
        held = text[len(text.rstrip()) :]
        if prefilled:
            messages[-1] = {**last, "content": _with_text(last["content"], text)}
        else:
            messages.append({"role": "assistant", "content": text})
        final = messages[-1]
        content = _stripped(final["content"])
        if content:
            messages[-1] = {**final, "content": content}
        else:
            messages.pop()
        body["messages"] = messages
        return body, held


def _with_text(content: object, text: str) -> object:
    if isinstance(content, str):
        return content + text
    blocks = list(content) if isinstance(content, list) else []
    if blocks and isinstance(blocks[-1], Mapping) and blocks[-1].get("type") == "text":
        blocks[-1] = {**blocks[-1], "text": blocks[-1].get("text", "") + text}
    else:
        blocks.append({"type": "text", "text": text})
    return blocks


def _stripped(content: object) -> object:
    """An assistant prefill without trailing whitespace (Anthropic refuses it); empty if nothing is left."""
    if isinstance(content, str):
        return content.rstrip()
    blocks = list(content) if isinstance(content, list) else []
    if blocks and isinstance(blocks[-1], Mapping) and blocks[-1].get("type") == "text":
        text = str(blocks[-1].get("text", "")).rstrip()
        if text:
            blocks[-1] = {**blocks[-1], "text": text}
        else:
            blocks.pop()
    return blocks


def generation_of(request: Any) -> Generation | None:
    """The continuable generation ``request`` asks for, or None.

    A streamed chat completion (not to a host without prefill), legacy completion with a
    text prompt, or Anthropic message, for one answer: no ``n`` above 1, no ``echo``, no
    structured output (a grammar would restart at the continuation).
    """
    path = request.url.path.rstrip("/")
    if path.endswith("/chat/completions"):
        api = "chat"
        host = request.url.host
        if host in _NO_PREFILL_HOSTS or host.endswith(_NO_PREFILL_SUFFIXES):
            return None
    elif path.endswith("/completions"):
        api = "completions"
    elif path.endswith("/messages"):
        api = "messages"
    else:
        return None
    try:
        body = json.loads(request.content)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("stream") is not True:
        return None
    if body.get("n") not in (None, 1) or body.get("echo") or body.get("best_of") not in (None, 1):
        return None
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        return None
    if any(key.startswith("guided_") or key == "structured_outputs" for key in body):
        return None
    if api == "completions" and not isinstance(body.get("prompt"), str):
        return None
    if api != "completions" and not isinstance(body.get("messages"), list):
        return None
    return Generation(api, body)


class Transcript:
    """What a generation's events have delivered: its text, and whether it can be continued."""

    __slots__ = (
        "api",
        "continuable",
        "ended",
        "finished",
        "next_index",
        "open_index",
        "pieces",
        "reported",
        "text",
    )

    def __init__(self, api: str) -> None:
        self.api = api
        self.text = ""
        self.pieces = 0
        """Events that carried text: each is at least one token."""
        self.reported: int | None = None
        """Tokens generated so far as the server reported them (vLLM's continuous usage)."""
        self.continuable = True
        self.finished = False
        """The generation said it is done (a finish or stop reason)."""
        self.ended = False
        """The stream's last event came (``[DONE]``, ``message_stop``)."""
        self.open_index: int | None = None
        self.next_index = 0

    def tokens(self) -> int:
        """Tokens received: as the server reported them (vLLM's ``continuous_usage_stats``), else
        one per text event of an OpenAI-style stream (vLLM and OpenAI send one per token), and
        for Anthropic's (several tokens an event) its characters over `tokens.CHARS_PER_TOKEN`
        when that is more."""
        if self.reported is not None:
            return self.reported
        if self.api != "messages":
            return self.pieces
        return max(self.pieces, math.ceil(len(self.text) / CHARS_PER_TOKEN))

    def read(self, name: str | None, data: str) -> ErrorEvent | None:
        """Take in one event; an error event is returned (it cuts the stream)."""
        verdict = classify_event(name, data)
        if isinstance(verdict, ErrorEvent):
            return verdict
        if data == "[DONE]":
            self.ended = True
            return None
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        if not isinstance(body, Mapping):
            return None
        if self.api == "messages":
            self._message_event(body)
        else:
            self._chunk(body)
        return None

    def _chunk(self, body: Mapping[str, Any]) -> None:
        usage = body.get("usage")
        if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
            self.reported = usage["completion_tokens"]
        choices = body.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                self.continuable = False
                continue
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.api == "completions":
                text = choice.get("text")
            else:
                delta = choice.get("delta")
                delta = delta if isinstance(delta, Mapping) else {}
                text = delta.get("content")
                if any(
                    key not in ("role", "content") and value not in _EMPTY for key, value in delta.items()
                ):
                    self.continuable = False
            if isinstance(text, str) and text:
                self.text += text
                self.pieces += 1

    def _message_event(self, body: Mapping[str, Any]) -> None:
        kind = body.get("type")
        index = body.get("index")
        if kind == "content_block_start":
            block = body.get("content_block")
            if not isinstance(block, Mapping) or block.get("type") != "text":
                self.continuable = False
            elif isinstance(index, int):
                self.open_index = index
                self.text += str(block.get("text") or "")
        elif kind == "content_block_delta":
            delta = body.get("delta")
            if isinstance(delta, Mapping) and delta.get("type") == "text_delta":
                text = delta.get("text")
                if isinstance(text, str) and text:
                    self.text += text
                    self.pieces += 1
            else:
                self.continuable = False
        elif kind == "content_block_stop" and isinstance(index, int):
            self.open_index = None
            self.next_index = index + 1
        elif kind == "message_delta":
            delta = body.get("delta")
            if isinstance(delta, Mapping) and delta.get("stop_reason") is not None:
                self.finished = True
        elif kind == "message_stop":
            self.ended = True


class _Events:
    """Splits a byte stream into whole server-sent events: ``(raw bytes, event name, data)``;
    data is None for an event without data (comments)."""

    __slots__ = ("_data", "_event", "_lines", "_pending")

    def __init__(self) -> None:
        self._pending = b""
        self._lines: list[bytes] = []
        self._event: str | None = None
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[bytes, str | None, str | None]]:
        pending = self._pending + chunk
        lines = pending.splitlines(keepends=True)
        # A line is complete at its end of line; a final "\r" may be half of "\r\n".
        if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
            self._pending = lines.pop()
        else:
            self._pending = b""
        events = []
        for raw in lines:
            self._lines.append(raw)
            line = raw.rstrip(b"\r\n").decode("utf-8", "replace")
            if line:
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "event":
                    self._event = value
                elif name == "data":
                    self._data.append(value)
                continue
            data = "\n".join(self._data) if self._data else None
            events.append((b"".join(self._lines), self._event, data))
            self._lines, self._event, self._data = [], None, []
        return events

    def rest(self) -> bytes:
        """The bytes of an event not yet ended."""
        return b"".join(self._lines) + self._pending


class _Splice:
    """Turns a continuation's events into the rest of the cut stream: drops what comes before
    its first content, carries Anthropic's block indexes on, takes off held whitespace."""

    __slots__ = ("_api", "_began", "_held", "_offset", "_reopened")

    def __init__(self, transcript: Transcript, held: str) -> None:
        self._api = transcript.api
        self._began = False
        self._held = held
        opened = transcript.open_index
        #: The continuation's text block 0 goes on in the cut stream's open block, if one is.
        self._reopened = opened is not None
        self._offset = opened if opened is not None else transcript.next_index

    def event(self, raw: bytes, name: str | None, data: str | None) -> bytes | None:
        if data is None:
            return raw
        if self._api != "messages":
            if not self._began:
                if classify_event(name, data) is False:
                    return None
                self._began = True
            return raw
        try:
            body = json.loads(data)
        except ValueError:
            return raw
        if not isinstance(body, dict):
            return raw
        kind = body.get("type")
        if kind in ("message_start", "ping"):
            return None
        index = body.get("index")
        closed = b""
        if isinstance(index, int):
            if self._reopened and index == 0 and kind == "content_block_start":
                self._reopened = False
                block = body.get("content_block")
                if isinstance(block, Mapping) and block.get("type") == "text" and not block.get("text"):
                    return None
                # Not text: the cut stream's open block ends, and this one comes after it.
                stop = {"type": "content_block_stop", "index": self._offset}
                closed = f"event: content_block_stop\ndata: {json.dumps(stop)}\n\n".encode()
                self._offset += 1
            body["index"] = index + self._offset
        delta = body.get("delta")
        if self._held and kind == "content_block_delta" and isinstance(delta, dict):
            text = str(delta.get("text") or "")
            lead = len(text) - len(text.lstrip())
            drop = min(lead, len(self._held))
            self._held = "" if drop < lead or drop < len(text) else self._held[drop:]
            if drop == len(text):
                return None
            delta["text"] = text[drop:]
        return closed + f"event: {name or kind}\ndata: {json.dumps(body)}\n\n".encode()


class Continued:
    """A generation's event stream, continued when it is cut after content (see the module).

    Handed to the library's guarded stream as its inner stream: iterate it sync or async,
    as the response it came from.
    """

    def __init__(
        self,
        engine: RetryEngine,
        send: Callable[[Any], Any],
        flavor: Flavor,
        request: Any,
        generation: Generation,
        state: RetryState,
        stream: Any,
        extensions: dict[str, Any],
    ) -> None:
        self._engine = engine
        self._send = send
        self._flavor = flavor
        self._request = request
        self._state = state
        self._generation = generation
        self._stream = stream
        self._extensions = extensions
        self._transcript = Transcript(generation.api)

    def close(self) -> None:
        self._stream.close()

    async def aclose(self) -> None:
        await self._stream.aclose()

    def _cut(self, error: BaseException | ErrorEvent | None) -> tuple[Any, str, float] | None:
        """Decide on a cut: None when it is not continued, else the continuation's request, the
        whitespace held back and the wait before it. A cut that is not continued is recorded
        (and ``error``, when it is an exception, annotated) only when the call's rules decided it."""
        transcript = self._transcript
        if self._nothing_to_continue():
            return None
        policy = self._state.policy
        hint = None
        if error is None:
            verdict = Verdict(policy.retry_connection_errors, "the stream ended early, after content")
            described = "the event stream ended before the generation did"
        elif isinstance(error, ErrorEvent):
            parsed = parse_hint({}, error.body, wall_clock=self._engine.wall_clock)
            hint = None if parsed is None else parsed.seconds
            verdict = classify_status(policy, error.status, {}, error.body, hint=hint)
            verdict = verdict._replace(reason=f"{verdict.reason} ({error.kind} event after content)")
            described = f"{error.kind} event after content"
        else:
            verdict = classify_exception(policy, error)
            verdict = verdict._replace(reason=f"{verdict.reason} after content")
            described = describe_error(error)
        state = self._state
        decision = state.cut(verdict, error=described, hint=hint)
        self._extensions[EXTENSION_KEY] = state.history
        request = self._request
        report(self._engine, state, decision, request, hint)
        if isinstance(decision, GiveUp):
            self._give_up(error)
            return None
        body, held = self._generation.continued(transcript)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
        continuation = type(request)(
            request.method,
            request.url,
            headers=headers,
            content=json.dumps(body).encode(),
            extensions=dict(request.extensions),
        )
        mark_retry(continuation)
        return continuation, held, decision.wait

    def _nothing_to_continue(self) -> bool:
        """The stream ended whole, or what it carried cannot be continued."""
        t = self._transcript
        return t.ended or t.finished or not t.continuable or not t.text

    def _give_up(self, error: BaseException | ErrorEvent | None) -> None:
        reason = self._state.final_reason
        if reason is not None:
            self._extensions[REASON_KEY] = reason
        if isinstance(error, BaseException):
            annotate(error, self._state.history, reason)

    def _ended_error(self) -> BaseException:
        exc = ended_error(self._request, "the event stream ended before the generation did")
        annotate(exc, self._state.history, self._state.final_reason)
        return exc

    def _refused(self, response: Any) -> bool:
        """Whether the continuation's answer is not a stream to splice in (the call then gives up)."""
        if response.status_code == 200 and is_event_stream(response):
            return False
        reason = response.extensions.get(REASON_KEY) or f"status {response.status_code}"
        self._state.final_reason = f"the continuation was answered {response.status_code} ({reason})"
        self._extensions[EXTENSION_KEY] = self._state.history
        return True

    def __iter__(self) -> Iterator[bytes]:
        events = _Events()
        transcript = self._transcript
        error: BaseException | ErrorEvent | None = None
        last = b""
        try:
            for chunk in self._stream:
                for raw, name, data in events.feed(chunk):
                    error = None if data is None else transcript.read(name, data)
                    if error is not None:
                        last = raw
                        break
                    yield raw
                if error is not None:
                    break
        except Exception as exc:
            error = exc
        if error is None and self._nothing_to_continue():
            yield events.rest()
            return
        decided = self._cut(error)
        if decided is not None:
            request, held, wait = decided
            if current_mode() is None:
                self._engine.sleep(wait)
            self._stream.close()
            response = self._engine.run_sync(request, self._send, self._flavor, continuing(self._state))
            if not self._refused(response):
                self._stream = response.stream
                splice = _Splice(transcript, held)
                more = _Events()
                for chunk in self._stream:
                    for raw, name, data in more.feed(chunk):
                        out = splice.event(raw, name, data)
                        if out is not None:
                            # the history as it stands, should the continuation be cut in turn
                            self._extensions[EXTENSION_KEY] = self._state.history
                            yield out
                yield more.rest()
                return
            response.close()
            self._give_up(error)
        if not isinstance(error, ErrorEvent):
            raise self._ended_error() if error is None else error
        yield last

    async def __aiter__(self) -> AsyncIterator[bytes]:
        events = _Events()
        transcript = self._transcript
        error: BaseException | ErrorEvent | None = None
        last = b""
        try:
            async for chunk in self._stream:
                for raw, name, data in events.feed(chunk):
                    error = None if data is None else transcript.read(name, data)
                    if error is not None:
                        last = raw
                        break
                    yield raw
                if error is not None:
                    break
        except Exception as exc:
            error = exc
        if error is None and self._nothing_to_continue():
            yield events.rest()
            return
        decided = self._cut(error)
        if decided is not None:
            request, held, wait = decided
            if current_mode() is None:
                await self._engine.async_sleep(wait)
            await self._stream.aclose()
            response = await self._engine.run_async(
                request, self._send, self._flavor, continuing(self._state)
            )
            if not self._refused(response):
                self._stream = response.stream
                splice = _Splice(transcript, held)
                more = _Events()
                async for chunk in self._stream:
                    for raw, name, data in more.feed(chunk):
                        out = splice.event(raw, name, data)
                        if out is not None:
                            # the history as it stands, should the continuation be cut in turn
                            self._extensions[EXTENSION_KEY] = self._state.history
                            yield out
                yield more.rest()
                return
            await response.aclose()
            self._give_up(error)
        if not isinstance(error, ErrorEvent):
            raise self._ended_error() if error is None else error
        yield last
