"""Which headers cross the proxy (RFC 9110 section 7.6.1, hop-by-hop fields).

Hop-by-hop fields describe one connection, not the message, so a proxy must drop
them in both directions, together with every field the ``Connection`` header names.
``host`` and ``content-length`` are dropped from requests too: the upstream client
sets them for the upstream connection and the (fully read) body.
"""

from __future__ import annotations

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


def _connection_named(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b",") if token.strip())
    return named


def strip_hop_by_hop(headers: Iterable[tuple[bytes, bytes]], *, request: bool = False) -> RawHeaders:
    """Headers minus hop-by-hop ones (and, for requests, host/content-length/expect), order kept."""
    items = list(headers)
    drop = HOP_BY_HOP | _connection_named(items)
    if request:
        drop = drop | _REQUEST_ONLY_DROP
    return [(name, value) for name, value in items if name.lower() not in drop]
