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
    named: set[bytes] | None = None
    for name, value in headers:
        folded = name.lower()
        if folded in drop:
            if folded == b"connection":
                tokens = {token.strip().lower() for token in value.split(b",")}
                named = (named or set()) | (tokens - {b""})
            continue
        kept.append((folded if lower else name, value))
    if named:
        kept = [(name, value) for name, value in kept if name.lower() not in named]
    return kept
