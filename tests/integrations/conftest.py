"""Fixtures for the third-party client recipes of docs/integrations.md (see rig.py for the rig).

- ``rig``: the vLLM-like simulator behind the one-slot shim. Every answer is
  ``token0 token1 ...`` as long as the request's ``max_tokens``; the natural length
  is huge so the holder's stream lasts until it is let go.
- ``json_rig``: the same shim in front of a tiny upstream whose answers are one fixed
  JSON document (``rig.PERSON_JSON``), for clients that parse structured output.

The autouse ``loopback_only`` fixture refuses any connection or name lookup beyond
loopback, so a framework that phones home (tracing uploads, tokenizer downloads)
fails the test instead of reaching the internet.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

from .rig import Rig, json_upstream


def _is_loopback(host: object) -> bool:
    if not isinstance(host, str):
        return True  # AF_UNIX paths and the like never leave the machine
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def refuse(what: str, host: object) -> OSError:
        return OSError(f"tests/integrations: {what} {host!r} refused, only loopback is allowed")

    def connect(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            raise refuse("connection to", address[0])
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            raise refuse("connection to", address[0])
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not _is_loopback(host.decode() if isinstance(host, bytes) else host):
            raise refuse("name lookup of", host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def rig() -> Iterator[Rig]:
    config = SimConfig(ttft=0.001, itl=0.001, output_tokens=1_000_000, seed=1)
    with ServerThread(create_sim_app(config)) as sim:
        made = Rig(sim)
        try:
            yield made
        finally:
            made.close()


@pytest.fixture
def json_rig() -> Iterator[Rig]:
    with ServerThread(json_upstream()) as upstream:
        made = Rig(upstream)
        try:
            yield made
        finally:
            made.close()
