"""Settings from flags and LLM_BACKOFF_SHIM_* variables, and the CLI dispatcher."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llm_backoff_shim import cli
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.serve.config.values import ConfigError
from llm_backoff_shim.serve.serving import free_socket


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("LLM_BACKOFF_SHIM_"):
            monkeypatch.delenv(key)


def test_defaults_match_the_issue_example() -> None:
    s = load_settings([])
    assert (s.max_concurrency, s.max_queue, s.max_queue_wait) == (8, None, 10.0)
    assert (s.reject_status, s.retry_after_min, s.retry_after_max) == (429, 1.0, 30.0)
    assert s.upstream_base == "http://127.0.0.1:8000"


def test_flags_are_read_and_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_BACKOFF_SHIM_MAX_QUEUE", "50")
    monkeypatch.setenv("LLM_BACKOFF_SHIM_REJECT_STATUS", "503")
    s = load_settings(["--max-queue", "7", "--upstream", "http://10.0.0.5:9000/", "--max-queue-wait", "2.5"])
    assert s.max_queue == 7
    assert s.reject_status == 503
    assert s.max_queue_wait == 2.5
    assert s.upstream_base == "http://10.0.0.5:9000"


def test_the_cost_budget_is_off_by_default_and_read_from_every_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert load_settings([]).max_inflight_tokens is None
    config = tmp_path / "shim.toml"
    config.write_text("max_inflight_tokens = 12000\n", encoding="utf-8")
    assert load_settings(["--config", str(config)]).max_inflight_tokens == 12000
    monkeypatch.setenv("LLM_BACKOFF_SHIM_MAX_INFLIGHT_TOKENS", "16000")
    assert load_settings(["--config", str(config)]).max_inflight_tokens == 16000
    assert load_settings(["--max-inflight-tokens", "20000"]).max_inflight_tokens == 20000
    with pytest.raises(ConfigError, match="--max-inflight-tokens=0"):
        load_settings(["--max-inflight-tokens", "0"])


def test_class_limits_default_to_the_shared_ones() -> None:
    s = load_settings(
        ["--max-queue", "9", "--class-max-queue", "batch=2", "--class-max-queue-wait", "interactive=1"]
    )
    limits = s.class_limits()
    assert list(limits) == ["interactive", "batch"]
    assert (limits["interactive"].max_queue, limits["interactive"].max_queue_wait) == (9, 1.0)
    assert (limits["batch"].max_queue, limits["batch"].max_queue_wait) == (2, 10.0)


def test_per_class_values_have_one_syntax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = load_settings(["--class-max-queue", "interactive=8,batch=32", "--class-max-queue-wait", "batch=60"])
    assert s.class_max_queue == {"interactive": 8, "batch": 32}
    assert s.class_limits()["batch"].max_queue_wait == 60.0
    monkeypatch.setenv("LLM_BACKOFF_SHIM_CLASS_MAX_QUEUE", "batch=lots")
    with pytest.raises(ConfigError, match=r"LLM_BACKOFF_SHIM_CLASS_MAX_QUEUE batch=lots: Input should be"):
        load_settings([])
    with pytest.raises(ConfigError, match=r"--class-max-queue-wait interactive=inf: "):
        load_settings(["--class-max-queue", "batch=1", "--class-max-queue-wait", "interactive=inf"])


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--max-concurrency", "0"], {}, "--max-concurrency=0: Input should be greater than or equal to 1"),
        (["--reject-status", "500"], {}, "--reject-status=500"),
        ([], {"LLM_BACKOFF_SHIM_MAX_QUEUE": "lots"}, "LLM_BACKOFF_SHIM_MAX_QUEUE=lots"),
        (["--retry-after-min", "5", "--retry-after-max", "2"], {}, "retry_after_max (2.0) must be >="),
        (["--upstream", "ftp://x"], {}, "--upstream=ftp://x"),
        (["--upstream", "http://h:1/v1"], {}, "without a path"),
        (["--max-queue-wait", "nan"], {}, "--max-queue-wait=nan"),
        (["--max-queue-wait", "inf"], {}, "--max-queue-wait=inf"),
        (["--max-concurrency", "true"], {}, "--max-concurrency=true: Input should be a valid integer"),
        ([], {"LLM_BACKOFF_SHIM_MAX_CONCURRENCY": "true"}, "LLM_BACKOFF_SHIM_MAX_CONCURRENCY=true: Input"),
        (
            [],
            {"LLM_BACKOFF_SHIM_CLASS_MAX_QUEUE": '{"batch": true}'},
            "LLM_BACKOFF_SHIM_CLASS_MAX_QUEUE batch=True: expected a number, got the boolean true",
        ),
    ],
)
def test_invalid_values_give_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], expected: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as info:
        load_settings(argv)
    message = str(info.value)
    assert message.startswith("invalid configuration: ")
    assert expected in message
    assert "\n" not in message


def test_booleans_are_true_or_false_and_numbers_are_numbers() -> None:
    s = load_settings(["--access-log", "0", "--forward-priority", "--engine-metrics", "yes"])
    assert (s.access_log, s.forward_priority, s.engine_metrics) == (False, True, True)
    with pytest.raises(ValueError, match="expected a number, got the boolean true"):
        ShimSettings(max_concurrency=True)
    with pytest.raises(ValueError, match="expected true or false, got the number 1"):
        ShimSettings(access_log=1)


def test_settings_are_immutable() -> None:
    s = ShimSettings()
    with pytest.raises(ValueError):  # noqa: PT011 - pydantic's frozen-instance error
        s.max_queue = 3  # type: ignore[misc]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_BACKOFF_SHIM_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "llm_backoff_shim.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=full_env,
        check=False,
    )


def test_serve_help_explains_the_common_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--upstream", "--max-concurrency", "--max-queue", "--max-queue-wait", "--reject-status"):
        assert flag in out
    assert "LLM_BACKOFF_SHIM_RETRY_AFTER_MAX" in out
    assert "most generation requests in flight upstream at once" in out


def test_serve_with_bad_value_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--max-queue", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert err.startswith("llm-backoff-shim serve: invalid configuration: --max-queue=-1")


def test_serve_with_bad_env_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LLM_BACKOFF_SHIM_RETRY_AFTER_MIN", "0")
    assert cli.main(["serve"]) == 2
    assert "LLM_BACKOFF_SHIM_RETRY_AFTER_MIN=0" in capsys.readouterr().err


def test_dispatcher_usage_and_unknown_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert "unknown subcommand 'frobnicate'" in capsys.readouterr().err


def test_version_prints_the_distributions_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"llm-backoff-shim {importlib.metadata.version('llm-backoff-shim')}\n"
    assert cli.main(["-V"]) == 0
    assert capsys.readouterr().out.startswith("llm-backoff-shim ")


@pytest.mark.parametrize(
    ("subcommand", "argv"),
    [
        ("serve", ["--max-conc", "3"]),
        ("serve", ["--help-a"]),
        ("sim", ["--max-num", "3"]),
        ("demo", ["--qui"]),
        ("calibrate", ["--upstream", "http://127.0.0.1:9", "--max-sec", "30"]),
    ],
)
def test_no_subcommand_takes_an_abbreviated_flag(
    subcommand: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([subcommand, *argv])
    assert info.value.code == 2
    assert (
        f"unrecognized arguments: {argv[-2] if argv[-1].isdigit() else argv[-1]}" in capsys.readouterr().err
    )


def test_dispatcher_reaches_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["sim", "--help"])
    assert info.value.code == 0
    assert "--max-num-seqs" in capsys.readouterr().out


def test_console_script_exits_2_without_traceback() -> None:
    result = run_cli("serve", "--reject-status", "500")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--reject-status=500" in result.stderr


def test_serve_starts_and_answers_health_and_metrics_port() -> None:
    with free_socket() as a, free_socket() as b:
        port, metrics_port = a.getsockname()[1], b.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_BACKOFF_SHIM_")}
    env["LLM_BACKOFF_SHIM_METRICS_PORT"] = str(metrics_port)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llm_backoff_shim.cli",
            "serve",
            "--port",
            str(port),
            "--upstream",
            "http://127.0.0.1:9",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.05)
        assert health.json() == {"status": "ok"}
        assert "server" not in health.headers
        assert "date" not in health.headers
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
        assert ready.status_code == 503
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert "llm_backoff_shim_queue_depth" in metrics
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    # Nothing listens on port 9: the start-up line says so, and serve started all the same.
    assert "upstream http://127.0.0.1:9 did not answer GET /v1/models: " in err
    assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in err


def _option_helps(text: str) -> dict[str, str]:
    """Each option's entry in a --help text (its lines joined), by the option's first flag."""
    entries: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--help"],
        ["serve", "--help-all"],
        ["sim", "--help"],
        ["demo", "--help"],
        ["calibrate", "--help"],
    ],
)
def test_every_help_states_each_default_once(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    helps = _option_helps(capsys.readouterr().out)
    assert len(helps) > 3
    for flag, text in helps.items():
        stated = re.findall(r"\(default\b|; default\b", text)
        assert len(stated) <= 1, f"{' '.join(argv)}: {flag} states its default {len(stated)} times: {text}"
