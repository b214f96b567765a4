"""The shim's own HTTP layer: the serving protocol's fast path and the upstream client.

Everything here extends or replaces parts of the HTTP stack (uvicorn's protocol, a
slimmed request cycle, a head guard, an HTTP/1.1 client on httptools). The rest of the
shim reaches it through the names its modules export, never through the libraries'
internals directly.
"""
