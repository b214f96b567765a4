"""The private attributes `wrap()` relies on are feature-checked: a clear error, or the documented fallback.

Each case takes a real client and removes the one attribute a version might lack.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

import llm_backoff
from llm_backoff import _reach


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k")


def test_a_client_without_its_http_client_is_refused_by_name() -> None:
    bare = client()
    del bare._client
    with pytest.raises(llm_backoff.UnsupportedClientError, match="has no `_client`"):
        llm_backoff.wrap(bare)


def test_an_http_client_without_the_transport_layering_is_refused_by_name() -> None:
    http_client = client()._client
    del http_client._mounts
    with pytest.raises(llm_backoff.UnsupportedClientError, match=r"layering \(_transport, _mounts\)"):
        _reach.copy_with_transports(http_client, lambda transport: transport)


def test_the_copy_keeps_configuration_and_copies_hooks_and_headers() -> None:
    http_client = client()._client

    def hook(request: Any) -> None:
        pass

    http_client.event_hooks = {"request": [hook]}
    new = _reach.copy_with_transports(http_client, lambda transport: ("wrapped", transport))
    assert new._transport == ("wrapped", http_client._transport)
    assert new.event_hooks == {"request": [hook], "response": []}
    new.event_hooks["request"].append(print)
    assert http_client.event_hooks["request"] == [hook]
    new.headers["x-only-new"] = "1"
    assert "x-only-new" not in http_client.headers
    assert new.timeout is http_client.timeout


def test_the_sdk_built_http_client_is_recognised_and_a_callers_is_not() -> None:
    assert _reach.made_by_sdk(client()._client)
    import httpx

    assert not _reach.made_by_sdk(httpx.Client())


def test_a_stream_without_its_iterator_is_left_as_it_is() -> None:
    class NoIterator:
        __slots__ = ()

    assert _reach.wrap_stream_items(NoIterator(), iter) is False

    class WithIterator:
        def __init__(self) -> None:
            self._iterator = iter([1, 2])

    stream = WithIterator()
    assert _reach.wrap_stream_items(stream, lambda items: (x * 10 for x in items)) is True
    assert list(stream._iterator) == [10, 20]


def test_a_client_keeping_no_provider_attribute_gets_no_recorder() -> None:
    from llm_backoff.refresh import RecordingProvider, install_recorders

    plain = client()
    install_recorders(plain)
    assert not isinstance(getattr(plain, "_api_key_provider", None), RecordingProvider)
    keyed = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key=lambda: "k")
    install_recorders(keyed)
    install_recorders(keyed)  # wrapping twice does not nest recorders
    provider = keyed._api_key_provider
    assert isinstance(provider, RecordingProvider)
    assert not isinstance(provider.inner, RecordingProvider)
