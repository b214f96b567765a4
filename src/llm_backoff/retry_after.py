"""Reading the server's "come back in N seconds" hint.

Sources, first usable one wins:

1. ``retry-after-ms`` header (milliseconds, float allowed; what the openai SDK reads first),
2. ``retry-after`` header as delay-seconds (floats allowed, though RFC 9110 says integer),
3. ``retry-after`` header as an HTTP-date, relative to an injected wall clock,
4. the JSON body's ``error.retry_after_seconds``, or a top-level ``retry_after_seconds``.

Garbage (unparsable text, NaN, infinities, booleans) in one source is skipped and
the next source is tried; nothing here raises on server input. A negative delay or
a date in the past is a real answer meaning "now": it is returned as 0.0, and the
backoff then falls back to its computed delay.

Pure: no clock is read unless passed in; the wall clock (``time.time`` style) is
only needed for HTTP-dates.
"""

from __future__ import annotations

import email.utils
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

HintSource = Literal["retry-after-ms", "retry-after", "retry-after-date", "body"]

#: Error bodies larger than this are not parsed for hints (they are not error objects).
MAX_HINT_BODY = 64 * 1024


@dataclass(frozen=True, slots=True)
class Hint:
    """A server hint: wait ``seconds`` (>= 0, finite) before retrying."""

    seconds: float
    source: HintSource


def _number(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_delay_seconds(text: str) -> float | None:
    """``"2"``, ``"1.5"`` -> seconds; garbage, NaN and infinities -> None; negative -> 0.0."""
    value = _number(text)
    return None if value is None else max(0.0, value)


def parse_http_date(text: str, *, now: float) -> float | None:
    """An HTTP-date -> seconds from ``now`` (a Unix time); past dates -> 0.0, garbage -> None."""
    try:
        parsed = email.utils.parsedate_tz(text)
        if parsed is None:
            return None
        when = email.utils.mktime_tz(parsed)
    except (TypeError, ValueError, OverflowError, OSError):
        return None
    delay = float(when) - now
    return max(0.0, delay) if math.isfinite(delay) else None


def hint_from_body(body: bytes | str | Mapping[str, object] | None) -> float | None:
    """``{"error": {"retry_after_seconds": 2.5}}`` or ``{"retry_after_seconds": 2.5}`` -> 2.5."""
    data: object = body
    if isinstance(body, (bytes, str)):
        if not body or len(body) > MAX_HINT_BODY:
            return None
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
    if not isinstance(data, Mapping):
        return None
    candidates: list[object] = []
    error = data.get("error")
    if isinstance(error, Mapping):
        candidates.append(error.get("retry_after_seconds"))
    candidates.append(data.get("retry_after_seconds"))
    for value in candidates:
        # bool is an int subclass; a JSON `true` is not a number of seconds.
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return max(0.0, float(value))
        if isinstance(value, str):
            parsed = parse_delay_seconds(value)
            if parsed is not None:
                return parsed
    return None


def parse_hint(
    headers: Mapping[str, str],
    body: bytes | str | Mapping[str, object] | None = None,
    *,
    wall_clock: Callable[[], float],
) -> Hint | None:
    """The server's hint from response headers (case-insensitive mapping) and body, or None."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        ms = parse_delay_seconds(raw_ms)
        if ms is not None:
            return Hint(ms / 1000.0, "retry-after-ms")
    raw = headers.get("retry-after")
    if raw is not None:
        seconds = parse_delay_seconds(raw)
        if seconds is not None:
            return Hint(seconds, "retry-after")
        seconds = parse_http_date(raw, now=wall_clock())
        if seconds is not None:
            return Hint(seconds, "retry-after-date")
    from_body = hint_from_body(body)
    if from_body is not None:
        return Hint(from_body, "body")
    return None
