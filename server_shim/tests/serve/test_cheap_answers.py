"""The cheap paths of refusals and the access log say exactly what the general ones said.

The plain access line is rendered straight from the record, refusal bodies from a template
(remembered by value), and ``serve`` writes access lines in batches from a background
thread: each is checked against the general rendering it replaces, and the
batches against order and completeness (a real ``serve`` child stopped with SIGTERM flushes
every line).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import random
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from llm_backoff_shim.decide.tickets import Rejection
from llm_backoff_shim.lab.procs import ChildServer, cli_command
from llm_backoff_shim.serve.api.rejection import rejection_response
from llm_backoff_shim.serve.log_setup import BatchedLineHandler, LogFormat, logging_config
from llm_backoff_shim.serve.observe.access_log import AccessLog, AccessRecord, _plain


def reference_plain(log: AccessLog, record: AccessRecord, end: float) -> str:
    """The plain line as built from :meth:`AccessLog.fields` (the JSON line's fields, in order)."""
    fields = log.fields(record, end)
    head = f"{fields.pop('time')} {fields.pop('method')} {_plain(fields.pop('path'))}"
    pairs = " ".join(f"{key}={_plain(value)}" for key, value in fields.items() if value is not None)
    return f"{head} {pairs}"


def random_record(rng: random.Random) -> AccessRecord:
    def maybe(value: Any) -> Any:
        return value if rng.random() < 0.6 else None

    arrival = rng.uniform(0, 1e5)
    return AccessRecord(
        method=rng.choice(["POST", "GET"]),
        path=rng.choice(["/v1/chat/completions", "/v1/a b", '/v1/q"=', "/v1/" + "x" * 300]),
        arrival=arrival,
        cls=maybe(rng.choice(["interactive", "batch"])),
        tenant=maybe("3f1a9c0d2b7e"),
        outcome=rng.choice(["completed", "rejected", "bad_request", "client_disconnected"]),
        code=maybe(rng.choice(["queue_full", "invalid_json"])),
        status=maybe(rng.choice([200, 429, 400])),
        body_done=maybe(arrival + rng.random()),
        queue_time=maybe(rng.random() * rng.choice([1, 1e-4, 100])),
        upstream_start=maybe(arrival + rng.random()),
        first_byte=maybe(arrival + rng.random() * 2),
        upstream_end=maybe(arrival + rng.random() * 3),
        retry_after=maybe(rng.random() * 30),
        detail=maybe(rng.choice(["server at capacity: 8 of 8 slots", "x=y z"])),
        request_id=maybe("req-1"),
        client=maybe(rng.choice(["127.0.0.1", "::1"])),
    )


def test_the_plain_line_is_the_one_the_fields_make() -> None:
    rng = random.Random(7)
    log = AccessLog("plain", wall_clock=lambda: 1_700_000_000.123)
    for _ in range(3000):
        record = random_record(rng)
        end = record.arrival + rng.random() * 5
        assert log.render(record, end) == reference_plain(log, record, end)


def test_a_refusal_body_is_the_one_json_dumps_makes() -> None:
    rng = random.Random(3)
    for _ in range(5000):
        retry = rng.choice([rng.random() * 40, 0.0, 1e-9, 2.75, 1234.5678, rng.random() * 1e-3])
        rejection = Rejection(
            code=rng.choice(["queue_full", "queue_timeout"]),
            message=rng.choice(["server at capacity", 'odd "quoted" \u00e9\n', "x"]),
            retry_after=retry,
            queue_depth=rng.randrange(1000),
        )
        whole = max(1, math.ceil(retry - 1e-9))
        expected = {
            "error": {
                "message": f"{rejection.message}, retry in {whole} s",
                "type": rejection.type,
                "param": None,
                "code": rejection.code,
                "retry_after_seconds": round(retry, 3),
                "queue_depth": rejection.queue_depth,
            }
        }
        response = rejection_response(rejection, 429)
        assert response.body == json.dumps(expected, separators=(",", ":")).encode()
        assert dict(response.headers)[b"content-length"] == str(len(response.body)).encode()


def test_a_remembered_refusal_is_a_new_answer_each_time() -> None:
    rejection = Rejection(code="queue_full", message="server at capacity", retry_after=2.5, queue_depth=3)
    first = rejection_response(rejection, 429)
    first.headers.append((b"x-extra", b"1"))  # a caller adding its own header to its answer
    second = rejection_response(rejection, 429)
    assert second is not first
    assert (b"x-extra", b"1") not in second.headers
    assert second.body == first.body
    assert rejection_response(rejection, 503).status == 503


@pytest.mark.parametrize("log_format", ["plain", "json"])
def test_lines_handed_to_the_batched_handler_are_the_lines_render_makes(log_format: LogFormat) -> None:
    rng = random.Random(11)
    stream = io.StringIO()
    handler = BatchedLineHandler(stream, interval=0.001)
    logger = logging.getLogger(f"test_cheap_answers.{log_format}")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    now = [0.0]
    log = AccessLog(log_format, logger=logger, clock=ticking(1.0), wall_clock=lambda: now[0])
    records = [random_record(rng) for _ in range(2000)]
    for i, record in enumerate(records):
        now[0] = 1_700_000_000.0 + i * 0.0137  # each line its own time, read when written
        log.write(record)  # the rendered line handed to the handler, written by its thread
    now[0] = 0.0
    handler.close()
    expected = [
        AccessLog(log_format, wall_clock=lambda i=i: 1_700_000_000.0 + i * 0.0137).render(record, 1.0 + i)
        for i, record in enumerate(records)
    ]
    assert stream.getvalue().split("\n")[:-1] == expected


def ticking(start: float, step: float = 1.0) -> Callable[[], float]:
    """A clock that moves on by ``step`` at each reading."""
    count = itertools.count()
    return lambda: start + next(count) * step


def test_batched_lines_keep_their_order_and_close_writes_the_rest() -> None:
    stream = io.StringIO()
    handler = BatchedLineHandler(stream, interval=0.001)
    done = threading.Event()

    def writer(prefix: str) -> None:
        for i in range(20_000):
            handler.write_line(f"{prefix}{i}")
        done.set()

    thread = threading.Thread(target=writer, args=("a",))
    thread.start()
    thread.join()
    assert done.is_set()
    handler.close()
    lines = stream.getvalue().split("\n")
    assert lines[-1] == ""  # every line ends in a newline
    assert lines[:-1] == [f"a{i}" for i in range(20_000)]
    handler.write_line("after close")  # written at once: no thread left to wait for
    assert stream.getvalue().endswith("after close\n")


def test_serve_installs_the_batched_handler_for_access_lines() -> None:
    config = logging_config("plain")
    assert config["handlers"]["access"]["()"].endswith("BatchedLineHandler")
    assert config["handlers"]["access"]["stream"] == "ext://sys.stdout"


def test_serve_writes_every_line_in_order_and_flushes_them_at_shutdown(upstream: Any) -> None:
    flags = ["--upstream", upstream.url, "--log-format", "json", "--host", "127.0.0.1"]
    with (
        ChildServer(
            "shim", lambda port: cli_command("serve", *flags, "--port", str(port)), start_timeout=60
        ) as shim,
        httpx.Client(timeout=10) as client,
    ):
        for i in range(300):
            answer = client.get(shim.url + "/v1/models", headers={"x-request-id": f"r{i}"})
            assert answer.status_code == 200
        shim.stop()  # SIGTERM: the last batch must still be written
        output = shim.log_tail(1_000_000)
    ids = [line["request_id"] for line in map(json.loads, output.splitlines()) if "outcome" in line]
    assert ids == [f"r{i}" for i in range(300)]
