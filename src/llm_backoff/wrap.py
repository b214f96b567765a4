"""`wrap()`: an openai (or anthropic) client whose every HTTP request goes through a `RetryPolicy`.

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
- Credential providers and ``request`` event hooks, which the SDK's own retries run
  again per attempt, run again before each of ours (`refresh`).
- An ``anthropic.Anthropic``/``AsyncAnthropic`` is built by the same generated base
  client as openai's (``_client``, ``copy(http_client=, max_retries=0)``, ``request``,
  streams), so it is wrapped the same way; its exceptions stay anthropic's.
- Every reach into a private attribute of the SDKs or httpx/httpx2 is in `_reach`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from . import _reach
from .attempt_core import CALL_STARTED
from .attempts import ATTRIBUTE, EXTENSION_KEY, REASON_KEY, annotate
from .engine import RetryEngine
from .errors import RateLimitTimeout, UnsupportedClientError
from .events import CallObservers, RetryHook, RetryObservers
from .limits import CallLimiter, RetryBudgetLike
from .policy import RetryPolicy, check_request_class
from .refresh import close_call, has_recorders, install_recorders, open_call
from .stats import ClientStats

#: An ``openai.OpenAI``/``AsyncOpenAI`` (Azure's too) or an ``anthropic.Anthropic``/``AsyncAnthropic``.
ClientT = TypeVar("ClientT")

_ORIGIN_ATTR = "_llm_backoff_origin"


@dataclass(frozen=True, slots=True)
class _Sdk:
    """The classes of one SDK that `wrap` needs to know."""

    name: str
    client: type[Any]
    async_client: type[Any]
    stream: type[Any] | None
    async_stream: type[Any] | None
    connection_error: type[BaseException] | None


#: (package, sync client, async client): the SDKs `wrap` takes.
_SDKS = (("openai", "OpenAI", "AsyncOpenAI"), ("anthropic", "Anthropic", "AsyncAnthropic"))


def _sdk_of(client: object) -> tuple[_Sdk, bool] | None:
    """The SDK ``client`` comes from and whether it is async; None when it is none of them.

    Looked up in ``sys.modules``: a client of a package that was never imported cannot exist.
    """
    for package, sync_name, async_name in _SDKS:
        module = sys.modules.get(package)
        if module is None:
            continue
        sync_cls, async_cls = getattr(module, sync_name, None), getattr(module, async_name, None)
        for cls, is_async in ((sync_cls, False), (async_cls, True)):
            if isinstance(cls, type) and isinstance(client, cls):
                assert isinstance(sync_cls, type)
                assert isinstance(async_cls, type)
                sdk = _Sdk(
                    package,
                    sync_cls,
                    async_cls,
                    getattr(module, "Stream", None),
                    getattr(module, "AsyncStream", None),
                    getattr(module, "APIConnectionError", None),
                )
                return sdk, is_async
    return None


def _check_arguments(
    policy: object, on_retry: object, request_class: object, limiter: object, budget: object
) -> None:
    """Refuse, naming the argument and what it takes, anything `wrap` could only fail on later."""
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise TypeError(
            "policy must be a llm_backoff.RetryPolicy (or None for the defaults), "
            f"got {type(policy).__name__}"
        )
    if on_retry is not None and not isinstance(on_retry, RetryObservers) and not callable(on_retry):
        if isinstance(on_retry, (str, bytes)) or not isinstance(on_retry, Iterable):
            raise TypeError(
                "on_retry must be a callable taking a RetryEvent, an iterable of them, or a "
                f"RetryObservers, got {type(on_retry).__name__}"
            )
        bad = [type(hook).__name__ for hook in list(on_retry) if not callable(hook)]
        if bad:
            raise TypeError(f"on_retry must hold only callables taking a RetryEvent, got {', '.join(bad)}")
    check_request_class(request_class)
    if limiter is not None and not isinstance(limiter, CallLimiter):
        raise TypeError(
            "limiter must implement llm_backoff.limits.CallLimiter (acquire_for and acquire_for_async), "
            f"e.g. a llm_backoff.RateLimiter, got {type(limiter).__name__}"
        )
    if budget is not None and not isinstance(budget, RetryBudgetLike):
        raise TypeError(
            "budget must implement record_request() and try_spend(), e.g. a llm_backoff.RetryBudget, "
            f"got {type(budget).__name__}"
        )


def wrap(
    client: ClientT,
    policy: RetryPolicy | None = None,
    *,
    on_retry: RetryObservers | RetryHook | Iterable[RetryHook] | None = None,
    request_class: str | None = None,
    limiter: CallLimiter | None = None,
    budget: RetryBudgetLike | None = None,
    follow_rate_headers: bool = True,
) -> ClientT:
    """A copy of ``client`` (same class) whose requests are retried under ``policy``.

    ``client`` is an ``openai.OpenAI``/``AsyncOpenAI`` (Azure's too) or an
    ``anthropic.Anthropic``/``AsyncAnthropic``. Without a ``policy``, a
    ``request_class`` of ``"interactive"`` or ``"batch"`` picks `RetryPolicy.interactive`
    or `RetryPolicy.batch`, any other the plain `RetryPolicy`. ``on_retry`` is called
    with a `RetryEvent` before each retry's wait (one hook or several);
    ``request_class`` is sent as ``x-request-class`` unless a request sets that header
    itself; ``limiter`` and ``budget`` are shared objects implementing
    `llm_backoff.limits.CallLimiter` and ``RetryBudgetLike``. ``follow_rate_headers``
    (on by default) holds each send until the budget the server last stated in its
    rate-limit headers allows it (`llm_backoff.pacing`), alongside ``limiter``.
    """
    found = _sdk_of(client)
    if found is None:
        raise UnsupportedClientError(
            "wrap() takes an openai.OpenAI / openai.AsyncOpenAI or an anthropic.Anthropic / "
            f"anthropic.AsyncAnthropic client, got {type(client).__name__}"
        )
    sdk, is_async = found
    _check_arguments(policy, on_retry, request_class, limiter, budget)
    follow: object = follow_rate_headers
    if not isinstance(follow, bool):
        kind = type(follow).__name__
        raise TypeError(f"follow_rate_headers must be True or False, got {kind}")
    engine = RetryEngine(
        policy,
        on_retry=on_retry,
        request_class=request_class,
        limiter=limiter,
        budget=budget,
        follow_rate_headers=follow_rate_headers,
    )
    http_client = retrying_http_client(_reach.http_client_of(client), engine, is_async=is_async)
    wrapped: ClientT = client.copy(http_client=http_client, max_retries=0)  # type: ignore[attr-defined]
    install_recorders(wrapped)
    _install_request_hook(wrapped, engine.clock, sdk)
    return wrapped


def retry_observers(client: object) -> RetryObservers:
    """The hook list of a wrapped client, to subscribe a stats collector after the fact."""
    return _engine_of(client).observers


def client_stats(client: object) -> ClientStats:
    """The live counters of a wrapped client (shared with its ``copy()``/``with_options()`` clients)."""
    return _engine_of(client).stats


def call_observers(client: object) -> CallObservers:
    """The `CallObserver` list of a wrapped client (``llm_backoff.otel.instrument`` subscribes here)."""
    return _engine_of(client).watchers


def _engine_of(client: object) -> RetryEngine:
    engine = _engine_or_none(client)
    if engine is None:
        raise UnsupportedClientError("this client was not made by llm_backoff.wrap()")
    return engine


def _engine_or_none(client: object) -> RetryEngine | None:
    engine = getattr(_reach.transport_of(client), "engine", None)
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
        f"the client's http_client is a {type(http_client).__name__}, expected an httpx2.{kind} "
        f"or httpx.{kind}"
    )


def retrying_http_client(http_client: Any, engine: RetryEngine, *, is_async: bool) -> Any:
    """A shallow copy of an httpx/httpx2 client whose transports retry under ``engine``.

    Closing it closes the pooled connections only when the SDK built ``http_client``
    itself (the usual ``wrap(OpenAI(...))``): otherwise they would linger until garbage
    collection (for async clients, possibly on another event loop). The given client
    stays usable: httpcore pools open new connections on demand after ``close()``. A
    caller's own http client is never closed by us; its owner closes it.
    """
    retry_cls = _retry_transport_class(http_client, is_async=is_async)
    if http_client.is_closed:
        raise UnsupportedClientError("the client's http client is closed")

    owns_pool = _reach.made_by_sdk(http_client)

    def retrying(transport: Any) -> Any:
        inner = getattr(transport, "inner", transport) if _is_retry_transport(transport) else transport
        return retry_cls(inner, engine=engine, owns_inner=owns_pool)

    new = _reach.copy_with_transports(http_client, retrying)
    # Keep the pool's owner alive as long as we use its pool (its __del__ may close it).
    setattr(new, _ORIGIN_ATTR, getattr(http_client, _ORIGIN_ATTR, http_client))
    return new


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


#: The reason given to an error the SDK raised itself from a stream that had started.
_FAILED_AFTER_START = "the stream failed after it had started; not retried, so no output is duplicated"


def annotate_openai_error(exc: BaseException, stream: object = None) -> None:
    """Copy the attempt history onto an exception raised by the openai client, if we have one.

    ``stream`` is the SDK stream it was raised from: an error event the SDK turns into an
    exception (openai's ``APIError``) names no response, the stream does.
    """
    if getattr(exc, ATTRIBUTE, None) is not None:
        return
    found = _history_of(exc)
    if found is None and stream is not None:
        extensions = getattr(getattr(stream, "response", None), "extensions", None)
        if isinstance(extensions, dict) and EXTENSION_KEY in extensions:
            found = extensions[EXTENSION_KEY], _FAILED_AFTER_START
    if found is not None:
        annotate(exc, *found)


def _own_timeout(exc: BaseException, sdk: _Sdk) -> RateLimitTimeout | None:
    """Our `RateLimitTimeout` when the SDK wrapped it (openai 2.x turns any error into APIConnectionError)."""
    cause = exc.__cause__
    error = sdk.connection_error
    if error is not None and isinstance(exc, error) and isinstance(cause, RateLimitTimeout):
        return cause
    return None


def _annotating_iter(items: Iterator[Any], stream: object) -> Iterator[Any]:
    """An openai ``Stream``'s items; an error mid-stream gets the history (openai 3.x wraps it)."""
    try:
        yield from items
    except Exception as exc:
        annotate_openai_error(exc, stream)
        raise


async def _annotating_aiter(items: AsyncIterator[Any], stream: object) -> AsyncIterator[Any]:
    try:
        async for item in items:
            yield item
    except Exception as exc:
        annotate_openai_error(exc, stream)
        raise


def _install_request_hook(client: Any, clock: Callable[[], float] | None, sdk: _Sdk) -> None:
    """Wrap ``client.request``: attempt history onto errors, when the call began, its credentials.

    ``clock`` is the retry engine's (None when the client has no retry transport).
    """
    request = client.request
    http_client = getattr(client, "_client", None)
    # Only a client with something to redo per attempt pays for noting its calls.
    refreshing = has_recorders(client) or bool(getattr(http_client, "event_hooks", {}).get("request"))
    hooked: Callable[..., Any]
    if isinstance(client, sdk.async_client):
        stream_cls = sdk.async_stream

        @functools.wraps(request)
        async def hooked(*args: Any, **kwargs: Any) -> Any:
            mark = CALL_STARTED.set(clock()) if clock is not None else None
            noted = open_call(client, http_client)[1] if refreshing else None
            try:
                result = await request(*args, **kwargs)
            except BaseException as exc:
                own = _own_timeout(exc, sdk)
                if own is not None:
                    raise own from None
                annotate_openai_error(exc)
                raise
            finally:
                if noted is not None:
                    close_call(noted)
                if mark is not None:
                    CALL_STARTED.reset(mark)
            if stream_cls is not None and isinstance(result, stream_cls):
                _reach.wrap_stream_items(result, functools.partial(_annotating_aiter, stream=result))
            return result

    else:
        stream_cls = sdk.stream

        @functools.wraps(request)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            mark = CALL_STARTED.set(clock()) if clock is not None else None
            noted = open_call(client, http_client)[1] if refreshing else None
            try:
                result = request(*args, **kwargs)
            except BaseException as exc:
                own = _own_timeout(exc, sdk)
                if own is not None:
                    raise own from None
                annotate_openai_error(exc)
                raise
            finally:
                if noted is not None:
                    close_call(noted)
                if mark is not None:
                    CALL_STARTED.reset(mark)
            if stream_cls is not None and isinstance(result, stream_cls):
                _reach.wrap_stream_items(result, functools.partial(_annotating_iter, stream=result))
            return result

    original_copy = client.copy

    @functools.wraps(original_copy)
    def copy(*args: Any, **kwargs: Any) -> Any:
        derived = original_copy(*args, **kwargs)
        engine = _engine_or_none(derived)
        install_recorders(derived)
        _install_request_hook(derived, engine.clock if engine is not None else None, sdk)
        return derived

    # Instance attributes shadow the class's methods for this one client only.
    vars(client).update(request=hooked, copy=copy, with_options=copy)
