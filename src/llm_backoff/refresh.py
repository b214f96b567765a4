"""What the SDK's own retries redo per attempt, redone before each retry of ours.

openai's retry loop builds every attempt afresh: it asks the ``api_key`` provider (a
callable ``api_key``) and Azure's ``azure_ad_token_provider`` again, and httpx runs
the client's ``request`` event hooks on the new request. Our retries happen below
all that, inside the transport, on the one request the SDK built; a token that
expires during a minute of retries would be sent again and again. So, before each
retry (never before the first attempt, which the SDK and httpx have just prepared):

- each credential provider that filled a header of this request is asked again,
  and the header gets the fresh value. A header the call or the client set itself
  (``extra_headers={"Authorization": ...}``, ``default_headers``) holds a value no
  provider returned, and is left alone;
- the http client's ``request`` event hooks run again on the request (a request
  signer signs the retry; a hook that counts sees each attempt). ``response`` hooks
  see the final response only: the answers retried are consumed by the retry loop.

How a header is known to come from a provider: `wrap()` replaces each provider on
the wrapped client with a `RecordingProvider` around it, which notes, in the calling
context, what it returned. The wrapped client's ``request`` opens that note for each
call (`open_call`); the transport picks it up when the call's first attempt begins.
When an SDK version keeps its providers elsewhere, nothing is recorded and the
credentials are those of the first attempt (`_reach` lists this degraded mode).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from . import _reach

__all__ = [
    "AttemptRefresh",
    "RecordingProvider",
    "close_call",
    "current",
    "has_recorders",
    "install_recorders",
    "open_call",
]

#: The call being made in this context, whose providers note what they return.
_ISSUED: ContextVar[AttemptRefresh | None] = ContextVar("llm_backoff_issued", default=None)


class RecordingProvider:
    """A credential provider that also notes, for the current call, what it returned."""

    __slots__ = ("attribute", "inner")

    def __init__(self, inner: Callable[..., Any], attribute: str) -> None:
        self.inner = inner
        self.attribute = attribute

    def __call__(self) -> Any:
        result = self.inner()
        if inspect.isawaitable(result):
            return self._noted(result)
        self._note(result)
        return result

    async def _noted(self, pending: Awaitable[Any]) -> Any:
        value = await pending
        self._note(value)
        return value

    def _note(self, value: object) -> None:
        refresh = _ISSUED.get()
        if refresh is not None and isinstance(value, str) and value:
            refresh.issued[self.attribute] = value


def install_recorders(client: object) -> None:
    """Put a `RecordingProvider` around each credential provider the SDK client has."""
    for attribute in {attribute for attribute, _, _ in _reach.CREDENTIAL_PROVIDERS}:
        provider = _reach.credential_provider(client, attribute)
        if provider is None:
            continue
        if isinstance(provider, RecordingProvider):
            provider = provider.inner
        _reach.set_credential_provider(client, attribute, RecordingProvider(provider, attribute))


def has_recorders(client: object) -> bool:
    """Whether `install_recorders` put a recorder on ``client`` (it has a credential provider)."""
    return any(
        isinstance(_reach.credential_provider(client, attribute), RecordingProvider)
        for attribute, _, _ in _reach.CREDENTIAL_PROVIDERS
    )


class AttemptRefresh:
    """One call's credentials and hooks, to redo before each retry."""

    __slots__ = ("_client", "_http_client", "issued")

    def __init__(self, client: object, http_client: Any) -> None:
        self._client = client
        self._http_client = http_client
        #: attribute of the provider -> the credential it gave for the request in flight.
        self.issued: dict[str, str] = {}

    def _stale(self, request: Any) -> list[tuple[str, str, Callable[[str], str]]]:
        """(attribute, header, render) for each header of ``request`` a provider filled."""
        stale = []
        for attribute, header, render in _reach.CREDENTIAL_PROVIDERS:
            old = self.issued.get(attribute)
            if old is not None and request.headers.get(header) == render(old):
                stale.append((attribute, header, render))
        return stale

    def _hooks(self) -> list[Callable[[Any], Any]]:
        hooks = getattr(self._http_client, "event_hooks", None)
        return list(hooks.get("request", ())) if isinstance(hooks, dict) else []

    def _provider(self, attribute: str) -> Callable[..., Any]:
        provider = _reach.credential_provider(self._client, attribute)
        if provider is None:
            raise RuntimeError(f"the client's {attribute} went away during the call")
        return provider

    def run(self, request: Any) -> None:
        """Before a retry of a sync call."""
        for attribute, header, render in self._stale(request):
            fresh = _checked(self._provider(attribute)(), attribute)
            self.issued[attribute] = fresh
            request.headers[header] = render(fresh)
        for hook in self._hooks():
            hook(request)

    async def arun(self, request: Any) -> None:
        """Before a retry of an async call (providers and hooks may be sync or async)."""
        for attribute, header, render in self._stale(request):
            value = self._provider(attribute)()
            if inspect.isawaitable(value):
                value = await value
            fresh = _checked(value, attribute)
            self.issued[attribute] = fresh
            request.headers[header] = render(fresh)
        for hook in self._hooks():
            result = hook(request)
            if inspect.isawaitable(result):
                await result


def _checked(value: object, attribute: str) -> str:
    if not isinstance(value, str) or not value:
        name = attribute.strip("_").replace("_provider", " provider")
        raise ValueError(f"the {name} returned {value!r} for a retry, expected a non-empty str")
    return value


def open_call(client: object, http_client: Any) -> tuple[AttemptRefresh, Any]:
    """Start noting credentials for one call on ``client``; returns it and the token to reset."""
    refresh = AttemptRefresh(client, http_client)
    return refresh, _ISSUED.set(refresh)


def close_call(token: Any) -> None:
    _ISSUED.reset(token)


def current() -> AttemptRefresh | None:
    """The call being made in this context (the transport takes it on the first attempt)."""
    return _ISSUED.get()
