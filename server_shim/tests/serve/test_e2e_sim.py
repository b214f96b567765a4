"""End-to-end: the shim on uvicorn in front of the vLLM-like simulator, real clients only.

Loads are bounded in count (tens of requests) and the simulator is fast (a few ms per
token), so each test takes well under a few seconds. No latency is asserted.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

#: A streaming chat request as raw bytes, for tests that need the socket itself.
_STREAM_BODY = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "x"}]}'
STREAM_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(_STREAM_BODY)}\r\n\r\n".encode()
    + _STREAM_BODY
)


@pytest.fixture
def sim_factory() -> Iterator[Callable[..., ServerThread]]:
    servers: list[ServerThread] = []

    def factory(**config: Any) -> ServerThread:
        values: dict[str, Any] = {"ttft": 0.02, "itl": 0.005, "output_tokens": 20, "seed": 1}
        values.update(config)
        server = ServerThread(create_sim_app(SimConfig(**values))).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


def sim_stats(sim: ServerThread) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(sim.url + "/sim/stats", timeout=5).json()
    return stats


def test_openai_sdk_through_shim_streams_and_completes(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    sim = sim_factory(max_num_seqs=4)
    shim = make_shim(sim.url, max_concurrency=2, max_queue=4)
    client = openai.OpenAI(base_url=shim.url + "/v1", api_key="sk-test", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}]
    )
    assert "x-queue-time-ms" in raw.headers
    completion = raw.parse()
    assert completion.choices[0].message.content == " ".join(f"token{i}" for i in range(20))
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 20
    chunks = list(
        client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == [f"token{i}" for i in range(20)]
    assert chunks[-1].usage is not None
    assert [m.id for m in client.models.list()] == ["sim-model"]


def test_stream_chunks_arrive_while_the_engine_is_still_generating(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    sim = sim_factory(output_tokens=100_000, itl=0.005)
    shim = make_shim(sim.url)
    client = openai.OpenAI(base_url=shim.url + "/v1", api_key="sk-test", max_retries=0)
    stream = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with stream:
        firsts = [next(iter(stream)) for _ in range(3)]
        # The engine has 100k tokens to go: these chunks were relayed, not buffered.
        assert sim_stats(sim)["running"] == 1
    assert "".join(c.choices[0].delta.content or "" for c in firsts).split()[:2] == ["token0", "token1"]


def test_cap_holds_and_overflow_is_rejected_well_formed(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    sim = sim_factory(max_num_seqs=16, output_tokens=30)
    shim = make_shim(sim.url, max_concurrency=3, max_queue=5, max_queue_wait=30)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            return list(
                await asyncio.gather(
                    *(client.post(shim.url + "/v1/chat/completions", json=body) for _ in range(30))
                )
            )

    responses = asyncio.run(main())
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(rejected) == 30
    assert len(ok) >= 8  # 3 in flight + 5 queued at the very least
    assert rejected, "30 at once against 3 slots + 5 places must overflow"
    for r in rejected:
        error = r.json()["error"]
        assert error["code"] == "queue_full"
        assert 0 <= error["queue_depth"] <= 5
        assert int(r.headers["retry-after"]) >= 1
    stats = sim_stats(sim)
    assert stats["peak_running"] <= 3  # the engine never saw more than the shim's cap
    assert stats["requests_received"] == len(ok)
    assert shim.state() == {"interactive": (0, 0), "batch": (0, 0)}


@pytest.mark.parametrize("stalled", [False, True], ids=["reading", "stalled"])
def test_disconnect_mid_stream_aborts_in_the_engine(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any], waiter: Any, stalled: bool
) -> None:
    # "stalled": a client that stopped reading long enough for the relay to wait on its
    # socket (megabytes of events at full speed) before it goes away.
    sim = sim_factory(max_num_seqs=2, output_tokens=1_000_000, **({"itl": 0.0} if stalled else {"itl": 0.01}))
    shim = make_shim(sim.url, max_concurrency=1, max_queue=0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", shim.server.port))
    sock.sendall(STREAM_REQUEST)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    waiter(lambda: sim_stats(sim)["running"] == 1, what="engine running the stream")
    if stalled:
        time.sleep(1.5)
    sock.close()
    waiter(lambda: sim_stats(sim)["requests_aborted"] == 1, what="engine aborted the request")
    waiter(lambda: shim.state()["interactive"] == (0, 0), what="shim slot freed")
    assert sim_stats(sim)["running"] == 0


def test_a_slow_stream_reader_gets_every_token_in_order(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    # Megabytes of events to a client that reads nothing for a while: the shim must stop
    # and resume its relay (the client's socket and the shim's write buffer fill up)
    # without losing, repeating or reordering a byte.
    tokens = 60_000
    sim = sim_factory(max_num_seqs=1, output_tokens=tokens, ttft=0.0, itl=0.0)
    shim = make_shim(sim.url, max_concurrency=1, max_queue=0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", shim.server.port))
    sock.sendall(STREAM_REQUEST)
    time.sleep(1.5)
    received = bytearray()
    while not received.endswith(b"\r\n0\r\n\r\n"):
        data = sock.recv(1 << 16)
        assert data, "connection closed before the stream ended"
        received += data
    # The connection is still good for another request (the response ended cleanly).
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    again = sock.recv(1 << 16)
    sock.close()
    assert again.startswith(b"HTTP/1.1 200")
    head, _, framed = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in head.lower()
    payload = _unchunk(framed)
    assert payload.endswith(b"data: [DONE]\n\n")
    found = re.findall(rb"token(\d+)", payload)
    assert [int(n) for n in found] == list(range(tokens))
    assert shim.state()["interactive"] == (0, 0)


def test_pipelined_streams_on_one_connection_both_arrive_whole(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    # uvicorn serves pipelined requests one after the other; the second one's head is parsed
    # while the first is still streaming, and neither answer may borrow the other's state.
    sim = sim_factory(max_num_seqs=2, output_tokens=50, ttft=0.0, itl=0.001)
    shim = make_shim(sim.url, max_concurrency=2, max_queue=2)
    with socket.create_connection(("127.0.0.1", shim.server.port), timeout=30) as sock:
        sock.sendall(STREAM_REQUEST + STREAM_REQUEST)
        received = bytearray()
        while received.count(b"\r\n0\r\n\r\n") < 2:
            data = sock.recv(1 << 16)
            assert data, "connection closed before both streams ended"
            received += data
    answers = bytes(received).split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 2
    for answer in answers:
        assert answer.startswith(b"200")
        payload = _unchunk(answer.partition(b"\r\n\r\n")[2])
        assert [int(n) for n in re.findall(rb"token(\d+)", payload)] == list(range(50))
        assert payload.endswith(b"data: [DONE]\n\n")
    assert shim.state()["interactive"] == (0, 0)


def test_a_large_answer_with_a_length_is_relayed_unframed(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    # Read from the engine in many chunks, but it has a Content-Length: only chunked answers
    # may take the relay's direct path, which writes chunk frames.
    tokens = 20_000
    sim = sim_factory(max_num_seqs=1, output_tokens=tokens, ttft=0.0, itl=0.0)
    shim = make_shim(sim.url, max_concurrency=1, max_queue=0)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    response = httpx.post(shim.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert "content-length" in response.headers
    content = response.json()["choices"][0]["message"]["content"]
    assert content == " ".join(f"token{i}" for i in range(tokens))


def _unchunk(framed: bytes) -> bytes:
    out = bytearray()
    at = 0
    while True:
        line_end = framed.index(b"\r\n", at)
        size = int(framed[at:line_end], 16)
        if size == 0:
            return bytes(out)
        start = line_end + 2
        out += framed[start : start + size]
        assert framed[start + size : start + size + 2] == b"\r\n"
        at = start + size + 2


def test_engine_overload_503_becomes_retryable_rejection(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    # The shim lets more through than the engine will queue: vLLM-style 503s come back
    # to the client as 429 queue_full with a Retry-After instead of a bare 503.
    sim = sim_factory(max_num_seqs=1, max_num_queued_reqs=2, output_tokens=40, itl=0.01)
    shim = make_shim(sim.url, max_concurrency=6, max_queue=0)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            return list(
                await asyncio.gather(
                    *(client.post(shim.url + "/v1/chat/completions", json=body) for _ in range(6))
                )
            )

    responses = asyncio.run(main())
    converted = [r for r in responses if r.status_code == 429]
    assert converted
    assert all(r.status_code in (200, 429) for r in responses)
    assert sim_stats(sim)["requests_rejected"] >= len(converted)
    for r in converted:
        assert r.json()["error"]["code"] == "queue_full"
        assert "upstream answered 503" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
    assert shim.state() == {"interactive": (0, 0), "batch": (0, 0)}


def test_stopped_engine_gives_503(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    sim = sim_factory()
    shim = make_shim(sim.url)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(shim.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200
    sim.stop()
    response = httpx.post(shim.url + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert httpx.get(shim.url + "/ready", timeout=10).status_code == 503
    assert shim.state() == {"interactive": (0, 0), "batch": (0, 0)}


def test_stream_cut_by_the_engine_is_not_passed_off_as_complete(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any], waiter: Any
) -> None:
    sim = sim_factory(stream_cut_rate=1.0, output_tokens=200)
    shim = make_shim(sim.url)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}

    def read_all() -> int:
        with httpx.stream("POST", shim.url + "/v1/chat/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            return sum(len(piece) for piece in response.iter_bytes())

    with pytest.raises(httpx.HTTPError):
        read_all()
    waiter(lambda: shim.state()["interactive"] == (0, 0), what="slot freed")
    samples = shim.metrics()
    key = (
        "llm_backoff_shim_requests_total",
        tuple(sorted({"class": "interactive", "outcome": "upstream_error", "code": ""}.items())),
    )
    assert samples[key] == 1


def test_engine_500_passes_through(
    sim_factory: Callable[..., ServerThread], make_shim: Callable[..., Any]
) -> None:
    sim = sim_factory(error_rate=1.0)
    shim = make_shim(sim.url)
    client = openai.OpenAI(base_url=shim.url + "/v1", api_key="sk-test", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 500
    assert "retry-after" not in info.value.response.headers
