"""What a server says is left of a client's rate limits, read from its response headers.

Three header families are read (the first one present wins, in this order):

- OpenAI (and the shim's tenant quotas): ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``,
  resets as Go-style durations (``1s``, ``6m0s``, ``20ms``, ``1m30.5s``).
- Anthropic: ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}``, resets as
  RFC 3339 timestamps. ``-tokens-`` is, per Anthropic, the most restrictive of its token
  limits, so the separate ``-input-tokens-``/``-output-tokens-`` ones add nothing here.
- IETF draft-ietf-httpapi-ratelimit-headers: ``RateLimit-Policy: "name";q=100;w=60`` with
  ``RateLimit: "name";r=50;t=30`` (drafts 08 and later; a policy whose ``qu`` unit or name
  mentions tokens counts LLM tokens, other units than requests are not followed), and the
  earlier ``RateLimit-Limit``/``RateLimit-Remaining``/``RateLimit-Reset`` fields or the
  combined ``RateLimit: limit=100, remaining=50, reset=30`` (requests).

Pure: no clock of its own (a wall-clock reading is passed in for RFC 3339 resets), no I/O.
A malformed value drops that limit and never raises: the caller's request must not fail
because a server wrote a header oddly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

Kind = Literal["requests", "tokens"]
#: Header look-up by lower-case name: ``headers.get`` of an httpx/httpx2 ``Headers`` fits.
Getter = Callable[[str], "str | None"]

_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-", "ratelimit")


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit as the server reported it on one response.

    ``remaining`` may still be used now; ``reset`` is the seconds until the limit is back to
    ``limit`` (None when not said); ``limit`` is the full allowance (None when not said).
    ``refills``: the allowance comes back steadily until the reset (OpenAI's and Anthropic's
    documented token buckets), rather than all at once at it (the IETF draft's quota window).
    """

    name: str
    kind: Kind
    remaining: float
    reset: float | None
    limit: float | None
    refills: bool = False


def mentions_limits(names: Iterable[str]) -> bool:
    """Whether any header name (lower case) belongs to the families read here: a cheap pre-check."""
    return any(name.startswith(_PREFIXES) for name in names)


_NUM = r"(\d+(?:\.\d+)?)"
_DURATION = re.compile(rf"(?:{_NUM}h)?(?:{_NUM}m(?!s))?(?:{_NUM}s)?(?:{_NUM}ms)?")


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if value >= 0 and math.isfinite(value) else None


def parse_duration(text: str | None) -> float | None:
    """Seconds of an OpenAI reset (``6m0s``, ``1m30.5s``, ``20ms``, or a bare number of seconds)."""
    if text is None:
        return None
    text = text.strip()
    plain = _number(text)
    if plain is not None:
        return plain
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        return None
    hours, minutes, seconds, millis = (float(g) if g else 0.0 for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds + millis / 1000


def parse_timestamp(text: str | None, wall_now: float) -> float | None:
    """Seconds from ``wall_now`` (Unix time) until an RFC 3339 timestamp (0 if it has passed)."""
    if text is None:
        return None
    text = text.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return max(0.0, moment.timestamp() - wall_now)


def _limit(
    name: str,
    kind: Kind,
    remaining: float | None,
    reset: float | None,
    limit: float | None,
    refills: bool = False,
) -> Limit | None:
    return None if remaining is None else Limit(name, kind, remaining, reset, limit, refills)


def _openai(get: Getter) -> list[Limit]:
    found = []
    for kind in ("requests", "tokens"):
        limit = _limit(
            kind,
            kind,
            _number(get(f"x-ratelimit-remaining-{kind}")),
            parse_duration(get(f"x-ratelimit-reset-{kind}")),
            _number(get(f"x-ratelimit-limit-{kind}")),
            refills=True,
        )
        if limit is not None:
            found.append(limit)
    return found


def _anthropic(get: Getter, wall_now: float) -> list[Limit]:
    found = []
    for kind in ("requests", "tokens"):
        limit = _limit(
            kind,
            kind,
            _number(get(f"anthropic-ratelimit-{kind}-remaining")),
            parse_timestamp(get(f"anthropic-ratelimit-{kind}-reset"), wall_now),
            _number(get(f"anthropic-ratelimit-{kind}-limit")),
            refills=True,
        )
        if limit is not None:
            found.append(limit)
    return found


def _items(text: str) -> dict[str, dict[str, str]]:
    """A structured-field list of ``"name";key=value;...`` items, by name (quotes stripped)."""
    items: dict[str, dict[str, str]] = {}
    for member in text.split(","):
        parts = [p.strip() for p in member.split(";")]
        if not parts[0]:
            continue
        params = {}
        for part in parts[1:]:
            key, sep, value = part.partition("=")
            if sep:
                params[key.strip().lower()] = value.strip().strip('"')
        items[parts[0].strip('"')] = params
    return items


def _ietf_kind(name: str, unit: str | None) -> Kind | None:
    if unit is None:
        return "tokens" if "token" in name.lower() else "requests"
    unit = unit.lower()
    if "token" in unit:
        return "tokens"
    return "requests" if unit == "requests" else None


def _ietf(get: Getter) -> list[Limit]:
    state = get("ratelimit")
    if state is not None and "remaining=" in state.lower():  # the combined field of early drafts
        fields = {k.strip().lower(): v for k, _, v in (p.partition("=") for p in state.split(","))}
        found = _limit(
            "default",
            "requests",
            _number(fields.get("remaining")),
            _number(fields.get("reset")),
            _number(fields.get("limit")),
        )
        return [] if found is None else [found]
    if state is None:  # drafts up to 07: one field per number; the limit may carry ";w=" parameters
        limit_text = get("ratelimit-limit")
        first_limit = None if limit_text is None else limit_text.split(",")[0].split(";")[0]
        found = _limit(
            "default",
            "requests",
            _number(get("ratelimit-remaining")),
            _number(get("ratelimit-reset")),
            _number(first_limit),
        )
        return [] if found is None else [found]
    policies = _items(get("ratelimit-policy") or "")
    limits = []
    for name, params in _items(state).items():
        policy = policies.get(name, {})
        kind = _ietf_kind(name, params.get("qu") or policy.get("qu"))
        limit = (
            None
            if kind is None
            else _limit(
                name, kind, _number(params.get("r")), _number(params.get("t")), _number(policy.get("q"))
            )
        )
        if limit is not None:
            limits.append(limit)
    return limits


def read_limits(get: Getter, wall_now: float) -> list[Limit]:
    """The limits a response states, from the first header family present; [] when none."""
    for found in (_openai(get), _anthropic(get, wall_now), _ietf(get)):
        if found:
            return found
    return []
