"""``llm-backoff-shim fleet``: the one-command loopback fleet starts, serves through the load
balancer, and stops everything it started on SIGTERM (as on Ctrl-C)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from llm_backoff_shim.lab import procs
from llm_backoff_shim.lab.fleet import main
from llm_backoff_shim.lab.fleet_configs import lb_binary

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("lb", ["nginx", "haproxy"])
def test_the_fleet_command_serves_and_stops_cleanly(lb: str) -> None:
    if lb_binary(lb) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{lb} is not installed, and CI must run this test")
        pytest.skip(f"{lb} is not installed")
    argv = procs.cli_command(
        "fleet", "--replicas", "2", "--lb", lb, "--sim-flag=--ttft 0 --itl 0.001", "--shim-flag=--max-queue 4"
    )
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(lines)
        found = re.search(r"load balancer \(" + lb + r"\): (\S+)/v1", text)
        assert found, text
        lb_url = found.group(1)
        shims = re.findall(r"shim (http://\S+)", text)
        assert len(shims) == 2, text
        response = httpx.post(
            f"{lb_url}/v1/chat/completions",
            json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        for shim in shims:
            # /ready probes the engine behind the shim: on a loaded machine that can take longer
            # than is_healthy's half second, so wait for the answer itself.
            ready = httpx.get(f"{shim}/ready", timeout=10)
            assert ready.status_code == 200, ready.text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0
    # Everything it started is gone.
    assert not procs.is_healthy(f"{lb_url}/lb/health")
    for shim in shims:
        assert not procs.is_healthy(f"{shim}/health")


def test_unknown_load_balancer_and_bad_flags_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--lb", "envoy"])
    assert "invalid choice" in capsys.readouterr().err
    assert main(["--replicas", "0"]) == 2
    assert "at least one replica" in capsys.readouterr().err
