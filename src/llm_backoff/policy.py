"""`RetryPolicy`: the few knobs that decide how a call is retried.

A frozen pydantic model so that one policy can be shared by many clients, threads
and tasks, hashed, and logged. Invalid values are rejected at construction with a
message naming the field. Unknown fields are rejected too, so a typo fails loudly
instead of being ignored, and the error names the field that was probably meant:
the names other retry libraries use (``max_retries``, ``timeout``, ``backoff_factor``...)
map to their counterpart here (`LIKELY_MEANT`), anything else gets the closest field
names (``difflib``). The error is pydantic's ``ValidationError`` (a ``ValueError``) of
type ``extra_forbidden``, as for any unknown field.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

Jitter = Literal["full", "equal", "decorrelated", "none"]

#: Statuses that no setting makes retryable: the same request cannot succeed later.
NEVER_RETRY_STATUSES: frozenset[int] = frozenset({400, 401, 403, 404, 422})

#: 529 is Anthropic's "overloaded" (``overloaded_error``), which its own SDK retries.
DEFAULT_RETRY_STATUSES: frozenset[int] = frozenset({408, 429, 500, 502, 503, 504, 529})

#: `RetryPolicy.interactive`'s start deadline: seconds for the answer to begin.
INTERACTIVE_START_DEADLINE = 5.0
#: `RetryPolicy.interactive`'s deadline for the whole call (a stream that began runs on under it).
INTERACTIVE_DEADLINE = 60.0
#: `RetryPolicy.interactive`'s longest hint waited out, and the latest moment a hinted retry
#: may begin, as a share of its start deadline: a retry begun later is refused about as often
#: as it is served, and then fails seconds late instead of at once (docs/sdk.md,
#: "Interactive and batch callers").
INTERACTIVE_HINT_SHARE = 0.4
#: `RetryPolicy.batch`'s deadline for the whole call; batch has no start deadline.
BATCH_DEADLINE = 600.0

#: `RetryPolicy.max_connect_errors` by default: attempts in a row that could not connect before
#: giving up. A server that refuses connections is down or the URL is wrong, and neither gets
#: better in the seconds a caller waits; an overloaded server answers (429/503) and is waited
#: out under the deadline. 3 is openai's own default (max_retries=2), so a dead server fails
#: as fast wrapped as unwrapped (docs/sdk.md, "A server that is down"). An answer saying the
#: server's own upstream cannot be reached (the shim's 503 ``upstream_unavailable``, a
#: gateway's 502/504 without a hint) counts too: a dead engine behind a shim is a dead server.
DEFAULT_MAX_CONNECT_ERRORS = 3

#: Field names of other retry libraries (openai, urllib3, tenacity, backoff...) and what they are here.
LIKELY_MEANT: dict[str, str] = {
    "max_retries": "max_attempts (attempts include the first: max_retries=N is max_attempts=N+1)",
    "retries": "max_attempts (attempts include the first: retries=N is max_attempts=N+1)",
    "max_tries": "max_attempts (attempts include the first)",
    "stop_after_attempt": "max_attempts (attempts include the first)",
    "timeout": "deadline (seconds for the whole call, waits included)",
    "total_timeout": "deadline (seconds for the whole call, waits included)",
    "max_time": "deadline (seconds for the whole call, waits included)",
    "stop_after_delay": "deadline (seconds for the whole call, waits included)",
    "backoff_factor": "base_delay (the first computed backoff, doubling per retry)",
    "initial_delay": "base_delay (the first computed backoff, doubling per retry)",
    "min_delay": "base_delay (the first computed backoff, doubling per retry)",
    "max_backoff": "max_delay (the cap on a computed backoff)",
    "backoff_max": "max_delay (the cap on a computed backoff)",
    "status_forcelist": "retry_statuses",
    "retry_on_status": "retry_statuses",
}


class RetryPolicy(BaseModel):
    """How one logical call is retried.

    The deadline, not the attempt count, is what normally ends retrying:
    ``max_attempts`` (first attempt included) is a backstop for servers that
    fail fast forever.

    ``start_deadline`` is for callers with a time-to-first-token budget (a chat user waiting for
    the reply to start): no retry waits past it, the server is told only what is left of it
    (``x-request-timeout-ms`` with ``x-request-timeout-scope: start``, so the shim refuses
    at once a request that cannot start in time), and an attempt still waiting for its
    answer's head when it passes is cut. An answer that has begun is not cut by it: a stream
    then runs on under ``deadline``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _check_names(cls, data: Any) -> Any:
        """Refuse unknown fields, naming the field probably meant (see the module's docstring)."""
        if not isinstance(data, dict):
            return data
        unknown = [name for name in data if name not in cls.model_fields]
        if unknown:
            raise PydanticCustomError(
                "extra_forbidden", "; ".join(_unknown_field(cls.__name__, str(name)) for name in unknown)
            )
        return data

    max_attempts: StrictInt = Field(default=10, ge=1, description="total attempts, the first one included")
    deadline: float | None = Field(
        default=60.0, gt=0, allow_inf_nan=False, description="seconds for the whole call, waits included"
    )
    start_deadline: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "seconds from the call until the answer must begin (its status and headers), waits "
            "included; a stream that has begun runs on under `deadline`"
        ),
    )
    base_delay: float = Field(default=0.5, ge=0, allow_inf_nan=False)
    max_delay: float = Field(default=30.0, ge=0, allow_inf_nan=False)
    jitter: Jitter = "full"
    max_retry_after: float = Field(
        default=120.0,
        ge=0,
        allow_inf_nan=False,
        description="a server hint above this many seconds means: do not retry, raise now",
    )
    max_retry_at: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "a server hint that would begin the retry later than this many seconds after the call "
            "started means: do not retry, raise now (None: no such limit)"
        ),
    )
    retry_after_jitter: float = Field(
        default=0.2,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="random extra wait of up to this fraction of a server hint",
    )
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES
    retry_connection_errors: StrictBool = True
    retry_timeouts: StrictBool = True
    max_connect_errors: StrictInt | None = Field(
        default=DEFAULT_MAX_CONNECT_ERRORS,
        ge=1,
        description=(
            "attempts in a row that could not connect at all (refused, unreachable, DNS, TLS "
            "handshake, connect timeout) or were answered that the server's upstream cannot be "
            "reached (503 upstream_unavailable, a 502/504 without a hint), the first included, "
            "after which the call gives up; None: only max_attempts and the deadlines bound them"
        ),
    )
    continue_cut_streams: StrictBool = Field(
        default=False,
        description=(
            "a streamed generation cut after its first content is asked again to continue from the "
            "text received, and the caller's stream goes on as one (for idempotent generations: "
            "docs/sdk.md, 'A stream cut after content')"
        ),
    )
    last_chance: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description=(
            "with a start deadline: a hint that would begin the retry past it, but by at most this "
            "fraction of the start deadline, still gets one last attempt just before it; only with "
            "a start_deadline (without one, a value above 0 is refused: it could never apply)"
        ),
    )

    @classmethod
    def interactive(cls, start_deadline: float = INTERACTIVE_START_DEADLINE, **fields: Any) -> RetryPolicy:
        """For a caller with a time-to-first-token budget: begin within ``start_deadline`` or fail fast.

        A server's hint is waited out only while the retry it asks for begins within
        `INTERACTIVE_HINT_SHARE` of the start deadline (``max_retry_after`` and
        ``max_retry_at``; 2 s of 5 s): a longer hint, or one that a caller already turned
        away once would wait out past that moment, fails the call at once, while the user
        still waits and the application can degrade. ``max_retry_at`` follows a
        ``max_retry_after`` given here, and is off with a ``last_chance`` (whose retry begins
        just before the start deadline), unless it is given too. Backoffs without a hint (a
        connection error, a 503 without Retry-After) stay short (``max_delay`` 2 s) and within
        the start deadline (their jitter trimmed to fit). No last chance past the start
        deadline. Any other field may be given too.
        """
        hint_limit = fields.get("max_retry_after", INTERACTIVE_HINT_SHARE * start_deadline)
        values: dict[str, Any] = {
            "deadline": max(INTERACTIVE_DEADLINE, start_deadline),
            "start_deadline": start_deadline,
            "max_retry_after": hint_limit,
            "max_retry_at": (
                hint_limit
                if isinstance(hint_limit, int | float) and hint_limit > 0 and not fields.get("last_chance")
                else None
            ),
            "base_delay": 0.25,
            "max_delay": 2.0,
        }
        values.update(fields)
        return cls(**values)

    @classmethod
    def batch(cls, deadline: float | None = BATCH_DEADLINE, **fields: Any) -> RetryPolicy:
        """For work nobody watches: patience (a long ``deadline``, no start deadline, long hints waited).

        Connection failures are not capped apart (``max_connect_errors=None``): a batch job
        rides out a server restart (a model server reloading its weights refuses connections
        for a minute or more; a shim in front of it answers 503 ``upstream_unavailable``, whose
        hints are then waited out) within its deadline, at the price of a wrong URL failing each
        call only when the deadline passes (about 9 minutes; docs/sdk.md, "A server that is down").
        """
        values: dict[str, Any] = {
            "deadline": deadline,
            "max_attempts": 50,
            "max_delay": 60.0,
            "max_retry_after": 600.0,
            "max_connect_errors": None,
        }
        values.update(fields)
        return cls(**values)

    @field_validator("retry_statuses")
    @classmethod
    def _check_statuses(cls, value: frozenset[int]) -> frozenset[int]:
        bad = sorted(s for s in value if not 400 <= s <= 599)
        if bad:
            raise ValueError(f"retry_statuses must be HTTP error statuses (400-599), got {bad}")
        never = sorted(value & NEVER_RETRY_STATUSES)
        if never:
            raise ValueError(
                f"retry_statuses may not contain {never}: "
                f"{sorted(NEVER_RETRY_STATUSES)} are never retried (the request itself is wrong)"
            )
        return value

    @model_validator(mode="after")
    def _check_delays(self) -> RetryPolicy:
        if self.max_delay < self.base_delay:
            raise ValueError(f"max_delay ({self.max_delay}) must be >= base_delay ({self.base_delay})")
        if self.last_chance > 0 and self.start_deadline is None:
            raise ValueError(
                f"last_chance ({self.last_chance:g}) needs a start_deadline: it is one last attempt just "
                "before the start deadline, and without one it could never apply"
            )
        start, whole = self.start_deadline, self.deadline
        if start is not None and whole is not None and start > whole:
            raise ValueError(
                f"start_deadline ({self.start_deadline:g}) must be <= deadline ({self.deadline:g}): "
                "the answer cannot be allowed to begin after the whole call has ended"
            )
        return self


def _unknown_field(model: str, name: str) -> str:
    meant = LIKELY_MEANT.get(name.lower())
    if meant is not None:
        return f"{model} has no {name}; did you mean {meant}?"
    fields = list(RetryPolicy.model_fields)
    close = difflib.get_close_matches(name.lower(), fields, n=2, cutoff=0.6)
    if close:
        return f"{model} has no {name}; did you mean {' or '.join(close)}?"
    return f"{model} has no {name}; its fields are {', '.join(fields)}"


_CLASS_PRESETS = {"interactive": RetryPolicy.interactive, "batch": RetryPolicy.batch}


def default_policy(request_class: str | None) -> RetryPolicy:
    """The policy a client gets without one: the class's preset for ``interactive``/``batch``."""
    preset = _CLASS_PRESETS.get(request_class or "")
    return preset() if preset is not None else RetryPolicy()


def check_request_class(request_class: object) -> None:
    """Refuse a ``request_class`` that cannot be sent as the ``x-request-class`` header."""
    if request_class is None:
        return
    if not isinstance(request_class, str):
        raise TypeError(
            "request_class must be a str such as 'interactive' or 'batch' (or None), "
            f"got {type(request_class).__name__}"
        )
    if not request_class or not request_class.isascii() or not request_class.isprintable():
        raise ValueError(
            "request_class must be a non-empty printable ASCII header value such as 'interactive' "
            f"or 'batch', got {request_class!r}"
        )
