"""The shim's own HTTP layer: the two serving paths and the upstream client.

The rest of the shim reaches it through three modules: :mod:`.interface` (what the
proxy needs from a client's connection and from the upstream, importing no server
internals), :mod:`.paths` (how ``serve`` and the tests run an app: the fast path, which
extends uvicorn's httptools protocol, when the start-up check in :mod:`.capability`
passes, else the public path on uvicorn's public interfaces) and :mod:`.upstream_http`
(the upstream connection pool, for upstream.py). Every use of a dependency's internals
lives in this subpackage and is listed in :mod:`.internals`.
"""
