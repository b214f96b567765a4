"""What ``serve`` says at start-up: the one INFO line, the upstream probe, warnings about the
environment (unknown variables, WEB_CONCURRENCY), and that it runs one process."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from llm_backoff_shim.lab import procs
from llm_backoff_shim.serve.command import uvicorn_options
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.values import env_name
from llm_backoff_shim.serve.startup import (
    changed_settings,
    probe_upstream,
    several_workers_warning,
    startup_line,
    unknown_environment,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("LLM_BACKOFF_SHIM_"):
            monkeypatch.delenv(key)


def test_a_misspelled_variable_is_named_with_the_closest_setting() -> None:
    messages = unknown_environment(
        {
            "LLM_BACKOFF_SHIM_MAX_CONCURENCY": "4",
            "llm_backoff_shim_max_queue": "3",  # a setting, in any case
            "LLM_BACKOFF_SHIM_CONFIG": "shim.toml",
            "LLM_BACKOFF_SHIM_ZZZZZZ": "1",
            "PATH": "/bin",
        }
    )
    assert messages == [
        "environment variable LLM_BACKOFF_SHIM_MAX_CONCURENCY names no setting and is ignored; "
        "did you mean LLM_BACKOFF_SHIM_MAX_CONCURRENCY?",
        "environment variable LLM_BACKOFF_SHIM_ZZZZZZ names no setting and is ignored",
    ]


def test_every_setting_and_the_config_variable_are_known() -> None:
    environ = {env_name(name): "x" for name in ShimSettings.model_fields}
    environ["LLM_BACKOFF_SHIM_CONFIG"] = "x"
    assert unknown_environment(environ) == []


def test_serve_runs_one_process_whatever_web_concurrency_says() -> None:
    assert uvicorn_options(ShimSettings())["workers"] == 1
    assert several_workers_warning({}) is None
    assert several_workers_warning({"WEB_CONCURRENCY": "1"}) is None
    warning = several_workers_warning({"WEB_CONCURRENCY": "4"})
    assert warning is not None
    assert warning.startswith("WEB_CONCURRENCY=4 is ignored: serve runs one process per engine")


def test_changed_settings_are_listed_with_secrets_masked() -> None:
    settings = ShimSettings(
        max_concurrency=3,
        api_key="sk-secret",
        redis_url="redis://user:hunter2@10.0.0.1:6379/0",
        class_max_queue={"batch": 5},
        max_queue_wait=2.5,
    )
    changed = changed_settings(settings)
    assert changed == {
        "max_concurrency": "3",
        "max_queue_wait": "2.5",
        "class_max_queue": "batch=5",
        "redis_url": "redis://user:***@10.0.0.1:6379/0",
        "api_key": "***",
    }
    assert changed_settings(ShimSettings()) == {}


def test_the_line_names_listener_path_upstream_limits_and_metrics() -> None:
    settings = ShimSettings(port=9001, max_concurrency=3, class_max_queue={"batch": 5})
    line = startup_line(
        settings,
        path="public",
        metrics_url="http://127.0.0.1:9001/metrics",
        upstream="answered GET /v1/models with 200",
    )
    assert line == (
        "listening on http://127.0.0.1:9001 (public path); upstream http://127.0.0.1:8000 answered GET "
        "/v1/models with 200; max_concurrency 3 (requests counted, no cost budget); queue places/wait: "
        "interactive drained/10 s, batch 5/10 s "
        "(each what the engine drains within its wait); metrics on http://127.0.0.1:9001/metrics; "
        "settings not at their default: port=9001 max_concurrency=3 class_max_queue=batch=5"
    )
    with_total = startup_line(ShimSettings(max_queue=20), path="fast", metrics_url="m", upstream="answered")
    assert "queue places/wait: interactive 20/10 s, batch 20/10 s (20 places in all)" in with_total


def test_the_probe_reports_the_upstreams_answer(upstream: Any) -> None:
    assert probe_upstream(upstream.url) == "answered GET /v1/models with 200"


def test_the_probe_reports_a_refused_connection() -> None:
    port = procs.free_port()
    # The socket is closed: nothing listens on the port.
    result = probe_upstream(f"http://127.0.0.1:{port}")
    assert result.startswith("did not answer GET /v1/models: ConnectionRefusedError")


def test_the_probe_gives_up_on_a_silent_upstream() -> None:
    # Listening, never reading: the connection opens and no answer ever comes.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        result = probe_upstream(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.2)
    assert result.startswith("did not answer GET /v1/models")


def _stderr_lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_serve_logs_one_startup_line_and_warns_about_the_environment(
    upstream: Any, shim_http_path: str
) -> None:
    port = procs.free_port()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLM_BACKOFF_SHIM_")}
    env["LLM_BACKOFF_SHIM_HTTP_PATH"] = shim_http_path  # the run's serving path (conftest)
    env["LLM_BACKOFF_SHIM_MAX_CONCURENCY"] = "5"
    env["WEB_CONCURRENCY"] = "3"  # uvicorn would start 3 workers (or exit): serve runs one, and says so
    argv = ["serve", "--port", str(port), "--upstream", upstream.url, "--max-concurrency", "3"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_backoff_shim.cli", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    try:
        lines = _stderr_lines(proc)
        deadline = time.monotonic() + 30  # bounds a broken test only
        while not any("listening on" in line for line in seen):
            assert time.monotonic() < deadline, f"no start-up line in {seen}"
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, seen
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    warning = next(line for line in seen if "LLM_BACKOFF_SHIM_MAX_CONCURENCY" in line)
    assert " WARNING llm_backoff_shim.serve: " in warning
    assert "LLM_BACKOFF_SHIM_MAX_CONCURENCY names no setting" in warning
    assert "did you mean LLM_BACKOFF_SHIM_MAX_CONCURRENCY?" in warning
    workers = next(line for line in seen if "WEB_CONCURRENCY" in line)
    assert " WARNING llm_backoff_shim.serve: WEB_CONCURRENCY=3 is ignored: " in workers
    [line] = [line for line in seen if "listening on" in line]
    assert " INFO llm_backoff_shim.serve: " in line
    assert f"listening on http://127.0.0.1:{port} ({shim_http_path} path)" in line
    assert f"upstream {upstream.url} answered GET /v1/models with 200" in line
    assert "max_concurrency 3 (requests counted, no cost budget);" in line
    assert f"metrics on http://127.0.0.1:{port}/metrics" in line
    assert f"settings not at their default: upstream={upstream.url} port={port} max_concurrency=3" in line
    assert f"http_path={shim_http_path}" in line
