"""Which headers cross the proxy (RFC 9110 section 7.6.1, hop-by-hop fields).

Hop-by-hop fields describe one connection, not the message, so a proxy must drop
them in both directions, together with every field the ``Connection`` header names.
``host`` and ``content-length`` are dropped from requests too: the upstream client
sets them for the upstream connection and the (fully read) body.
"""

from __future__ import annotations

import functools
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


def strip_hop_by_hop(
    headers: Iterable[tuple[bytes, bytes]], *, request: bool = False, lower: bool = False
) -> RawHeaders:
    """Headers minus hop-by-hop ones (and, for requests, host/content-length/expect), order kept.

    ``lower=True`` also lowercases the names kept (ASGI wants them so). One pass over the
    headers; a second one only when a ``Connection`` header names further fields to drop.
    This runs twice per relayed request.
    """
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
