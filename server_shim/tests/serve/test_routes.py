"""The route table (routes.py): every row does what it says, on a real shim on loopback.

A recording upstream answers every path and method and keeps what it received, so a test
can tell a forwarded request (byte for byte) from one the shim answered itself. Requests
carrying ``x-hold: 1`` are parked until the test releases them, which is how slots are
kept busy without sleeping.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

from llm_backoff_shim.serve.api.routes import (
    OPERATOR_PATHS,
    ROUTES,
    V1_FALLBACK,
    Kind,
    RouteTable,
    Shape,
    UnknownOperatorRouteError,
    check_allowed,
    render_markdown,
)
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.serve.config.values import ConfigError
from llm_backoff_shim.serve.serving import ServerThread

DOCS = Path(__file__).resolve().parents[3] / "docs" / "reference.md"

#: The operator routes the issue names, which must all be refused.
ISSUE_OPERATOR_ROUTES = {
    "/sleep",
    "/wake_up",
    "/pause",
    "/resume",
    "/collective_rpc",
    "/update_weights",
    "/init_weight_transfer_engine",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/release_kv_cache_memory",
    "/start_profile",
    "/stop_profile",
    "/abort_requests",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/scale_elastic_ep",
}
ISSUE_SERVING_ROUTES = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/invocations",
    "/version",
    "/load",
    "/ping",
    "/v1/rerank",
    "/v1/score",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
}

MULTIPART = "multipart/form-data; boundary=XyZ"
AUDIO_BODY = (
    b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
    b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
    b"Content-Type: audio/wav\r\n\r\nRIFF\x00\x01\x02\xff\r\n--XyZ--\r\n"
)


@dataclass
class Seen:
    method: str
    raw_path: bytes
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class RecordingUpstream:
    """Answers any path and method: ``200`` with a fixed body and marker headers."""

    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _release: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def paths(self) -> list[str]:
        with self._lock:
            return [s.raw_path.decode() for s in self.seen]

    def release(self) -> None:
        self._release.set()

    def app(self) -> Starlette:
        async def anything(request: Request) -> Response:
            body = await request.body()
            with self._lock:
                self.seen.append(
                    Seen(
                        request.method,
                        request.scope["raw_path"],
                        request.scope["query_string"],
                        list(request.scope["headers"]),
                        body,
                    )
                )
            if request.headers.get("x-hold"):
                await asyncio.to_thread(self._release.wait, 60)
            answer = b'{"upstream":"answer","bytes":"\\u00e9\\u0000"}'
            return Response(
                answer,
                status_code=int(request.headers.get("x-status", "200")),
                media_type="application/json",
                headers={"x-upstream-marker": "yes"},
            )

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        return Starlette(routes=[StarletteRoute("/{path:path}", anything, methods=methods)])


@pytest.fixture
def recording() -> Iterator[RecordingUpstream]:
    fake = RecordingUpstream()
    with ServerThread(fake.app()) as server:
        fake.url = server.url
        try:
            yield fake
        finally:
            fake.release()


# -- the table itself -----------------------------------------------------------------------


def test_each_path_has_one_row() -> None:
    paths = [r.path for r in ROUTES]
    assert len(paths) == len(set(paths))


def test_the_table_covers_what_vllm_serves() -> None:
    kinds = {r.path: r.kind for r in ROUTES}
    assert ISSUE_OPERATOR_ROUTES <= OPERATOR_PATHS
    for path in ISSUE_SERVING_ROUTES:
        assert kinds[path] is not Kind.OPERATOR, path
    for path in ("/tokenize", "/detokenize", "/version", "/v1/models", "/ping", "/v1/messages/count_tokens"):
        assert kinds[path] is Kind.PASS, path
    for path in ("/pooling", "/classify", "/score", "/rerank", "/v1/audio/transcriptions", "/v1/messages"):
        assert kinds[path] is Kind.ENGINE, path


def test_the_shims_own_routes_are_not_rows() -> None:
    own = {"/health", "/ready", "/metrics", "/shim/state"}
    assert own.isdisjoint(r.path for r in ROUTES)
    table = RouteTable()
    for path in own:
        assert table.lookup(path) is None  # the shim answers these itself, never the proxy


def test_docs_show_the_table_as_the_code_has_it() -> None:
    assert render_markdown() in DOCS.read_text(encoding="utf-8")


def test_lookup_folds_slashes_and_refuses_what_leaves_the_api() -> None:
    table = RouteTable()
    for spelling in ("/sleep", "/sleep/", "//sleep", "/v1//load_lora_adapter", "/v1/load_lora_adapter/"):
        row = table.lookup(spelling)
        assert row is not None, spelling
        assert row.refused, spelling
    assert table.lookup("/v1/responses/resp_1") is V1_FALLBACK
    assert table.lookup("/v1/models/org/model") is V1_FALLBACK
    outside = ("/foo", "/SLEEP", "/tokenize/../sleep", "/v1/../sleep", "/v1/a/../../sleep", "/sl\neep", "/")
    for path in outside:
        assert table.lookup(path) is None, path
    messages = table.lookup("/v1/messages")
    assert messages is not None
    assert messages.shape is Shape.ANTHROPIC
    assert messages.admitted


def test_only_operator_routes_can_be_allowed() -> None:
    assert check_allowed([" /sleep", "/sleep/", "/wake_up"]) == ("/sleep", "/wake_up")
    with pytest.raises(UnknownOperatorRouteError, match="not an operator route"):
        check_allowed(["/v1/chat/completions"])
    table = RouteTable(["/sleep"])
    sleep, wake = table.lookup("/sleep"), table.lookup("/wake_up")
    assert sleep is not None
    assert not sleep.refused
    assert wake is not None
    assert wake.refused


def test_allow_operator_route_flag_repeats_and_the_variable_takes_a_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = load_settings(["--allow-operator-route", "/sleep", "--allow-operator-route", "/wake_up"])
    assert settings.allow_operator_route == ("/sleep", "/wake_up")
    monkeypatch.setenv("LLM_BACKOFF_SHIM_ALLOW_OPERATOR_ROUTE", "/reset_prefix_cache,/collective_rpc")
    assert ShimSettings().allow_operator_route == ("/reset_prefix_cache", "/collective_rpc")
    with pytest.raises(ConfigError, match=r"--allow-operator-route=/tokenize: .*not an operator route"):
        load_settings(["--allow-operator-route", "/tokenize"])


# -- on the wire ------------------------------------------------------------------------------


def _request_for(row: Any) -> tuple[str, dict[str, str], bytes]:
    method = row.methods[0]
    if method == "GET":
        return method, {}, b""
    if not row.json_body:
        return method, {"content-type": MULTIPART}, AUDIO_BODY
    return method, {"content-type": "application/json"}, b'{"model": "m", "input": "caf\xc3\xa9", "n": 1}'


FORWARDED = [r for r in ROUTES if r.kind is not Kind.OPERATOR]


@pytest.mark.parametrize("row", FORWARDED, ids=[r.path for r in FORWARDED])
def test_every_serving_route_is_forwarded_byte_for_byte(
    recording: RecordingUpstream, make_shim: Callable[..., Any], row: Any
) -> None:
    shim = make_shim(recording.url)
    method, headers, body = _request_for(row)
    headers |= {"x-custom": "kept", "authorization": "Bearer engine-key"}
    response = httpx.request(method, shim.url + row.path + "?a=1&b=%20", headers=headers, content=body)
    assert response.status_code == 200, response.text
    assert response.content == b'{"upstream":"answer","bytes":"\\u00e9\\u0000"}'
    assert response.headers["x-upstream-marker"] == "yes"
    (seen,) = recording.seen
    assert seen.method == method
    assert seen.raw_path == (row.upstream_path or row.path).encode()
    assert seen.query == b"a=1&b=%20"
    assert seen.body == body
    sent = dict(seen.headers)
    assert sent[b"x-custom"] == b"kept"
    assert sent[b"authorization"] == b"Bearer engine-key"
    # Admitted requests carry their queue time; pass-through ones never queued.
    assert ("x-queue-time-ms" in response.headers) == (method == "POST" and row.admitted)
    assert shim.state() == {"interactive": (0, 0), "batch": (0, 0)}


@pytest.mark.parametrize("path", sorted(OPERATOR_PATHS))
def test_operator_routes_are_refused_with_a_403(
    recording: RecordingUpstream, make_shim: Callable[..., Any], path: str
) -> None:
    shim = make_shim(recording.url)
    response = httpx.post(shim.url + path, json={"level": 1})
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "operator_route"
    assert error["type"] == "invalid_request_error"
    assert "--allow-operator-route" in error["message"]
    assert recording.seen == []


def test_operator_routes_hide_behind_no_spelling(
    recording: RecordingUpstream, make_shim: Callable[..., Any]
) -> None:
    shim = make_shim(recording.url)
    host, port = shim.url.removeprefix("http://").split(":")
    statuses = []
    for target in ("/%73leep", "/sleep/", "//sleep", "/v1/load%5Flora_adapter", "/v1//unload_lora_adapter"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST {target} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode())
            head = sock.recv(65536)
        statuses.append(int(head.split(b" ", 2)[1]))
    assert statuses == [403] * 5
    assert recording.seen == []
    assert shim.metrics()[("llm_backoff_shim_bad_requests_total", (("reason", "operator_route"),))] == 5


def test_an_allowed_operator_route_is_forwarded_and_the_others_stay_refused(
    recording: RecordingUpstream, make_shim: Callable[..., Any]
) -> None:
    shim = make_shim(recording.url, allow_operator_route=("/sleep", "/v1/load_lora_adapter"))
    assert httpx.post(shim.url + "/sleep?level=2").status_code == 200
    lora = {"lora_name": "a", "lora_path": "/x"}
    assert httpx.post(shim.url + "/v1/load_lora_adapter", json=lora).status_code == 200
    assert httpx.post(shim.url + "/wake_up").status_code == 403
    assert recording.paths() == ["/sleep", "/v1/load_lora_adapter"]
    assert recording.seen[0].query == b"level=2"


def test_an_allowed_operator_route_still_needs_the_api_key(
    recording: RecordingUpstream, make_shim: Callable[..., Any]
) -> None:
    shim = make_shim(recording.url, allow_operator_route=("/sleep",), api_key="s3cret")
    assert httpx.post(shim.url + "/sleep").status_code == 401
    assert httpx.post(shim.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    ok = httpx.post(shim.url + "/sleep", headers={"authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert recording.paths() == ["/sleep"]


def test_unknown_paths_get_the_openai_404(
    recording: RecordingUpstream, make_shim: Callable[..., Any]
) -> None:
    shim = make_shim(recording.url)
    for path in ("/foo", "/tokenize/extra", "/v2/other", "/docs", "/openapi.json"):
        response = httpx.get(shim.url + path)
        assert response.status_code == 404, path
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert recording.seen == []


def test_the_shim_keeps_its_own_health_and_ready_and_forwards_the_engines_under_engine(
    recording: RecordingUpstream, make_shim: Callable[..., Any]
) -> None:
    shim = make_shim(recording.url)
    assert httpx.get(shim.url + "/health").json() == {"status": "ok"}
    assert httpx.get(shim.url + "/ready").json()["status"] == "ready"  # probes the engine's /health
    before = len(recording.seen)
    for path, upstream in (("/engine/health", b"/health"), ("/engine/ready", b"/ready")):
        assert httpx.get(shim.url + path).headers["x-upstream-marker"] == "yes"
        assert recording.seen[-1].raw_path == upstream
    assert len(recording.seen) == before + 2


def _post(url: str, path: str, results: dict[str, httpx.Response], **kwargs: Any) -> threading.Thread:
    def run() -> None:
        results[path] = httpx.post(url + path, timeout=30, **kwargs)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_engine_routes_share_the_slots_queue_by_class_and_are_refused_when_full(
    recording: RecordingUpstream, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(recording.url, max_concurrency=1, max_queue=1, max_queue_wait=60)
    results: dict[str, httpx.Response] = {}
    holding = _post(shim.url, "/pooling", results, json={"input": "a"}, headers={"x-hold": "1"})
    waiter(lambda: shim.state()["interactive"] == (1, 0), what="/pooling in flight")
    audio = {"content-type": MULTIPART, "x-request-class": "interactive"}
    queued = _post(shim.url, "/v1/audio/transcriptions", results, content=AUDIO_BODY, headers=audio)
    waiter(lambda: shim.state()["interactive"] == (1, 1), what="the upload queued")

    refused = httpx.post(shim.url + "/rerank", json={"query": "q", "documents": ["d"]})
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert int(refused.headers["retry-after-ms"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert refused.json()["error"]["type"] == "server_overloaded"
    # Cheap routes are never held up by admission.
    assert httpx.post(shim.url + "/tokenize", json={"prompt": "x"}).status_code == 200
    assert httpx.get(shim.url + "/v1/models").status_code == 200

    recording.release()
    holding.join(30)
    queued.join(30)
    assert results["/pooling"].status_code == 200
    assert results["/v1/audio/transcriptions"].status_code == 200
    assert recording.paths() == ["/pooling", "/tokenize", "/v1/models", "/v1/audio/transcriptions"]
    assert recording.seen[-1].body == AUDIO_BODY
    assert shim.state() == {"interactive": (0, 0), "batch": (0, 0)}
    metrics = shim.metrics()

    def outcome(name: str) -> float:
        return sum(
            value
            for (metric, labels), value in metrics.items()
            if metric == "llm_backoff_shim_requests_total"
            and dict(labels) | {"code": ""} == {"class": "interactive", "outcome": name, "code": ""}
        )

    assert (outcome("admitted"), outcome("completed"), outcome("rejected")) == (2, 2, 1)


def test_a_non_json_body_on_a_json_engine_route_is_a_415_and_on_an_upload_route_is_forwarded(
    recording: RecordingUpstream, make_shim: Callable[..., Any]
) -> None:
    shim = make_shim(recording.url)
    refused = httpx.post(shim.url + "/score", content=AUDIO_BODY, headers={"content-type": MULTIPART})
    assert refused.status_code == 415
    json_type = {"content-type": "application/json"}
    bad = httpx.post(shim.url + "/classify", content=b"{not json", headers=json_type)
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_json"
    upload = httpx.post(
        shim.url + "/v1/audio/translations", content=AUDIO_BODY, headers={"content-type": MULTIPART}
    )
    assert upload.status_code == 200
    assert recording.paths() == ["/v1/audio/translations"]


def test_the_rendered_table_names_every_kind() -> None:
    text = render_markdown()
    assert re.search(r"^\| `/sleep` \| POST \| operator: 403 \|", text, re.M)
    assert re.search(r"^\| `/v1/messages` \| POST \| engine: admitted \| anthropic \|", text, re.M)
    assert re.search(r"^\| `/engine/health` \(upstream `/health`\) \| GET \| pass through \|", text, re.M)
