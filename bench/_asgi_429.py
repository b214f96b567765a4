"""The reference for a refusal's cost: a 15-line ASGI app answering 429 without reading the body.

    python bench/_asgi_429.py --port 8001 [--access-log]

Served by uvicorn as the shim is (uvloop, httptools, no server or date header).
"""

import argparse

import uvicorn

BODY = b'{"error":{"message":"at capacity","type":"server_overloaded","param":null,"code":"queue_full"}}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    status = 200 if scope["path"] == "/health" else 429  # the bench waits for /health
    await send(
        {"type": "http.response.start", "status": status, "headers": [*HEADERS, (b"retry-after", b"1")]}
    )
    await send({"type": "http.response.body", "body": BODY})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--access-log", action="store_true", help="uvicorn's own access log on (stdout)")
    a = p.parse_args()
    level = "info" if a.access_log else "warning"
    options = {"loop": "uvloop", "http": "httptools", "server_header": False, "date_header": False}
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level=level, access_log=a.access_log, **options)
