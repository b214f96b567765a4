"""The rig of the recipe tests: a real shim with one slot and no queue, and a holder that fills it.

Each recipe test hands a framework a client made by ``llm_backoff.wrap()`` and has
its first request refused by the shim, so the call only succeeds if the wrapped
client retried underneath the framework. The refusal is forced without timing: the
shim admits one request at a time and queues none (``max_concurrency=1,
max_queue=0``), a *holder* stream occupies that one slot, and the wrapped client's
first retry hook lets the holder go (and waits until the shim has freed the slot)
before the retry is sent.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import llm_backoff
from llm_backoff_shim.serve.app import create_app
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.serving import ServerThread, shim_server

#: The one answer of `json_upstream`.
PERSON_JSON = '{"name": "Ada Lovelace", "born": 1815}'

#: What a recipe test asks of the simulator (``max_tokens=5``) and gets back.
FIVE_TOKENS = "token0 token1 token2 token3 token4"

_HOLD_BODY = b'{"model": "holder", "stream": true, "messages": [{"role": "user", "content": "hold"}]}'


class Rig:
    """A shim with one slot and no queue, in front of ``upstream``, plus the holder that fills the slot."""

    def __init__(self, upstream: ServerThread, **settings: Any) -> None:
        """``settings``: further `ShimSettings` fields, e.g. a tenant quota."""
        self.upstream = upstream
        values: dict[str, Any] = {
            "upstream": upstream.url,
            "max_concurrency": 1,
            "max_queue": 0,
            # Hints of a few tens of ms keep each retry's wait short; the SDK reads retry-after-ms.
            "retry_after_min": 0.05,
            "retry_after_max": 0.2,
            "log_level": "warning",
        }
        values.update(settings)
        app = create_app(ShimSettings(**values))
        self.shim = shim_server(app).start()
        self._holder: socket.socket | None = None
        self._lock = threading.Lock()
        self.releases = 0

    @property
    def url(self) -> str:
        """The base URL to give an openai client."""
        return self.shim.url + "/v1"

    def in_flight(self) -> int:
        classes = httpx.get(self.shim.url + "/shim/state", timeout=5).json()["classes"]
        return sum(int(c["in_flight"]) for c in classes.values())

    def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        # The timeout bounds a broken test only; no latency is asserted.
        deadline = time.monotonic() + 10
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting until {what}")
            time.sleep(0.005)

    def hold(self) -> None:
        """Occupy the shim's one slot with a stream that runs until `release`."""
        sock = socket.create_connection(("127.0.0.1", self.shim.port), timeout=10)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: shim\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(_HOLD_BODY)}\r\n\r\n".encode()
            + _HOLD_BODY
        )
        seen = b""
        while b"data:" not in seen:
            data = sock.recv(65536)
            assert data, f"the holder's stream ended before its first event: {seen[:300]!r}"
            seen += data
        assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
        self._holder = sock
        self._wait(lambda: self.in_flight() == 1, "the holder holds the shim's slot")

    def release(self) -> None:
        """Let the holder go and wait until the shim has freed its slot (idempotent)."""
        with self._lock:
            sock, self._holder = self._holder, None
            if sock is None:
                return
            self.releases += 1
            sock.close()
        self._wait(lambda: self.in_flight() == 0, "the shim freed the holder's slot")

    def release_on_retry(self, *clients: Any) -> None:
        """Subscribe `release` to the retry hooks of these wrapped clients."""
        for client in clients:
            llm_backoff.retry_observers(client).subscribe(lambda _event: self.release())

    def refused(self) -> dict[str, float]:
        """The shim's refusals so far, by rejection code (codes with none left out)."""
        text = httpx.get(self.shim.url + "/metrics", timeout=5).text
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != "llm_backoff_shim_requests_total" or not sample.value:
                    continue
                if sample.labels["outcome"] == "rejected":
                    code = sample.labels["code"]
                    counts[code] = counts.get(code, 0) + sample.value
        return counts

    def close(self) -> None:
        self.release()
        self.shim.stop()


def assert_rode_out_one_refusal(rig: Rig, *clients: Any) -> None:
    """The shim refused exactly once (queue full) and one wrapped client retried exactly once."""
    assert rig.releases == 1, "the holder was never let go: no retry happened"
    assert rig.refused() == {"queue_full": 1.0}
    snapshots = [llm_backoff.client_stats(c).snapshot() for c in clients]
    assert sorted(s.retries for s in snapshots) == [0] * (len(clients) - 1) + [1], snapshots
    retried = next(s for s in snapshots if s.retries)
    assert dict(retried.retries_by_reason) == {"status 429": 1}
    assert (retried.calls, retried.failed_calls, retried.attempts) == (1, 0, 2)


def json_upstream() -> Starlette:
    """Chat completions answered with `PERSON_JSON`; a streamed request gets chunks until it leaves."""

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        if body.get("stream"):

            async def chunks() -> AsyncIterator[bytes]:
                delta = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
                while not await request.is_disconnected():
                    yield f"data: {json.dumps(delta)}\n\n".encode()
                    await asyncio.sleep(0.005)

            return StreamingResponse(chunks(), media_type="text/event-stream")
        return JSONResponse(
            {
                "id": "chatcmpl-json",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", "json-model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": PERSON_JSON},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
            }
        )

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
