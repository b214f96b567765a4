"""What each attempt's request carries: timeouts cut to the deadline, the server's budget, the retry count.

The retry loop sends one ``Request`` again and again; these functions change it in place
between attempts. They read the call's `attempts.RetryState` (its clock) and touch nothing
but the request, so they are the same for sync and async calls:

- `stamp`, before each attempt: the request's connect/read/write/pool timeouts are cut to
  the time left to begin (a shorter timeout the caller set is kept) and the server is told
  that time in ``x-request-timeout-ms`` (>= 1), or the read timeout if that is shorter,
  since that is as long as we wait for the answer to begin. With a start deadline the budget
  ends when the answer begins, which ``x-request-timeout-scope: start`` says;
- `begun`, when an answer passed through unread has begun: its body reads answer to the
  call's deadline again, not to the start deadline;
- `mark_retry`, before each retry: ``x-stainless-retry-count`` counts it.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Protocol

from ._reach import set_header
from .attempts import RetryState

__all__ = ["RETRY_COUNT_HEADER", "AttemptRequest", "begun", "mark_retry", "stamp"]

#: The openai SDKs number their attempts in this header (0 on the first); see `mark_retry`.
RETRY_COUNT_HEADER = "x-stainless-retry-count"

_TIMEOUT_KEYS = ("connect", "read", "write", "pool")


class AttemptRequest(Protocol):
    """What the retry loop needs of an httpx/httpx2 ``Request``."""

    method: str
    headers: MutableMapping[str, str]
    extensions: dict[str, Any]

    @property
    def url(self) -> object: ...

    @property
    def content(self) -> bytes: ...


def stamp(request: AttemptRequest, state: RetryState, base_timeout: Any) -> float | None:
    """Cut the timeouts to the time left to begin and send it; returns it (None without a deadline).

    ``base_timeout`` is the request's own ``timeout`` extension as the caller's client set
    it, before any attempt cut it.
    """
    left = state.time_to_start()
    if left is None:
        return None
    left = max(left, 0.001)
    if isinstance(base_timeout, dict):
        cut = {}
        for key, value in base_timeout.items():  # a plain loop: a comprehension is a function call
            cut[key] = left if value is None or value > left else value
    else:
        cut = dict.fromkeys(_TIMEOUT_KEYS, left)
    # httpx/httpx2 give every Request its own extensions dict: updating it is safe.
    request.extensions["timeout"] = cut
    # We stop waiting for the first byte after the read timeout: promising the server
    # more patience than that would let it queue work nobody will collect.
    patience = min(left, cut.get("read") or left)
    set_header(request.headers, "x-request-timeout-ms", str(max(1, int(patience * 1000))))
    if state.start_bound:
        # The budget ends when the answer begins: the shim then counts only the time to a
        # stream's first token against it, not the whole answer.
        set_header(request.headers, "x-request-timeout-scope", "start")
    return left


def begun(request: AttemptRequest, state: RetryState, base_timeout: Any) -> None:
    """An answer passed through unread has begun: its body reads now answer to the deadline.

    `stamp` cut the read timeout to the start deadline, which must not cut a stream
    that has started. httpx and httpx2 hand our ``timeout`` dict to their connection,
    which looks up the read timeout when the body is first read, after we return.
    """
    cut = request.extensions.get("timeout")
    if not isinstance(cut, dict):
        return
    read = base_timeout.get("read") if isinstance(base_timeout, dict) else None
    left = state.time_left()
    if left is not None:
        left = max(left, 0.001)
        read = left if read is None or read > left else read
    cut["read"] = read


def mark_retry(request: AttemptRequest) -> None:
    """Before each retry: count it in ``x-stainless-retry-count``, as openai's own retries do.

    openai stamps the header with its retry number (0 on a first attempt, and always 0
    under `wrap`, which switches openai's retries off); each of our retries adds one,
    so attempts send 0, 1, 2, ... and a server can tell a returning caller from a new
    one. A request without the header (not from openai, or the caller omitted it)
    is left without it; a value that is not a number restarts the count at 1.
    """
    current = request.headers.get(RETRY_COUNT_HEADER)
    if current is None:
        return
    try:
        count = int(current) + 1
    except ValueError:
        count = 1
    request.headers[RETRY_COUNT_HEADER] = str(max(count, 1))
