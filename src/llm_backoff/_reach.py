"""Every use of a private attribute of openai, anthropic, httpx or httpx2, in one place.

`wrap()` works at the HTTP transport of the SDK's client, and a few things it needs
have no public interface. Each one is looked up here, feature-checked, and either
fails with `UnsupportedClientError` naming what is missing (when `wrap()` cannot work
without it) or degrades as documented beside it:

- SDK client ``_client``: the http client to wrap. Missing: `UnsupportedClientError`.
- httpx/httpx2 ``Client._transport``, ``_mounts``: where the retry transports go.
  Missing: `UnsupportedClientError`.
- ``<sdk>._base_client.SyncHttpxClientWrapper`` / ``AsyncHttpxClientWrapper``: did
  the SDK build the http client (so closing the wrapped client closes the pool)?
  Missing: the pool is treated as the caller's, never closed by the wrapped client.
- SDK ``Stream._iterator`` / ``AsyncStream._iterator``: the attempt history on an
  error mid-stream. Missing: the error is raised without the history.
- SDK ``_api_key_provider``, Azure ``_azure_ad_token_provider``: credentials asked
  again per attempt (`refresh`). Missing: asked once per call, as the SDK built it.
- httpx/httpx2 ``Headers._list``: a cheaper header look-up and insert. Missing or
  different: the public ``Headers`` methods.

The event hooks of the http client are read and copied through its public
``event_hooks`` property.
"""

from __future__ import annotations

import copy
import operator
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

from .errors import UnsupportedClientError

_second = operator.itemgetter(1)

#: The SDKs built on the same generated base client (openai's and anthropic's).
SDK_PACKAGES = ("openai", "anthropic")


def http_client_of(client: Any) -> Any:
    """The httpx/httpx2 client an SDK client sends through (``client._client``)."""
    http_client = getattr(client, "_client", None)
    if http_client is None:
        raise UnsupportedClientError(
            f"{type(client).__name__} has no `_client` (its http client): this SDK version is not supported"
        )
    return http_client


def transport_of(client: object) -> Any:
    """The transport of an SDK client's http client, or None when there is none to find."""
    return getattr(getattr(client, "_client", None), "_transport", None)


def copy_with_transports(http_client: Any, retrying: Callable[[Any], Any]) -> Any:
    """A shallow copy of ``http_client`` whose transport and proxy mounts are ``retrying(...)`` of its own.

    Everything else is the same configuration object (timeouts, limits, auth, TLS, the
    cookie jar); headers and event-hook lists are copied, so later edits on one client
    do not leak into the other.
    """
    if not hasattr(http_client, "_transport") or not isinstance(getattr(http_client, "_mounts", None), dict):
        raise UnsupportedClientError(
            f"{type(http_client).__name__} does not have the httpx transport layering (_transport, _mounts)"
        )
    new = copy.copy(http_client)
    new.headers = http_client.headers  # the setter builds a fresh Headers
    new.event_hooks = http_client.event_hooks  # the setter copies the lists
    new._transport = retrying(http_client._transport)
    new._mounts = {
        pattern: None if transport is None else retrying(transport)
        for pattern, transport in http_client._mounts.items()
    }
    return new


def made_by_sdk(http_client: object) -> bool:
    """True for the http client an SDK builds itself when the caller passes none."""
    for package in SDK_PACKAGES:
        base = sys.modules.get(f"{package}._base_client")
        if base is None:
            continue
        for name in ("SyncHttpxClientWrapper", "AsyncHttpxClientWrapper"):
            cls = getattr(base, name, None)
            if isinstance(cls, type) and isinstance(http_client, cls):
                return True
    return False


def wrap_stream_items(stream: object, wrapper: Callable[[Any], Any]) -> bool:
    """Replace an SDK stream's item iterator with ``wrapper(iterator)``; False when it has none."""
    items = getattr(stream, "_iterator", None)
    if items is None:
        return False
    try:
        stream._iterator = wrapper(items)  # type: ignore[attr-defined]
    except AttributeError:
        return False
    return True


#: (attribute on the SDK client, header it fills, how the header's value is made from the credential)
CREDENTIAL_PROVIDERS: tuple[tuple[str, str, Callable[[str], str]], ...] = (
    ("_azure_ad_token_provider", "authorization", "Bearer {}".format),
    ("_api_key_provider", "authorization", "Bearer {}".format),
    ("_api_key_provider", "api-key", str),
)


def credential_provider(client: object, attribute: str) -> Callable[..., Any] | None:
    provider = getattr(client, attribute, None)
    return provider if callable(provider) else None


def set_credential_provider(client: object, attribute: str, provider: Callable[..., Any]) -> None:
    setattr(client, attribute, provider)


def set_header(headers: MutableMapping[str, str], name: str, value: str) -> None:
    """``headers[name] = value`` for a lower-case ASCII ``name``, cheaper in the usual case.

    httpx's ``Headers.__setitem__`` scans every header in Python to drop duplicates
    (about 1.3 us with openai's fifteen headers, on every attempt). When the header is
    not there yet, which is every first attempt, the check here runs in C and the entry
    is appended to the (raw, lower-case, value) list httpx and httpx2 keep; anything
    else (a retry, a caller's own value, another headers class) takes the public setter.
    """
    entries = getattr(headers, "_list", None)
    key = name.encode("ascii")
    if type(entries) is list and (not entries or len(entries[0]) == 3) and key not in map(_second, entries):
        entries.append((key, key, value.encode("ascii")))
    else:
        headers[name] = value


def content_type(headers: MutableMapping[str, str]) -> str:
    """``headers.get("content-type", "")``, read from httpx's header list when it has one.

    ``Headers.get`` normalises the key, builds a list of matches and decodes them, about
    as much work as a first attempt's own bookkeeping; a response has a few headers and
    the look-up here runs in C. Anything unusual (a repeated content-type,
    another headers class) takes the public path.
    """
    entries = getattr(headers, "_list", None)
    if type(entries) is not list:
        return headers.get("content-type", "")
    keys = list(map(_second, entries))
    count = keys.count(b"content-type")
    if count == 1:
        value: bytes = entries[keys.index(b"content-type")][2]
        return value.decode("latin-1")
    return "" if count == 0 else headers.get("content-type", "")
