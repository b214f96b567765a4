"""`wrap()`: an openai client whose every HTTP request goes through a `RetryPolicy`.

How the returned client is built, and why this way:

- The seam is the HTTP transport (see `transport`). The caller's httpx/httpx2
  client is shallow-copied and only its transport and proxy mounts are replaced
  by retry transports around the originals. Everything else the caller configured
  on it (timeouts, limits, headers, auth, event hooks, proxies, TLS, base_url,
  cookies) is kept exactly, because it is the same configuration and the same
  connection pool, not a re-creation from guessed constructor arguments (httpx
  keeps TLS, proxy and pool settings inside the transport, where they cannot be
  read back). Headers and event-hook lists are copied so that later edits on one
  client do not leak into the other; the cookie jar is shared, as a session would be.
- The openai client is then re-created with the SDK's own ``copy(http_client=...,
  max_retries=0)``, so base_url, api_key (or key provider), organization, default
  headers/query and timeouts are carried over by openai itself, the result is of
  the very same class (``type(wrapped) is type(client)``), and the SDK's own retry
  loop is off, so attempts never multiply. The given client is not modified.
- Ownership: the wrapped client shares the given client's connection pool and
  keeps a reference to the given http client, so that its finaliser cannot close
  the pool under us. Closing the wrapped client closes the pooled connections only
  when openai created that http client itself (the usual ``wrap(OpenAI(...))``
  case; the pool reopens connections on demand, so the given client stays usable,
  and nothing lingers until garbage collection); an http client the caller passed
  in belongs to the caller and is never closed by the wrapped client.
- Attempt history on errors: the transport leaves the history on the response
  (``response.extensions["llm_backoff.attempts"]``) or on the transport exception;
  openai then raises its own exception (``RateLimitError``, ``APITimeoutError``...)
  from those. The returned client's ``request`` method, which every resource,
  paginator and streaming helper calls, is wrapped on the instance only (no
  subclass, no patching of openai) to copy that history onto the openai exception
  as ``exc.llm_backoff_attempts`` plus an exception note. ``copy``/``with_options``
  on the returned client are wrapped the same way, so derived clients keep this
  (and inherit ``max_retries=0``; a caller who sets ``max_retries`` again on a
  derived client gets openai's retries on top, each one a fresh llm_backoff call
  with its own deadline).
- A limiter's `RateLimitTimeout` reaches the caller as itself: openai 2.x turns
  any exception from its http client into ``APIConnectionError``, so the hook
  unwraps that one case.
- Wrapping a wrapped client replaces the policy instead of nesting retries.
"""

from __future__ import annotations

import copy as _copy
import functools
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

import openai

from .attempts import ATTRIBUTE, EXTENSION_KEY
from .errors import RateLimitTimeout, UnsupportedClientError
from .events import CallObservers, RetryHook, RetryObservers
from .limits import CallLimiter, RetryBudgetLike
from .policy import RetryPolicy
from .stats import ClientStats
from .transport import CALL_STARTED, REASON_KEY, RetryEngine, annotate

ClientT = TypeVar("ClientT", openai.OpenAI, openai.AsyncOpenAI)

_ORIGIN_ATTR = "_llm_backoff_origin"


def wrap(
    client: ClientT,
    policy: RetryPolicy | None = None,
    *,
    on_retry: RetryObservers | RetryHook | Iterable[RetryHook] | None = None,
    request_class: str | None = None,
    limiter: CallLimiter | None = None,
    budget: RetryBudgetLike | None = None,
) -> ClientT:
    """A copy of ``client`` (same class) whose requests are retried under ``policy``.

    ``on_retry`` is called with a `RetryEvent` before each retry's wait (one hook or
    several); ``request_class`` is sent as ``x-request-class`` (e.g. ``"batch"``)
    unless a request sets that header itself; ``limiter`` and ``budget`` are shared
    objects implementing `llm_backoff.limits.CallLimiter` and ``RetryBudgetLike``.
    """
    if not isinstance(client, (openai.OpenAI, openai.AsyncOpenAI)):
        raise UnsupportedClientError(
            f"wrap() takes an openai.OpenAI or openai.AsyncOpenAI client, got {type(client).__name__}"
        )
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise TypeError(f"policy must be a llm_backoff.RetryPolicy, got {type(policy).__name__}")
    engine = RetryEngine(
        policy, on_retry=on_retry, request_class=request_class, limiter=limiter, budget=budget
    )
    is_async = isinstance(client, openai.AsyncOpenAI)
    http_client = retrying_http_client(client._client, engine, is_async=is_async)
    wrapped = client.copy(http_client=http_client, max_retries=0)
    _install_request_hook(wrapped, engine.clock)
    return wrapped


def retry_observers(client: openai.OpenAI | openai.AsyncOpenAI) -> RetryObservers:
    """The hook list of a wrapped client, to subscribe a stats collector after the fact."""
    return _engine_of(client).observers


def client_stats(client: openai.OpenAI | openai.AsyncOpenAI) -> ClientStats:
    """The live counters of a wrapped client (shared with its ``copy()``/``with_options()`` clients)."""
    return _engine_of(client).stats


def call_observers(client: openai.OpenAI | openai.AsyncOpenAI) -> CallObservers:
    """The `CallObserver` list of a wrapped client (``llm_backoff.otel.instrument`` subscribes here)."""
    return _engine_of(client).watchers


def _engine_of(client: object) -> RetryEngine:
    engine = _engine_or_none(client)
    if engine is None:
        raise UnsupportedClientError("this client was not made by llm_backoff.wrap()")
    return engine


def _engine_or_none(client: object) -> RetryEngine | None:
    transport = getattr(getattr(client, "_client", None), "_transport", None)
    engine = getattr(transport, "engine", None)
    return engine if isinstance(engine, RetryEngine) else None


def _retry_transport_class(http_client: object, *, is_async: bool) -> type[Any]:
    """The retry transport class for the library (httpx2 or httpx) ``http_client`` comes from."""
    httpx2 = sys.modules.get("httpx2")
    if httpx2 is not None and isinstance(http_client, httpx2.AsyncClient if is_async else httpx2.Client):
        from . import _httpx2_transport as v2

        return v2.AsyncHttpx2RetryTransport if is_async else v2.Httpx2RetryTransport
    httpx = sys.modules.get("httpx")
    if httpx is not None and isinstance(http_client, httpx.AsyncClient if is_async else httpx.Client):
        from . import _httpx_transport as v1

        return v1.AsyncHttpxRetryTransport if is_async else v1.HttpxRetryTransport
    kind = "AsyncClient" if is_async else "Client"
    raise UnsupportedClientError(
        f"the openai client's http_client is a {type(http_client).__name__}, expected an httpx2.{kind} "
        f"or httpx.{kind}"
    )


def retrying_http_client(http_client: Any, engine: RetryEngine, *, is_async: bool) -> Any:
    """A shallow copy of an httpx/httpx2 client whose transports retry under ``engine``."""
    retry_cls = _retry_transport_class(http_client, is_async=is_async)
    if not hasattr(http_client, "_transport") or not hasattr(http_client, "_mounts"):
        raise UnsupportedClientError(
            f"{type(http_client).__name__} does not have the httpx transport layering (_transport, _mounts)"
        )
    if http_client.is_closed:
        raise UnsupportedClientError("the openai client's http client is closed")

    owns_pool = _made_by_openai(http_client)

    def retrying(transport: Any) -> Any:
        inner = getattr(transport, "inner", transport) if _is_retry_transport(transport) else transport
        return retry_cls(inner, engine=engine, owns_inner=owns_pool)

    new = _copy.copy(http_client)
    new.headers = http_client.headers  # the setter builds a fresh Headers
    new._event_hooks = {event: list(hooks) for event, hooks in http_client._event_hooks.items()}
    new._transport = retrying(http_client._transport)
    new._mounts = {
        pattern: None if transport is None else retrying(transport)
        for pattern, transport in http_client._mounts.items()
    }
    # Keep the pool's owner alive as long as we use its pool (its __del__ may close it).
    setattr(new, _ORIGIN_ATTR, getattr(http_client, _ORIGIN_ATTR, http_client))
    return new


def _made_by_openai(http_client: object) -> bool:
    """True for the http client openai builds itself when the caller passes none.

    Closing the wrapped client then closes the pooled connections too, as closing an
    unwrapped openai client would: otherwise they would linger until garbage
    collection (for async clients, possibly on another event loop). The given client
    stays usable: httpcore pools open new connections on demand after ``close()``.
    A caller's own http client is never closed by us; its owner closes it.
    """
    from openai import _base_client

    wrappers = tuple(
        cls
        for cls in (
            getattr(_base_client, "SyncHttpxClientWrapper", None),
            getattr(_base_client, "AsyncHttpxClientWrapper", None),
        )
        if isinstance(cls, type)
    )
    return isinstance(http_client, wrappers)


def _is_retry_transport(transport: object) -> bool:
    return isinstance(getattr(transport, "engine", None), RetryEngine) and hasattr(transport, "inner")


def _history_of(exc: BaseException) -> tuple[tuple[Any, ...], str | None] | None:
    response = getattr(exc, "response", None)
    extensions = getattr(response, "extensions", None)
    if isinstance(extensions, dict) and EXTENSION_KEY in extensions:
        return extensions[EXTENSION_KEY], extensions.get(REASON_KEY)
    seen: set[int] = set()
    cause: BaseException | None = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        attempts = getattr(cause, ATTRIBUTE, None)
        if attempts is not None:
            return attempts, getattr(cause, "_llm_backoff_reason", None)
        cause = cause.__cause__ or cause.__context__
    return None


def annotate_openai_error(exc: BaseException) -> None:
    """Copy the attempt history onto an exception raised by the openai client, if we have one."""
    if getattr(exc, ATTRIBUTE, None) is not None:
        return
    found = _history_of(exc)
    if found is not None:
        annotate(exc, *found)


def _own_timeout(exc: BaseException) -> RateLimitTimeout | None:
    """Our `RateLimitTimeout` when openai wrapped it (2.x turns any exception into APIConnectionError)."""
    cause = exc.__cause__
    if isinstance(exc, openai.APIConnectionError) and isinstance(cause, RateLimitTimeout):
        return cause
    return None


def _annotating_iter(items: Iterator[Any]) -> Iterator[Any]:
    """An openai ``Stream``'s items; an error mid-stream gets the history (openai 3.x wraps it)."""
    try:
        yield from items
    except Exception as exc:
        annotate_openai_error(exc)
        raise


async def _annotating_aiter(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        async for item in items:
            yield item
    except Exception as exc:
        annotate_openai_error(exc)
        raise


def _install_request_hook(
    client: openai.OpenAI | openai.AsyncOpenAI, clock: Callable[[], float] | None
) -> None:
    """Wrap ``client.request``: attempt history onto errors, and the mark of when the call began.

    ``clock`` is the retry engine's (None when the client has no retry transport).
    """
    request = client.request
    hooked: Callable[..., Any]
    if isinstance(client, openai.AsyncOpenAI):

        @functools.wraps(request)
        async def hooked(*args: Any, **kwargs: Any) -> Any:
            mark = CALL_STARTED.set(clock()) if clock is not None else None
            try:
                result = await request(*args, **kwargs)
            except BaseException as exc:
                own = _own_timeout(exc)
                if own is not None:
                    raise own from None
                annotate_openai_error(exc)
                raise
            finally:
                if mark is not None:
                    CALL_STARTED.reset(mark)
            # A private attribute of openai's stream: guarded, so a renamed one only loses the note.
            if isinstance(result, openai.AsyncStream) and hasattr(result, "_iterator"):
                result._iterator = _annotating_aiter(result._iterator)
            return result

    else:

        @functools.wraps(request)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            mark = CALL_STARTED.set(clock()) if clock is not None else None
            try:
                result = request(*args, **kwargs)
            except BaseException as exc:
                own = _own_timeout(exc)
                if own is not None:
                    raise own from None
                annotate_openai_error(exc)
                raise
            finally:
                if mark is not None:
                    CALL_STARTED.reset(mark)
            # A private attribute of openai's stream: guarded, so a renamed one only loses the note.
            if isinstance(result, openai.Stream) and hasattr(result, "_iterator"):
                result._iterator = _annotating_iter(result._iterator)
            return result

    original_copy = client.copy

    @functools.wraps(original_copy)
    def copy(*args: Any, **kwargs: Any) -> Any:
        derived = original_copy(*args, **kwargs)
        engine = _engine_or_none(derived)
        _install_request_hook(derived, engine.clock if engine is not None else None)
        return derived

    # Instance attributes shadow the class's methods for this one client only.
    vars(client).update(request=hooked, copy=copy, with_options=copy)
