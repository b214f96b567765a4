"""``llm-backoff-shim demo --quick`` end to end: real child servers, real clients, a table, a PNG.

No timing thresholds: the checks are that the printed tables and the JSON agree,
that the figures are consistent with each other, and that the PNG is a real image.
"""

from __future__ import annotations

import json
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from llm_backoff_shim.lab import demo
from llm_backoff_shim.lab.calibrate.measure import HELD_RETRY_AFTER_MAX
from llm_backoff_shim.lab.scenario import DEMO_SETUPS, DEMO_SHAPE, varied_demo_scenario
from llm_backoff_shim.serve.config.sources import load_settings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run_demo(*args: str, timeout: float = 110.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llm_backoff_shim.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("demo")
    return _run_demo("--quick", "--out", str(out)), out


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"
    return width, height


def test_quick_demo_prints_a_table_per_configuration_and_writes_a_png(
    quick_demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, out = quick_demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    stdout = proc.stdout
    assert "requests/s (" in stdout
    # The load line names the arrival rate the calls were drawn at: twice the capacity.
    capacity = float(stdout.split("capacity ", 1)[1].split(" requests/s", 1)[0])
    rate = float(stdout.split("Poisson 2x capacity (", 1)[1].split("/s)", 1)[0])
    assert rate == pytest.approx(2 * capacity, abs=0.06)
    assert "answer tokens/s)" in stdout
    assert "max_tokens lognormal:64:0.8:1-512, ignore_eos" in stdout  # varied lengths by default
    for setup in DEMO_SETUPS:
        assert f"== {setup.label} ==" in stdout
    assert "Summary (same load, same seed, three configurations):" in stdout
    # Progress went to stderr while the runs were going.
    assert "started" in proc.stderr
    assert "HTTP attempts" in proc.stderr
    png = out / demo.PNG_NAME
    assert f"Plot: {png.resolve()}" in stdout
    width, height = _png_size(png)
    assert width > 600
    assert height > 600


def test_quick_demo_figures_are_consistent(quick_demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = quick_demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / demo.JSON_NAME).read_text())
    runs: list[dict[str, Any]] = data["runs"]
    assert [r["label"] for r in runs] == [s.label for s in DEMO_SETUPS]
    # The reading under the summary quotes the same figures.
    direct, plain = runs[0], runs[1]
    said = " ".join(proc.stdout.split("Reading it:", 1)[1].split())
    assert said.startswith(
        f"through the shim, plain openai gets {plain['interactive_within_budget']} interactive calls "
        f"within budget against {direct['interactive_within_budget']} straight at the engine"
    ), said
    calls = {r["calls"] for r in runs}
    assert len(calls) == 1, "every configuration must face the same load"
    deadline = data["scenario"]["deadline"]
    for r in runs:
        label = r["label"]
        assert r["ok"] + r["failed_fast"] + r["failed_deadline"] == r["calls"], label
        assert 0 <= r["deadline_while_served"] <= r["failed_deadline"], label
        assert sum(r["errors"].values()) == r["calls"] - r["ok"], label
        assert r["success_rate"] == pytest.approx(r["ok"] / r["calls"]), label
        # Every call made at least one HTTP attempt; the rest are retries.
        assert r["attempts"] == r["calls"] + r["retries"], label
        assert r["retry_wave"] <= r["retries"], label
        if r["ok"]:
            assert r["attempts_per_success"] == pytest.approx(r["attempts"] / r["ok"]), label
            assert r["goodput"] == pytest.approx(r["ok"] / r["run_span"]), label
        assert r["goodput_fraction"] == pytest.approx(r["goodput"] / r["capacity"]), label
        assert 0 <= r["wasted_tokens"] <= r["tokens_generated"], label
        assert r["ok_interactive"] <= r["interactive_calls"] <= r["calls"], label
        # Useful tokens are answers served within their class's budget, no more than delivered.
        assert r["interactive_within_budget"] <= r["ok_interactive"], label
        assert r["batch_ok"] <= r["batch_calls"] == r["calls"] - r["interactive_calls"], label
        assert 0 <= r["useful_tokens"] <= r["tokens_generated"] - r["wasted_tokens"], label
        assert r["useful_ceiling"] > 0, label
        assert r["failed_under_1s"] <= r["calls"] - r["ok"], label
        if r["ttft_p50"] is not None:
            assert 0 < r["ttft_p50"] <= r["ttft_p99"] <= deadline, label
        if r["rejections"]:
            assert r["rejection_p99"] is not None, label
        if r["first_retries"]:
            assert 0 <= r["first_retry_admitted"] <= 1, label
        # The printed table shows the same numbers.
        section = proc.stdout.split(f"== {label} ==", 1)[1].split("==", 1)[0]
        assert f"{r['ok']}/{r['calls']} = {r['success_rate']:.0%}" in section, label
        assert re.search(rf"useful tokens +{r['useful_tokens']}\b", section), label
        assert f"{r['interactive_within_budget']}/{r['interactive_calls']} (TTFT <=" in section, label
        assert f"{r['wasted_tokens']}/{r['tokens_generated']} tokens" in section, label
        assert f"({r['rejections']} rejections" in section, label
        assert sum(r["rejections_by_code"].values()) == r["rejections"], label
        assert f"{r['retry_wave']} retries in 100 ms ({r['retries']} retries)" in section, label
    direct, shim_plain, shim_backoff = runs
    # The engine has no admission control of its own: straight at it nobody is rejected,
    # and only the shim's queue is sampled when there is a shim.
    assert direct["rejections"] == 0
    assert direct["proxy_peak_queued"] is None
    assert shim_plain["proxy_peak_queued"] is not None
    assert shim_backoff["proxy_peak_queued"] is not None
    # Overload means the shim turned callers away in both shim runs.
    assert shim_plain["rejections"] > 0
    assert shim_backoff["rejections"] > 0


def _summary_rows(stdout: str) -> list[tuple[str, list[str], list[str]]]:
    """The printed summary as (figure, values, explanation lines), in order."""
    block = stdout.split("Summary (same load, same seed, three configurations):\n", 1)[1]
    lines = block.split("\n\nReading it:", 1)[0].splitlines()
    assert set(lines[1].replace(" ", "")) == {"-"}, lines[:2]
    rows: list[tuple[str, list[str], list[str]]] = []
    for line in lines[2:]:
        if line.startswith("    "):
            assert rows, f"an explanation before any figure: {line!r}"
            rows[-1][2].append(line.strip())
        else:
            label, *values = re.split(r"\s{2,}", line.strip())
            rows.append((label, values, []))
    return rows


def test_quick_demo_summary_explains_every_figure_where_it_is_printed(
    quick_demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, out = quick_demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs: list[dict[str, Any]] = json.loads((out / demo.JSON_NAME).read_text())["runs"]
    rows = _summary_rows(proc.stdout)
    assert len(rows) >= 10
    for label, values, note in rows:
        assert len(values) == len(runs), (label, values)
        assert note, f"the summary's {label!r} has no explanation under it"
    by_label = {label: (values, " ".join(note)) for label, values, note in rows}
    # The explanations carry this run's own budgets and ceiling.
    scenario = varied_demo_scenario(quick=True)
    values, note = by_label["interactive within budget"]
    assert f"within {scenario.ttft_budget:g} s" in note
    assert values == [f"{r['interactive_within_budget']}/{r['interactive_calls']}" for r in runs]
    values, note = by_label["of the ceiling"]
    assert f"of {runs[0]['useful_ceiling']:.0f} tokens" in note
    # Why success within deadline can rank llm_backoff last: late interactive answers count.
    values, note = by_label["success within deadline"]
    assert "late" in note
    late, late_note = by_label["interactive served late"]
    assert late == [str(r["ok_interactive"] - r["interactive_within_budget"]) for r in runs]
    assert f"after the {scenario.ttft_budget:g} s budget" in late_note
    values, note = by_label["wasted engine work"]
    assert values == [f"{r['wasted_fraction']:.0%}" for r in runs]
    assert "hung up" in note
    # The reading under it quotes the same late answers and success rates.
    said = " ".join(proc.stdout.split("Reading it:", 1)[1].split())
    assert ", ".join(late[:2]) + f" and {late[2]} of them here" in said
    assert f"its success rate ({runs[2]['success_rate']:.0%}," in said


def test_demo_deadlines_leave_room_for_the_longest_answer() -> None:
    """Quick or not, every answer the demo's workload can draw fits in its caller's deadline
    after the longest wait that caller accepts (interactive: the TTFT budget; batch: its hold
    in the shim), so no answer is cut by a deadline no scheduler could meet (budgets shorter
    than that wasted a third of the engine's work on such answers)."""
    for quick in (False, True):
        scenario = varied_demo_scenario(quick=quick)
        longest = DEMO_SHAPE.longest_service_for(scenario.workload)
        assert scenario.ttft_budget + longest <= scenario.deadline_of("interactive"), quick
        assert scenario.deadline_of("batch") / 2 + longest <= scenario.deadline_of("batch"), quick
    quick, full = varied_demo_scenario(quick=True), varied_demo_scenario(quick=False)
    # --quick is fewer seconds of arrivals after the same burst, not tighter budgets.
    assert quick.duration < full.duration
    assert quick.burst == full.burst


def test_bad_flags_exit_2_without_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(["--duration", "-1"]) == 2
    assert "--duration" in capsys.readouterr().err
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    assert demo.main(["--out", str(not_a_folder)]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert demo.main(["--profile", "gpu-small", "--fixed-lengths", "--out", str(tmp_path)]) == 2
    assert "do not go together" in capsys.readouterr().err


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 (after the parenthesised command) is the parent pid.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find child processes")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_demo_stops_its_servers(tmp_path: Path, signum: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_backoff_shim.cli", "demo", "--quick", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait until the first run is going (its progress line), so the servers are up.
        assert proc.stderr is not None
        line = proc.stderr.readline()
        while line and "started" not in line:
            line = proc.stderr.readline()
        children = _children_of(proc.pid)
        assert children, "the simulator should be running as a child process"
        proc.send_signal(signum)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    for child in children:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = Path(f"/proc/{child}").exists() and "Z" not in _state(child)
        assert not alive, f"child {child} survived the interrupted demo"
    assert not (tmp_path / demo.PNG_NAME).exists()


def _state(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("quick", [False, True])
def test_the_demos_shim_holds_batch_as_calibrate_recommends(quick: bool) -> None:
    """Batch callers wait in the shim for up to half their deadline instead of being told to
    come back after the interactive wait; hints are capped as calibrate caps them."""
    scenario = varied_demo_scenario(quick=quick)
    settings = load_settings(["--upstream", "http://127.0.0.1:9", *demo.shim_flags(DEMO_SHAPE, scenario)])
    limits = settings.class_limits()
    assert limits["interactive"].max_queue_wait == scenario.ttft_budget
    assert limits["batch"].max_queue_wait == scenario.deadline_of("batch") / 2
    # No count: each class's queue is what the engine drains within its wait, as calibrate leaves it.
    assert (limits["interactive"].max_queue, limits["batch"].max_queue, settings.max_queue) == (
        None,
        None,
        None,
    )
    assert settings.initial_service_time == pytest.approx(
        DEMO_SHAPE.service_time_for(scenario.workload), abs=0.01
    )
    assert settings.retry_after_max == HELD_RETRY_AFTER_MAX
    assert settings.max_concurrency == DEMO_SHAPE.slots


def test_without_the_hold_every_class_shares_the_interactive_bounds() -> None:
    scenario = varied_demo_scenario(quick=False)
    flags = demo.shim_flags(DEMO_SHAPE, scenario, hold_batch=False)
    limits = load_settings(["--upstream", "http://127.0.0.1:9", *flags]).class_limits()
    assert limits["batch"] == limits["interactive"]
