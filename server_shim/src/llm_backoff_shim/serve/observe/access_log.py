"""One structured line per ``/v1/`` request: what happened, how long each part took.

The proxy fills an :class:`AccessRecord` as the request goes and hands it to
:class:`AccessLog` when it is over (whatever the path: relayed, rejected, refused as
malformed, or abandoned by the client). Fields:

==================  =================================================================
``method, path``    the request line, path only (the query string is never logged)
``class``           the traffic class (``-`` for requests that do not queue)
``outcome``         ``completed``, ``rejected``, ``client_disconnected``,
                    ``upstream_error``, ``bad_request``
``code``            rejection code (``queue_full``...) or bad-request reason
``status``          the HTTP status sent to the client (none if it left first)
``body_ms``         arrival (the request's head) to its body read in full: a client that
                    writes its head and body apart (httpx and httpcore do, with other
                    work between) shows here, not in the shim's own time
``queue_ms``        time queued for a slot (admitted or rejected after queueing)
``ttfb_ms``         arrival to the upstream's response head
``upstream_ms``     request sent upstream to the end of the relayed response (or
                    to the moment it was abandoned)
``total_ms``        arrival to the end
``retry_after_s``   the hint given with a rejection
``detail``          why a request was rejected, in the shim's own words (e.g. which
                    limit a ``queue_timeout`` hit); never anything the client sent
``tenant``          the tenant identity as the shim keys it: a 12-hex-digit hash of
                    the API key, or the configured tenant header's value
``request_id``      the client's ``x-request-id``, when short and printable
``client``          the peer address
==================  =================================================================

Never logged: API keys or any other header (except ``x-request-id``), query strings,
request or response bodies (prompts, completions).

Two renderings (``--log-format``): ``plain`` (``key=value`` pairs after the time and
request line, easy to read and to grep) and ``json`` (one object per line, for log
shippers). Lines go to the ``llm_backoff_shim.access`` logger at INFO; ``serve``
sends that logger to stdout with nothing added (log_setup.py: ``logging_config``), through a
``BatchedLineHandler``: lines are written in order, in batches, by a background thread.

Why batched: under overload most answers are refusals, and a line per answer written and
flushed on its own was about half of a refusal's CPU (a ``write`` system call and the
logging module's record, lock and formatter per line). When the access logger's one handler
is a :class:`BatchedLineHandler`, :class:`AccessLog` hands it the record itself with the
two clock readings of its end (no ``LogRecord``, no formatting on the request's path); the
writer thread renders each batch's lines, in a loop, before writing them. With any other
set-up (a test's capture, an application's own handlers) lines are rendered at once and go
through ``logger.info`` as usual. A record handed over is not changed afterwards: the line
is the one it would have been rendered as at its end.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from llm_backoff_shim.serve.log_setup import LOGGER_NAME, BatchedLineHandler, LogFormat

#: ``x-request-id`` values outside this shape are dropped rather than escaped.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
_PLAIN_SAFE = re.compile(r"[^\s\"\\=]+")
_MAX_PATH = 200
_MAX_REMEMBERED = 600
#: A time stamp's end, by its milliseconds.
_MILLIS = tuple(f".{ms:03d}+00:00" for ms in range(1000))


@dataclass(slots=True)
class AccessRecord:
    """What one request did; the proxy fills it in as it goes (times from its monotonic clock)."""

    method: str
    path: str
    arrival: float
    cls: str | None = None
    tenant: str | None = None
    outcome: str = "client_disconnected"
    code: str | None = None
    status: int | None = None
    body_done: float | None = None
    queue_time: float | None = None
    upstream_start: float | None = None
    first_byte: float | None = None
    upstream_end: float | None = None
    retry_after: float | None = None
    detail: str | None = None
    request_id: str | None = None
    client: str | None = None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The request's ``x-request-id`` as :func:`request_id` keeps it (None: absent or not kept)."""
    for key, value in headers:
        if key == b"x-request-id":
            return request_id(value)
    return None


def request_id(raw: bytes | None) -> str | None:
    """A client's ``x-request-id`` if it is a plain token; anything else is not logged."""
    if raw is None:
        return None
    value = raw.decode("latin-1").strip()
    return value if _REQUEST_ID.fullmatch(value) else None


class AccessLog:
    """Renders :class:`AccessRecord` s as log lines (plain or JSON)."""

    def __init__(
        self,
        log_format: LogFormat = "plain",
        *,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if log_format not in ("plain", "json"):
            raise ValueError(f"log format must be 'plain' or 'json', got {log_format!r}")
        self.log_format = log_format
        self.logger = logger if logger is not None else logging.getLogger(LOGGER_NAME)
        self.clock = clock
        self.wall_clock = wall_clock
        self._second: tuple[int, str] = (-1, "")

    def _timestamp(self, now: float) -> str:
        # ISO 8601 UTC with milliseconds; the part up to the second is reused within a
        # second (datetime formatting is a fair share of a line's cost).
        second = math.floor(now)
        micros = round((now - second) * 1e6)  # as datetime rounds, then truncate to ms
        if micros >= 1_000_000:
            second, micros = second + 1, micros - 1_000_000
        cached, prefix = self._second
        if cached != second:
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = (second, prefix)
        return prefix + _MILLIS[micros // 1000]

    @property
    def enabled(self) -> bool:
        """False when INFO is off for the logger: the proxy then skips building records."""
        return self.logger.isEnabledFor(logging.INFO)

    def fields(self, record: AccessRecord, end: float, now: float | None = None) -> dict[str, Any]:
        """The line's fields, in order; ``now``: the wall-clock time of ``end`` (None: now)."""
        upstream = None
        if record.upstream_start is not None:
            # No end: the request was abandoned (client gone) while upstream; it ended now.
            upstream = (
                record.upstream_end if record.upstream_end is not None else end
            ) - record.upstream_start
        ttfb = None if record.first_byte is None else record.first_byte - record.arrival
        body = None if record.body_done is None else record.body_done - record.arrival
        fields: dict[str, Any] = {
            "time": self._timestamp(self.wall_clock() if now is None else now),
            "method": record.method,
            "path": record.path[:_MAX_PATH],
            "class": record.cls or "-",
            "outcome": record.outcome,
            "code": record.code,
            "status": record.status,
            "body_ms": _ms(body),
            "queue_ms": _ms(record.queue_time),
            "ttfb_ms": _ms(ttfb),
            "upstream_ms": _ms(upstream),
            "total_ms": _ms(end - record.arrival),
            "retry_after_s": None if record.retry_after is None else round(record.retry_after, 3),
            "detail": record.detail,
            "tenant": record.tenant,
            "request_id": record.request_id,
            "client": record.client,
        }
        return fields

    def render(self, record: AccessRecord, end: float) -> str:
        """``record`` as a line, ending at ``end`` (monotonic), stamped with the wall clock now."""
        return self._render(record, end, self.wall_clock())

    def _render(self, record: AccessRecord, end: float, now: float) -> str:
        if self.log_format == "json":
            return json.dumps(self.fields(record, end, now), separators=(",", ":"), ensure_ascii=True)
        # The plain line straight from the record, in the order of fields(): this runs for
        # every answer, refusals included.
        upstream = None
        if record.upstream_start is not None:
            upstream = (
                record.upstream_end if record.upstream_end is not None else end
            ) - record.upstream_start
        # f"{ms:.1f}" writes the digits repr(round(ms, 1)) writes (one correctly rounded
        # conversion either way), below 1e16 ms, for a third of the cost.
        arrival = record.arrival
        # The fields that repeat from line to line (request line, class, outcome, code; detail,
        # tenant, request id, client) are rendered once per combination, kept in a table.
        path = record.path[:_MAX_PATH]
        key: tuple[str | None, ...] = (record.method, path, record.cls, record.outcome, record.code)
        head = _WORDS_SEEN.get(key)
        if head is None:
            head = _remember(key, _head_words(record, path))
        parts = [self._timestamp(now), head]
        if record.status is not None:
            parts.append(f"status={record.status}")
        body_done, queue_time, first_byte = record.body_done, record.queue_time, record.first_byte
        if (
            body_done is not None
            and queue_time is not None
            and first_byte is not None
            and upstream is not None
        ):
            # A relayed request's five times, in one string.
            parts.append(
                f"body_ms={(body_done - arrival) * 1000:.1f} queue_ms={queue_time * 1000:.1f} "
                f"ttfb_ms={(first_byte - arrival) * 1000:.1f} upstream_ms={upstream * 1000:.1f} "
                f"total_ms={(end - arrival) * 1000:.1f}"
            )
        else:
            if body_done is not None:
                parts.append(f"body_ms={(body_done - arrival) * 1000:.1f}")
            if queue_time is not None:
                parts.append(f"queue_ms={queue_time * 1000:.1f}")
            if first_byte is not None:
                parts.append(f"ttfb_ms={(first_byte - arrival) * 1000:.1f}")
            if upstream is not None:
                parts.append(f"upstream_ms={upstream * 1000:.1f}")
            parts.append(f"total_ms={(end - arrival) * 1000:.1f}")
        if record.retry_after is not None:
            parts.append("retry_after_s=" + _three_places(record.retry_after))
        key = (record.detail, record.tenant, record.request_id, record.client)
        if key != _NO_WORDS:
            tail = _WORDS_SEEN.get(key)
            if tail is None:
                tail = _remember(key, _tail_words(record))
            parts.append(tail)
        return " ".join(parts)

    def write(self, record: AccessRecord) -> None:
        """Log ``record`` as ending now (never raises: a log failure must not fail a request).

        ``record`` must not change afterwards: with a :class:`BatchedLineHandler` it is
        rendered later, by the writer thread.
        """
        try:
            end, now = self.clock(), self.wall_clock()
            logger = self.logger
            handlers = logger.handlers
            if len(handlers) == 1 and not logger.propagate and not logger.filters:
                handler = handlers[0]
                if (
                    type(handler) is BatchedLineHandler
                    and handler.level <= logging.INFO
                    and not handler.filters
                ):
                    handler.write_later(self._render, record, end, now)
                    return
            logger.info(self._render(record, end, now))
        except Exception:  # pragma: no cover - a broken handler; logging reports its own errors
            logging.getLogger("llm_backoff_shim").exception("access log line failed")


def json_records(text: str) -> Iterator[dict[str, Any]]:
    """The JSON access records in a log's text (``--log-format json``); any other line is skipped."""
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            yield entry


def _three_places(value: float) -> str:
    """``str(round(value, 3))`` at a quarter of the cost.

    Below 1e12 a number with three decimals has at most 15 significant digits, so the
    shortest repr of the float nearest to it is those digits: the correctly rounded
    ``:.3f`` rendering without its trailing zeros.
    """
    if value.__class__ is float and -1e12 < value < 1e12:
        text = f"{value:.3f}".rstrip("0")
        return text + "0" if text[-1] == "." else text
    return str(round(value, 3))


_PLAIN_SEEN: dict[str, str] = {}
_WORDS_SEEN: dict[tuple[str | None, ...], str] = {}
_NO_WORDS = (None, None, None, None)


def _remember(key: tuple[str | None, ...], words: str) -> str:
    """``words`` rendered from ``key``, kept for the next line with the same values (short ones
    only: the table stays small whatever clients send)."""
    if len(words) <= _MAX_REMEMBERED:
        if len(_WORDS_SEEN) >= 4096:
            _WORDS_SEEN.clear()
        _WORDS_SEEN[key] = words
    return words


def _head_words(record: AccessRecord, path: str) -> str:
    """The plain line's request line, class, outcome and code."""
    words = [
        record.method,
        _plain(path),
        "class=" + _plain(record.cls or "-"),
        "outcome=" + _plain(record.outcome),
    ]
    if record.code is not None:
        words.append("code=" + _plain(record.code))
    return " ".join(words)


def _tail_words(record: AccessRecord) -> str:
    """The plain line's detail, tenant, request id and client (those present)."""
    named = (
        ("detail", record.detail),
        ("tenant", record.tenant),
        ("request_id", record.request_id),
        ("client", record.client),
    )
    return " ".join(f"{name}={_plain(value)}" for name, value in named if value is not None)


def _plain(value: object) -> str:
    text = str(value)
    # Quote anything that would break key=value parsing (spaces, quotes, '='). Most values
    # repeat (paths, classes, outcomes, codes, clients): remembered, in a bounded table.
    shown = _PLAIN_SEEN.get(text)
    if shown is None:
        shown = text if _PLAIN_SAFE.fullmatch(text) else json.dumps(text, ensure_ascii=True)
        if len(_PLAIN_SEEN) >= 4096:
            _PLAIN_SEEN.clear()
        _PLAIN_SEEN[text] = shown
    return shown
