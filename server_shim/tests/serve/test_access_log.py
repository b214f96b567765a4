"""The shim's one line per request: rendering, and real requests through a live shim.

End-to-end tests run the shim on loopback in front of the fake upstream and read the
``llm_backoff_shim.access`` records with caplog; one test runs ``serve`` as a child
process with ``--log-format json`` and parses its output.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from llm_backoff_shim.decide.tenants import key_hash
from llm_backoff_shim.lab.procs import ChildServer, cli_command
from llm_backoff_shim.serve.log_setup import LOGGER_NAME, JsonFormatter
from llm_backoff_shim.serve.observe.access_log import AccessLog, AccessRecord, json_records, request_id

SECRET = "sk-very-secret-key-123"
PROMPT = "PROMPT-MARKER-tell-me-a-secret"
CHAT = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}


def clocks(*values: float) -> Callable[[], float]:
    it = iter(values)
    return lambda: next(it)


# -- rendering -----------------------------------------------------------------------


def completed_record() -> AccessRecord:
    return AccessRecord(
        method="POST",
        path="/v1/chat/completions",
        arrival=100.0,
        cls="interactive",
        tenant="3f1a9c0d2b7e",
        outcome="completed",
        status=200,
        body_done=100.1,
        queue_time=0.25,
        upstream_start=100.3,
        first_byte=100.5,
        upstream_end=101.8,
        request_id="req-1",
        client="127.0.0.1",
    )


def test_json_line_has_every_field() -> None:
    log = AccessLog("json", wall_clock=lambda: 1_700_000_000.0)
    data = json.loads(log.render(completed_record(), end=102.0))
    assert data == {
        "time": "2023-11-14T22:13:20.000+00:00",
        "method": "POST",
        "path": "/v1/chat/completions",
        "class": "interactive",
        "outcome": "completed",
        "code": None,
        "status": 200,
        "body_ms": 100.0,
        "queue_ms": 250.0,
        "ttfb_ms": 500.0,
        "upstream_ms": 1500.0,
        "total_ms": 2000.0,
        "retry_after_s": None,
        "detail": None,
        "tenant": "3f1a9c0d2b7e",
        "request_id": "req-1",
        "client": "127.0.0.1",
    }


def test_plain_line_is_key_value_and_skips_empty_fields() -> None:
    log = AccessLog("plain", wall_clock=lambda: 1_700_000_000.0)
    record = AccessRecord(
        method="POST",
        path="/v1/chat/completions",
        arrival=10.0,
        cls="batch",
        outcome="rejected",
        code="queue_full",
        status=429,
        queue_time=0.0,
        retry_after=2.75,
    )
    line = log.render(record, end=10.002)
    assert line == (
        "2023-11-14T22:13:20.000+00:00 POST /v1/chat/completions class=batch outcome=rejected "
        "code=queue_full status=429 queue_ms=0.0 total_ms=2.0 retry_after_s=2.75"
    )


def test_plain_quotes_what_would_break_key_value_parsing() -> None:
    log = AccessLog("plain", wall_clock=lambda: 0.0)
    line = log.render(
        AccessRecord(method="GET", path='/v1/a b"c=d', arrival=0.0, outcome="bad_request"), end=0.0
    )
    assert ' "/v1/a b\\"c=d" class=- outcome=bad_request' in line


def test_request_ids_are_kept_only_when_plain_tokens() -> None:
    assert request_id(b"  abc-123_X.y:z  ") == "abc-123_X.y:z"
    assert request_id(None) is None
    assert request_id(b"has space") is None
    assert request_id(b"evil\x1b[2J") is None
    assert request_id(b"x" * 129) is None


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="plain"):
        AccessLog("xml")  # type: ignore[arg-type]


def test_json_formatter_for_other_lines() -> None:
    record = logging.LogRecord(
        "llm_backoff_shim.x", logging.WARNING, __file__, 1, "tenant %s over quota", ("a",), None
    )
    data = json.loads(JsonFormatter().format(record))
    assert (data["level"], data["logger"], data["message"]) == (
        "warning",
        "llm_backoff_shim.x",
        "tenant a over quota",
    )


# -- through a live shim -------------------------------------------------------------


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Parsed access lines so far (the shims under test log JSON)."""
    caplog.set_level(logging.DEBUG)  # every logger at DEBUG: nothing secret may appear anywhere

    def lines() -> list[dict[str, Any]]:
        return [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]

    yield lines
    text = caplog.text
    assert SECRET not in text
    assert PROMPT not in text


def chat(url: str, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {SECRET}", **headers},
        timeout=10,
    )


def test_a_body_written_after_its_head_shows_in_body_ms(
    upstream: Any,
    make_shim: Callable[..., Any],
    waiter: Callable[..., None],
    access: Callable[[], list[dict[str, Any]]],
) -> None:
    shim = make_shim(upstream.url, log_format="json", tenant_requests_per_minute=10_000)
    body = json.dumps(CHAT).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {SECRET}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    host, port = shim.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(0.5)  # the body comes later, as a busy client's would
        sock.sendall(body)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    waiter(lambda: len(access()) == 1, what="one access line")
    (line,) = access()
    # The gap is the client's, and shows in body_ms (arrival is stamped once the head has been
    # parsed, a little after it was written: hence half the gap, not all of it).
    assert line["body_ms"] >= 250
    assert line["body_ms"] <= line["ttfb_ms"] <= line["total_ms"]


def test_one_line_per_request(
    upstream: Any,
    make_shim: Callable[..., Any],
    waiter: Callable[..., None],
    access: Callable[[], list[dict[str, Any]]],
) -> None:
    shim = make_shim(upstream.url, log_format="json", tenant_requests_per_minute=10_000)
    assert chat(shim.url, **{"x-request-id": "abc-1"}).status_code == 200
    assert chat(shim.url, **{"x-fake-status": "500", "x-request-class": "batch"}).status_code == 500
    assert httpx.get(shim.url + "/v1/models", timeout=10).status_code == 200
    bad = httpx.post(
        shim.url + "/v1/chat/completions",
        content=b"{not json " + PROMPT.encode(),
        headers={"Authorization": f"Bearer {SECRET}", "content-type": "application/json"},
        timeout=10,
    )
    assert bad.status_code == 400
    waiter(lambda: len(access()) == 4, what="four access lines")
    ok, failed, models, malformed = access()

    assert ok["class"] == "interactive"
    assert (ok["outcome"], ok["status"], ok["code"]) == ("completed", 200, None)
    assert ok["tenant"] == key_hash(SECRET)
    assert ok["request_id"] == "abc-1"
    assert ok["client"] == "127.0.0.1"
    assert ok["path"] == "/v1/chat/completions"
    assert ok["method"] == "POST"
    for name in ("body_ms", "queue_ms", "ttfb_ms", "upstream_ms", "total_ms"):
        assert ok[name] >= 0
    # The parts fit inside the whole, and the body was read before anything went upstream.
    assert ok["upstream_ms"] <= ok["total_ms"]
    assert ok["queue_ms"] <= ok["total_ms"]
    assert ok["body_ms"] <= ok["ttfb_ms"]

    assert (failed["class"], failed["outcome"], failed["status"]) == ("batch", "upstream_error", 500)
    assert (models["class"], models["outcome"], models["status"], models["queue_ms"]) == (
        "-",
        "completed",
        200,
        None,
    )
    assert models["tenant"] is None
    assert (malformed["outcome"], malformed["code"], malformed["status"]) == (
        "bad_request",
        "invalid_json",
        400,
    )
    assert malformed["upstream_ms"] is None


def test_rejection_and_disconnect_lines(
    upstream: Any,
    make_shim: Callable[..., Any],
    waiter: Callable[..., None],
    access: Callable[[], list[dict[str, Any]]],
) -> None:
    shim = make_shim(upstream.url, log_format="json", max_concurrency=1, max_queue=0)
    # The first request holds the only slot until it is released.
    with httpx.Client(timeout=10) as held:
        answers: list[int] = []
        t = threading.Thread(
            target=lambda: answers.append(chat(shim.url, **{"x-fake-hold": "1"}).status_code)
        )
        t.start()
        waiter(lambda: upstream.in_flight == 1, what="the held request upstream")
        rejected = chat(shim.url)
        assert rejected.status_code == 429
        # A client that gives up while its request is upstream.
        with pytest.raises(httpx.ReadTimeout):
            held.post(
                shim.url + "/v1/other/x",
                json=CHAT,
                headers={"x-fake-hold": "1", "Authorization": f"Bearer {SECRET}"},
                timeout=httpx.Timeout(10, read=0.2),
            )
        waiter(
            lambda: any(line["outcome"] == "client_disconnected" for line in access()), what="disconnect line"
        )
        upstream.release()
        t.join(10)
    assert answers == [200]
    waiter(lambda: len(access()) == 3, what="three access lines")
    by_outcome = {line["outcome"]: line for line in access()}
    rejection = by_outcome["rejected"]
    assert (rejection["code"], rejection["status"], rejection["class"]) == ("queue_full", 429, "interactive")
    assert rejection["retry_after_s"] == pytest.approx(
        float(rejected.json()["error"]["retry_after_seconds"]), abs=0.01
    )
    assert rejection["upstream_ms"] is None
    # Why, in the shim's words: the client's error message starts with it (", retry in N s" follows).
    assert rejection["detail"]
    assert rejected.json()["error"]["message"].startswith(rejection["detail"])
    gone = by_outcome["client_disconnected"]
    assert (gone["path"], gone["class"], gone["status"]) == ("/v1/other/x", "-", None)  # left before the head
    assert 0 <= gone["upstream_ms"] <= gone["total_ms"]
    assert by_outcome["completed"]["status"] == 200
    assert by_outcome["completed"]["detail"] is None


def test_access_log_can_be_turned_off(
    upstream: Any, make_shim: Callable[..., Any], access: Callable[[], list[dict[str, Any]]]
) -> None:
    shim = make_shim(upstream.url, access_log=False)
    assert chat(shim.url).status_code == 200
    assert access() == []


def test_plain_lines_from_a_live_shim(
    upstream: Any,
    make_shim: Callable[..., Any],
    waiter: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    shim = make_shim(upstream.url)  # plain is the default
    assert chat(shim.url).status_code == 200
    waiter(lambda: any(r.name == LOGGER_NAME for r in caplog.records), what="an access line")
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert " POST /v1/chat/completions class=interactive outcome=completed status=200 " in line
    for name in ("queue_ms=", "ttfb_ms=", "upstream_ms=", "total_ms="):
        assert name in line
    assert SECRET not in line
    assert PROMPT not in line


def test_serve_writes_json_lines(upstream: Any) -> None:
    """The real ``serve`` command: access lines and uvicorn's own lines are all JSON objects."""
    flags = ["--upstream", upstream.url, "--log-format", "json", "--host", "127.0.0.1"]
    with ChildServer(
        "shim", lambda port: cli_command("serve", *flags, "--port", str(port)), start_timeout=60
    ) as shim:
        assert chat(shim.url, **{"x-request-id": "from-test"}).status_code == 200
        assert httpx.get(shim.url + "/health", timeout=10).status_code == 200
        shim.stop()  # flushes and ends the output
        output = shim.log_tail(100_000)
    lines = [json.loads(line) for line in output.splitlines() if line.strip()]
    access_lines = [line for line in lines if "outcome" in line]
    assert len(access_lines) == 1  # /health is not a /v1/ request; uvicorn's access log is off
    assert access_lines[0]["request_id"] == "from-test"
    assert access_lines[0]["status"] == 200
    assert any(line.get("logger", "").startswith("uvicorn") for line in lines)
    assert SECRET not in output
    assert PROMPT not in output


def test_timestamps_match_datetime_within_and_across_seconds() -> None:
    from datetime import datetime, timezone

    now = [0.0]
    log = AccessLog("json", wall_clock=lambda: now[0])
    times = [1_700_000_000.0, 1_700_000_000.4567, 1_700_000_000.9996, 1_700_000_001.001, 1_699_999_999.5]
    times += [1_700_000_000 + i / 997 for i in range(2000)]  # many fractions, many seconds
    for t in times:
        now[0] = t
        expected = datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")
        assert (
            json.loads(log.render(AccessRecord(method="GET", path="/v1/x", arrival=0.0), end=0.0))["time"]
            == expected
        )


def test_json_records_reads_access_lines_and_skips_everything_else() -> None:
    log = AccessLog("json", clock=lambda: 2.0, wall_clock=lambda: 1_700_000_000.0)
    line = log.render(AccessRecord(method="POST", path="/v1/x", arrival=1.0, outcome="completed"), end=2.0)
    text = "\n".join(["INFO started", line, "{not json", "[1, 2]", line])
    records = list(json_records(text))
    assert len(records) == 2
    assert records[0]["outcome"] == "completed"
    assert records[0]["total_ms"] == 1000.0
