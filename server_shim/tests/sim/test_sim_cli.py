"""``llm-backoff-shim sim``: flags, validation messages, and a real process on loopback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from llm_backoff_shim.lab import procs
from llm_backoff_shim.sim.profiles import PROFILES
from llm_backoff_shim.sim.server import config_from_args, main, parse_args

FLAGS = [
    "--profile",
    "--host",
    "--port",
    "--model",
    "--max-num-seqs",
    "--max-num-queued-reqs",
    "--ttft",
    "--itl",
    "--itl-batch-factor",
    "--output-tokens",
    "--output-tokens-sigma",
    "--output-tokens-max",
    "--prefill-time-per-token",
    "--prefill-attention-time",
    "--admit-time",
    "--decode-attention-time",
    "--max-num-batched-tokens",
    "--kv-cache-tokens",
    "--error-rate",
    "--reset-rate",
    "--slow-first-byte-rate",
    "--slow-first-byte-delay",
    "--stream-cut-rate",
    "--seed",
]


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: llm-backoff-shim sim")
    for flag in FLAGS:
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs: Input should be greater than or equal to 1"),
        (["--itl", "-1"], "--itl: Input should be greater than or equal to 0"),
        (["--error-rate", "2"], "--error-rate: Input should be less than or equal to 1"),
        (["--error-rate", "0.6", "--reset-rate", "0.6"], "error_rate + reset_rate must not exceed 1"),
        (["--max-num-queued-reqs", "0"], "--max-num-queued-reqs"),
        (["--port", "70000"], "--port"),
        (["--kv-cache-tokens", "1"], "--kv-cache-tokens"),
        (["--output-tokens", "50", "--output-tokens-max", "10"], "output_tokens_max must be >= output"),
        (["--prefill-time-per-token", "-1"], "--prefill-time-per-token"),
    ],
)
def test_invalid_values_stop_with_exit_2_and_one_clear_line(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("llm-backoff-shim sim: invalid configuration: ")
    assert fragment in err
    assert "Traceback" not in err
    assert err.count("\n") == 1


def test_unparsable_values_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--ttft", "fast"])
    assert info.value.code == 2
    assert "--ttft" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_profile_sets_the_engine_and_a_given_flag_wins(name: str) -> None:
    profile = PROFILES[name]
    config = config_from_args(parse_args(["--profile", name]))
    for key, value in profile.defaults.items():
        assert getattr(config, key) == value
    tuned = config_from_args(parse_args(["--max-num-seqs", "64", "--profile", name]))
    assert tuned.max_num_seqs == 64
    assert tuned.itl == profile.defaults["itl"]
    assert config_from_args(parse_args([])).max_num_seqs == 8


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_profile_is_a_gpu_box(name: str) -> None:
    """The issue's GPU box: 128-256 sequences and a few thousand tokens/s with all of them running."""
    profile = PROFILES[name]
    seqs = profile.defaults["max_num_seqs"]
    assert isinstance(seqs, int)
    assert 128 <= seqs <= 256
    assert 2000 <= profile.decode_tokens_per_s(seqs) <= 8000
    assert profile.decode_tokens_per_s(seqs) > 10 * profile.decode_tokens_per_s(1)
    assert profile.defaults["kv_cache_tokens"] is not None


def test_an_unknown_profile_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--profile", "tpu"])
    assert info.value.code == 2
    assert "--profile" in capsys.readouterr().err


def _free_port() -> int:
    return procs.free_port()


def test_the_command_serves_openai_clients_without_server_or_date_headers() -> None:
    port = _free_port()
    argv = [
        "--port", str(port), "--ttft", "0.01", "--itl", "0.002", "--output-tokens", "3",
        "--output-tokens-sigma", "0", "--model", "cli",
    ]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "llm_backoff_shim.sim.server", *argv])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, "simulator exited early"
            assert time.monotonic() < deadline, "simulator did not start"
            time.sleep(0.05)

        response = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 200
        assert "server" not in response.headers
        assert "date" not in response.headers
        assert response.json()["choices"][0]["text"] == "token0 token1 token2"

        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["cli"]
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    # uvicorn shuts down gracefully, then re-raises the signal it caught (recent versions).
    assert proc.returncode in (0, -signal.SIGTERM)
