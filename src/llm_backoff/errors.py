"""Typed errors raised by llm_backoff itself.

Failures of the remote call are never wrapped: when retrying ends, the original
exception type is raised (``openai.RateLimitError`` stays ``openai.RateLimitError``)
and carries the attempt history as ``exc.llm_backoff_attempts``. The classes here
cover what llm_backoff adds on top: waiting for a client-side limit that cannot be
granted in time, and misuse of the wrapper.
"""

from __future__ import annotations


class LLMBackoffError(Exception):
    """Base class of the errors llm_backoff raises on its own account."""


class RateLimitTimeout(TimeoutError):  # noqa: N818 - the name is public API
    """A client-side limit (token bucket, limiter) could not grant the call in time.

    A ``TimeoutError`` so that generic timeout handling catches it; raised instead of
    sleeping past the caller's deadline.
    """


class UnsupportedClientError(LLMBackoffError, TypeError):
    """``wrap()`` was given something it cannot wrap (not an openai client, or an
    http client without the httpx transport layering)."""
