"""``calibrate --write-config``: the recommendation as a file ``serve --config`` runs with."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llm_backoff_shim.lab import calibrate, procs
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app


def test_the_written_file_loads_and_serves_with_the_recommendation(tmp_path: Path) -> None:
    config = tmp_path / "shim.toml"
    sim_config = SimConfig(max_num_seqs=2, ttft=0.1, itl=0.01, output_tokens=5, seed=1)
    with ServerThread(create_sim_app(sim_config)) as sim:
        out, err = io.StringIO(), io.StringIO()
        argv = ["--upstream", sim.url, "--ttft-slo", "3", "--tpot-slo", "none", "--steps", "1,8",
                "--step-seconds", "0.5", "--prompt-words", "10", "--output-tokens", "5",
                "--out", str(tmp_path), "--json", "--write-config", str(config)]  # fmt: skip
        assert calibrate.main(argv, stdout=out, stderr=err) == 0, err.getvalue()
        rec = json.loads(out.getvalue())["recommendation"]
        assert f"wrote {config}" in err.getvalue()
        text = config.read_text(encoding="utf-8")
        assert text.startswith(
            "# llm-backoff-shim serve --config FILE: recommended by llm-backoff-shim calibrate"
        )
        # Only the recommendation is set; every other setting is there, commented out.
        set_keys = {line.split(" = ")[0] for line in text.splitlines() if " = " in line and line[0] != "#"}
        expected = {"upstream", "max_concurrency", "max_queue_wait", "retry_after_max"}
        # The cost budget is set where the shim has the cost-aware cap, else named in the header.
        if "max_inflight_tokens" in ShimSettings.model_fields:
            expected.add("max_inflight_tokens")
        else:
            assert f"--max-inflight-tokens {rec['max_inflight_tokens']}" in text
        assert set_keys == expected
        assert "# upstream_read_timeout = 600.0" in text
        settings = load_settings(["--config", str(config)])
        assert settings.upstream_base == sim.url
        assert (settings.max_concurrency, settings.max_queue, settings.max_queue_wait) == (
            rec["max_concurrency"],
            None,
            rec["max_queue_wait"],
        )
        # The batch class is held: its own wait, in its [classes.batch] table; each class's queue
        # is what the engine drains within its wait (no bound set).
        limits = settings.class_limits()
        assert limits["interactive"].max_queue is None
        assert (limits["batch"].max_queue, limits["batch"].max_queue_wait) == (
            None,
            rec["batch_max_queue_wait"],
        )
        assert settings.retry_after_max == rec["retry_after_max"]
        assert settings.max_inflight_tokens == rec["max_inflight_tokens"]
        assert (
            settings.model_copy(
                update={
                    "upstream": ShimSettings().upstream,
                    "max_concurrency": 8,
                    "max_queue_wait": 10.0,
                    "class_max_queue_wait": {},
                    "retry_after_max": ShimSettings().retry_after_max,
                    "max_inflight_tokens": None,
                }
            )
            == ShimSettings()
        )
        # The real command runs with it: its limit is the recommendation, its upstream the simulator.
        port = procs.free_port()
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLM_BACKOFF_SHIM_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "llm_backoff_shim.cli", "serve", "--config", str(config), "--port", str(port)],  # noqa: E501
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while True:
                try:
                    httpx.get(base + "/health", timeout=1)
                    break
                except httpx.TransportError:
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "serve did not come up"
                    time.sleep(0.05)
            assert httpx.get(base + "/shim/state", timeout=5).json()["limit"] == rec["max_concurrency"]
            answer = httpx.post(
                base + "/v1/chat/completions",
                json={"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                timeout=10,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
        finally:
            proc.terminate()
            proc.communicate(timeout=15)


def test_an_unwritable_config_path_is_reported_and_the_status_is_1(tmp_path: Path) -> None:
    sim_config = SimConfig(max_num_seqs=2, ttft=0.05, itl=0.01, output_tokens=3, seed=1)
    target = tmp_path / "missing-dir" / "shim.toml"
    with ServerThread(create_sim_app(sim_config)) as sim:
        out, err = io.StringIO(), io.StringIO()
        argv = ["--upstream", sim.url, "--ttft-slo", "3", "--tpot-slo", "none", "--steps", "2",
                "--step-seconds", "1", "--prompt-words", "5", "--output-tokens", "3", "--out", str(tmp_path),
                "--write-config", str(target)]  # fmt: skip
        assert calibrate.main(argv, stdout=out, stderr=err) == 1
    assert f"cannot write {target}" in err.getvalue()
    assert "llm-backoff-shim serve" in out.getvalue()  # the result is still printed
    assert not target.exists()
