"""tenacity strategies with llm_backoff's behaviour, for people who already use tenacity.

``wait_retry_after(fallback)`` waits what the server asked for when the last
outcome carries a hint, and whatever ``fallback`` (any tenacity wait) says
otherwise. ``retry_if_retryable(policy)`` retries exactly what a wrapped client
would retry. Both are ordinary tenacity strategies, so they compose::

    @tenacity.retry(
        retry=retry_if_retryable(policy) | tenacity.retry_if_exception_type(MyError),
        wait=wait_retry_after(tenacity.wait_random_exponential(max=30)) + tenacity.wait_random(0, 0.2),
        stop=tenacity.stop_after_delay(60),
    )

An outcome "carries a hint" when it is (or raised) something with an HTTP response:
an ``openai.APIStatusError``, an ``httpx``/``httpx2`` ``HTTPStatusError``, or a
returned ``httpx``/``httpx2`` ``Response``. The hint is used as-is (add jitter with
``+``); a zero or negative hint ("now") falls back. Returned responses with a
retryable status are retried too, so ``tenacity`` can drive plain httpx calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from tenacity import RetryCallState
from tenacity.retry import retry_base
from tenacity.wait import wait_base

from .classify import Verdict, classify_exception, classify_status, parse_error_body
from .policy import RetryPolicy
from .retry_after import parse_hint


def _response_of(retry_state: RetryCallState) -> tuple[Any, BaseException | None] | None:
    """(response-like, exception) of the last outcome, or None when there is none."""
    outcome = retry_state.outcome
    if outcome is None:
        return None
    if outcome.failed:
        exc = outcome.exception()
        return getattr(exc, "response", None), exc
    return outcome.result(), None


def _body_of(response: Any, exc: BaseException | None) -> Mapping[str, object] | None:
    body = getattr(exc, "body", None)  # openai: the parsed `error` object, or the raw text
    if isinstance(body, (Mapping, str, bytes)):
        return parse_error_body(body)
    try:
        content = response.content  # raises when a streamed body was never read
    except Exception:
        return None
    return parse_error_body(content) if isinstance(content, bytes) else None


def _status_and_headers(response: Any) -> tuple[int, Mapping[str, str]] | None:
    status = getattr(response, "status_code", None)
    headers = getattr(response, "headers", None)
    if isinstance(status, int) and isinstance(headers, Mapping):
        return status, headers
    return None


def hint_of(retry_state: RetryCallState, wall_clock: Callable[[], float] = time.time) -> float | None:
    """The server's hint (seconds, >= 0) carried by the last outcome, or None."""
    found = _response_of(retry_state)
    if found is None:
        return None
    response, exc = found
    status_headers = _status_and_headers(response)
    if status_headers is None:
        return None
    hint = parse_hint(status_headers[1], _body_of(response, exc), wall_clock=wall_clock)
    return None if hint is None else hint.seconds


class wait_retry_after(wait_base):  # noqa: N801 - tenacity's naming
    """Wait the server's hint when the last outcome has a positive one, else ``fallback``."""

    def __init__(self, fallback: wait_base | Callable[[RetryCallState], float]) -> None:
        self.fallback = fallback

    def __call__(self, retry_state: RetryCallState) -> float:
        hint = hint_of(retry_state)
        if hint is not None and hint > 0 and math.isfinite(hint):
            return hint
        return float(self.fallback(retry_state))


class retry_if_retryable(retry_base):  # noqa: N801 - tenacity's naming
    """Retry what `RetryPolicy` classifies as retryable (status, hint cap, errors)."""

    def __init__(self, policy: RetryPolicy | None = None) -> None:
        self.policy = policy if policy is not None else RetryPolicy()

    def verdict(self, retry_state: RetryCallState) -> Verdict:
        found = _response_of(retry_state)
        if found is None:
            return Verdict(False, "no outcome yet")
        response, exc = found
        status_headers = _status_and_headers(response)
        if status_headers is None:
            if exc is None:
                return Verdict(False, "returned a value")
            return classify_exception(self.policy, exc)
        status, headers = status_headers
        body = _body_of(response, exc) if status >= 400 else None
        hint = parse_hint(headers, body, wall_clock=time.time) if status >= 400 else None
        seconds = None if hint is None else hint.seconds
        verdict = classify_status(self.policy, status, headers, body, hint=seconds)
        if verdict.retryable:
            if hint is None:
                return verdict
            if hint.seconds > self.policy.max_retry_after:
                return Verdict(False, f"server asked to wait {hint.seconds:g} s, above max_retry_after")
            latest = self.policy.max_retry_at
            # tenacity stamps start_time with time.monotonic (its default clock).
            if latest is not None and time.monotonic() - retry_state.start_time + hint.seconds > latest:
                return Verdict(
                    False,
                    f"server asked to wait {hint.seconds:g} s, which would begin the retry past max_retry_at",
                )
        return verdict

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.verdict(retry_state).retryable
