"""Which headers cross the proxy (RFC 9110 section 7.6.1, hop-by-hop fields), and who the client is.

Hop-by-hop fields describe one connection, not the message, so a proxy must drop
them in both directions, together with every field the ``Connection`` header names.
``host`` and ``content-length`` are dropped from requests too: the upstream client
sets them for the upstream connection and the (fully read) body.

Forwarding headers (:class:`Forwarding`): an app behind the shim that trusts its peer's
``X-Forwarded-For`` (uvicorn does for 127.0.0.1 by default, and so vLLM's server) would
otherwise take a client's own claim for its address. The shim therefore drops what a client
sent in ``X-Forwarded-For``, ``Forwarded``, ``X-Real-IP``, ``X-Forwarded-Host`` and
``X-Forwarded-Proto``, and says who its peer is in the first three, as nginx's
``proxy_add_x_forwarded_for`` and ``X-Real-IP $remote_addr`` do. When the peer is one of
``--trusted-proxies`` (the shim sits behind a load balancer), the chain it sent is kept and the
peer appended; ``X-Real-IP`` is then the last address in the chain that is not a trusted proxy
(nginx's ``real_ip_recursive``), and ``Forwarded`` lists the same chain.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable

RawHeaders = list[tuple[bytes, bytes]]

HOP_BY_HOP: frozenset[bytes] = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)

_REQUEST_ONLY_DROP: frozenset[bytes] = frozenset({b"host", b"content-length", b"expect"})


_REQUEST_DROP = HOP_BY_HOP | _REQUEST_ONLY_DROP


#: What a client says about where the request came from; never passed on from an untrusted peer.
FORWARDING: frozenset[bytes] = frozenset(
    {b"x-forwarded-for", b"forwarded", b"x-real-ip", b"x-forwarded-host", b"x-forwarded-proto"}
)

_FORWARDED_DROP = _REQUEST_DROP | FORWARDING


def strip_hop_by_hop(
    headers: Iterable[tuple[bytes, bytes]],
    *,
    request: bool = False,
    lower: bool = False,
    drop: frozenset[bytes] | None = None,
) -> RawHeaders:
    """Headers minus hop-by-hop ones (and, for requests, host/content-length/expect), order kept.

    ``lower=True`` also lowercases the names kept (ASGI wants them so); ``drop`` replaces the
    set of names dropped. One pass over the headers; a second one only when a ``Connection``
    header names further fields to drop. This runs twice per relayed request.
    """
    if drop is None:
        drop = _REQUEST_DROP if request else HOP_BY_HOP
    kept: RawHeaders = []
    named: frozenset[bytes] = frozenset()
    for name, value in headers:
        folded = name.lower()
        if folded in drop:
            if folded == b"connection":
                named |= _named_fields(value)
            continue
        kept.append((folded if lower else name, value))
    if named:
        kept = [(name, value) for name, value in kept if name.lower() not in named]
    return kept


@functools.lru_cache(maxsize=64)
def _named_fields(connection: bytes) -> frozenset[bytes]:
    """The fields a ``Connection`` value names beyond those always dropped.

    Nearly every client sends ``keep-alive`` (or ``close``), which names nothing more to
    drop: cached, that costs one lookup instead of a set built per request (about half
    of this function's time per relayed request before). The cache is bounded, so odd
    values cannot grow it.
    """
    tokens = {token.strip().lower() for token in connection.split(b",")}
    return frozenset(tokens - HOP_BY_HOP - {b"", b"close"})


class Forwarding:
    """The request headers the shim forwards, with the client's address said by the shim itself.

    ``trusted``: addresses or networks (``10.0.0.0/8``, ``::1``) of proxies in front of the
    shim whose forwarding headers are believed. Raises ValueError on one that is neither.
    """

    def __init__(self, trusted: Iterable[str] = ()) -> None:
        self.trusted = tuple(ipaddress.ip_network(item.strip(), strict=False) for item in trusted)
        self._own: dict[str, RawHeaders] = {}

    def is_trusted(self, address: str) -> bool:
        if not self.trusted:
            return False
        try:
            ip = ipaddress.ip_address(address.strip().strip("[]"))
        except ValueError:
            return False
        return any(ip in network for network in self.trusted)

    def request_headers(self, headers: RawHeaders, peer: str | None) -> RawHeaders:
        """``headers`` to forward: hop-by-hop and client-sent forwarding fields dropped, ours added."""
        kept = strip_hop_by_hop(headers, request=True, drop=_FORWARDED_DROP)
        if peer is None:
            return kept
        if self.trusted and self.is_trusted(peer):
            kept.extend(self._chain_headers([*_chain(headers), peer]))
            kept.extend(_pass_through(headers))
            return kept
        own = self._own.get(peer)
        if own is None:
            own = self._chain_headers([peer])
            if len(self._own) < 4096:  # one entry per peer address; bounded
                self._own[peer] = own
        kept.extend(own)
        return kept

    def _chain_headers(self, chain: list[str]) -> RawHeaders:
        real = next((hop for hop in reversed(chain) if not self.is_trusted(hop)), chain[0])
        return [
            (b"x-forwarded-for", ", ".join(chain).encode("latin-1")),
            (b"x-real-ip", real.encode("latin-1")),
            (b"forwarded", ", ".join(f"for={_forwarded_node(hop)}" for hop in chain).encode("latin-1")),
        ]


def _chain(headers: RawHeaders) -> list[str]:
    """The addresses a trusted proxy reported: its ``X-Forwarded-For``, else ``Forwarded``'s ``for=``."""
    forwarded_for = [value for name, value in headers if name.lower() == b"x-forwarded-for"]
    if forwarded_for:
        text = b",".join(forwarded_for).decode("latin-1")
        return [hop.strip() for hop in text.split(",") if hop.strip()]
    chain = []
    for name, value in headers:
        if name.lower() != b"forwarded":
            continue
        for element in value.decode("latin-1").split(","):
            for pair in element.split(";"):
                key, _, node = pair.strip().partition("=")
                if key.lower() == "for" and node:
                    node = node.strip('"')
                    chain.append(node[1 : node.index("]")] if node.startswith("[") and "]" in node else node)
    return chain


def _pass_through(headers: RawHeaders) -> RawHeaders:
    """What a trusted proxy said about the original host and scheme."""
    return [
        (name.lower(), value)
        for name, value in headers
        if name.lower() in (b"x-forwarded-host", b"x-forwarded-proto")
    ]


def _forwarded_node(address: str) -> str:
    """An RFC 7239 node: IPv6 addresses bracketed and quoted, tokens as they are."""
    if ":" in address:
        return f'"[{address}]"' if not address.startswith("[") else f'"{address}"'
    return address
