"""``llm-backoff-shim calibrate``: flags, one step's statistics, and whole runs against the simulator.

The end-to-end runs use the real simulator on loopback and the real openai client; they
assert where the knee lands relative to the simulator's capacity, the bounds on requests
and time, and the artefacts (JSON, serve flags, PNG), never how fast anything was.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import matplotlib.image
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llm_backoff_shim import cli
from llm_backoff_shim.lab import calibrate
from llm_backoff_shim.lab.calibrate import doubling_levels, parse_steps
from llm_backoff_shim.lab.calibrate.measure import SlotCost, budget_tokens
from llm_backoff_shim.lab.calibrate.run import Sizing, api_base
from llm_backoff_shim.lab.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, WORDS, LengthDist
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

# -- flags -------------------------------------------------------------------------------


def test_lengths_are_the_workload_distributions_and_the_old_forms_still_parse() -> None:
    args = calibrate.build_parser().parse_args(["--upstream", "http://127.0.0.1:8000"])
    config = calibrate.config_from_args(args)
    assert config.prompt_words == DEFAULT_PROMPT_WORDS
    assert config.output_tokens == DEFAULT_OUTPUT_TOKENS
    args = calibrate.build_parser().parse_args(
        ["--upstream", "http://h:1", "--prompt-words", "200", "--output-tokens", "16-256"]
    )
    config = calibrate.config_from_args(args)
    assert config.prompt_words == LengthDist.fixed(200)
    assert config.output_tokens == LengthDist.uniform(16, 256)


@pytest.mark.parametrize(
    ("retired", "instead"),
    [("--prompt-tokens", "--prompt-words"), ("--long-prompt-tokens", "--long-prompt-words")],
)
def test_flags_named_for_tokens_that_counted_words_are_retired(retired: str, instead: str) -> None:
    # They were aliases of the word counts: a "token" length was a word length, 1.3 to 2.5 times
    # as many tokens depending on the model. Refused with the flag to use, never reinterpreted.
    args = calibrate.build_parser().parse_args(["--upstream", "http://h:1", retired, "200"])
    with pytest.raises(ValueError, match=f"{retired} is retired: it counted words.*{instead}"):
        calibrate.config_from_args(args)


def test_levels_double_up_to_the_maximum() -> None:
    assert doubling_levels(1) == [1]
    assert doubling_levels(8) == [1, 2, 4, 8]
    assert doubling_levels(6) == [1, 2, 4, 6]
    assert parse_steps("1, 2,3,8") == [1, 2, 3, 8]
    for bad in ("", "0,1", "2,2", "4,2", "x"):
        with pytest.raises(ValueError, match=r"expected|increasing"):
            parse_steps(bad)


def test_upstream_url_with_or_without_v1() -> None:
    assert api_base("http://127.0.0.1:8000") == ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000")
    assert api_base("http://h:8000/v1/") == ("http://h:8000/v1", "http://h:8000")
    assert api_base("https://gw.example/llm/v1") == ("https://gw.example/llm/v1", "https://gw.example/llm")
    for bad in ("127.0.0.1:8000", "ftp://h/", "http://h:1/?a=1", "http://"):
        with pytest.raises(ValueError, match="expected"):
            api_base(bad)


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        calibrate.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: llm-backoff-shim calibrate")
    for flag in (
        "--upstream",
        "--ttft-slo",
        "--tpot-slo",
        "--repeats",
        "--tolerance",
        "--prompt-words",
        "--model",
        "--api-key",
        "--max-level",
        "--steps",
        "--output-tokens",
        "--step-seconds",
        "--step-requests",
        "--max-seconds",
        "--long-share",
        "--long-prompt-words",
        "--completions-per-slot",
        "--min-completions",
        "--out",
        "--json",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--ttft-slo", "0"], "--ttft-slo: must be a positive number"),
        (["--ttft-slo", "nan"], "--ttft-slo"),
        (["--ttft-slo", "1", "--steps", "4,2"], "--steps: levels must be strictly increasing"),
        (["--ttft-slo", "1", "--max-level", "0"], "--max-level"),
        (["--ttft-slo", "1", "--prompt-words", "0"], "--prompt-words: expected N, LOW-HIGH or lognormal"),
        (["--ttft-slo", "1", "--tpot-slo", "0"], "--tpot-slo: must be a positive number"),
        (["--ttft-slo", "1", "--tpot-slo", "fast"], "--tpot-slo: expected seconds or 'none'"),
        (["--ttft-slo", "1", "--batch-queue-wait", "-1"], "--batch-queue-wait: must be a positive number"),
        (["--ttft-slo", "1", "--batch-queue-wait", "inf"], "--batch-queue-wait: must be a positive number"),
        (["--ttft-slo", "1", "--batch-queue-wait", "long"], "--batch-queue-wait: expected seconds or 'none'"),
        (["--ttft-slo", "1", "--repeats", "0"], "--repeats"),
        (["--ttft-slo", "1", "--tolerance", "0.7"], "--tolerance"),
        (["--ttft-slo", "1", "--output-tokens", "9-3"], "--output-tokens"),
        (["--ttft-slo", "1", "--step-seconds", "-1"], "--step-seconds"),
        (["--ttft-slo", "1", "--step-requests", "0"], "--step-requests"),
        (["--ttft-slo", "1", "--step-seconds", "30", "--max-seconds", "10"], "--max-seconds 10 is too short"),
        (["--long-share", "1.5"], "--long-share: must be in [0, 1]"),
        (["--long-prompt-words", "x"], "--long-prompt-words: expected N"),
        (["--completions-per-slot", "0"], "--completions-per-slot"),
        (["--min-completions", "0"], "--min-completions"),
        (["--ttft-slo", "1", "--max-error-rate", "1"], "--max-error-rate"),
        (["--ttft-slo", "1", "--model", " "], "--model: must not be empty"),
    ],
)
def test_bad_flags_exit_2_with_one_line(extra: list[str], fragment: str) -> None:
    err = io.StringIO()
    assert calibrate.main(["--upstream", "http://127.0.0.1:9", *extra], stderr=err) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("llm-backoff-shim calibrate: invalid configuration: ")
    assert fragment in lines[0]


def test_slo_defaults_to_two_seconds_and_a_tenth_of_a_second_per_token() -> None:
    args = calibrate.build_parser().parse_args(["--upstream", "http://127.0.0.1:8000"])
    config = calibrate.config_from_args(args)
    assert config.ttft_slo == 2.0
    assert config.tpot_slo == 0.1
    assert (config.repeats, config.tolerance) == (4, 0.05)
    off = calibrate.build_parser().parse_args(["--upstream", "http://h:1", "--tpot-slo", "none"])
    assert calibrate.config_from_args(off).tpot_slo is None
    assert config.batch_queue_wait == 15.0
    unheld = calibrate.build_parser().parse_args(["--upstream", "http://h:1", "--batch-queue-wait", "none"])
    assert calibrate.config_from_args(unheld).batch_queue_wait is None
    assert config.levels == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert (config.step_seconds, config.step_requests, config.max_seconds) == (3.0, 1000, 600.0)
    assert (config.completions_per_slot, config.min_completions, config.long_share) == (2, 20, 0.0)


def test_bad_upstream_exits_2() -> None:
    err = io.StringIO()
    assert calibrate.main(["--upstream", "localhost:8000", "--ttft-slo", "1"], stderr=err) == 2
    assert "--upstream: expected an http(s) URL" in err.getvalue()


# -- whole runs ------------------------------------------------------------------------------


def sim_server(**overrides: Any) -> ServerThread:
    values: dict[str, Any] = {"max_num_seqs": 4, "ttft": 0.1, "itl": 0.01, "output_tokens": 10, "seed": 1}
    values.update(overrides)
    return ServerThread(create_sim_app(SimConfig(**values)))


@pytest.fixture
def sim() -> Iterator[ServerThread]:
    with sim_server() as server:
        yield server


def known_to_serve(argv: list[str]) -> list[str]:
    """``argv`` without the flags this version's ``serve`` does not define (the cost cap's)."""
    known = {f"--{name.replace('_', '-')}" for name in ShimSettings.model_fields}
    out: list[str] = []
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        if flag in known:
            out += [flag, value]
    return out


def sim_stats(server: ServerThread) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(server.url + "/sim/stats", timeout=5).json()
    return data


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = calibrate.main(argv, stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


def test_knee_lands_at_the_simulators_capacity(sim: ServerThread, tmp_path: Path) -> None:
    max_num_seqs = 4
    status, out, err = run(
        [
            "--upstream",
            sim.url,
            "--ttft-slo",
            "2",
            "--steps",
            "2,4,8,16",
            "--step-seconds",
            "1",  # the shortest window: two completions per slot take less on this engine
            "--prompt-words",
            "lognormal:20:0.8:5-100",
            "--output-tokens",
            "lognormal:10:0.5:2-40",
            "--out",
            str(tmp_path / "out"),
            "--json",
        ]
    )
    assert status == 0, err
    result = json.loads(out)
    seen = [
        (s["concurrency"], round(s["output_tokens_per_s"]), round(s["ttft_p99"], 3)) for s in result["steps"]
    ]
    assert result["knee"] is not None, seen
    knee = result["knee"]["concurrency"]
    # Throughput rises up to the engine's 4 slots, never at 2, where half the engine stood idle;
    # past them, requests wait inside the engine (its vllm:num_requests_waiting), where classes do
    # not count: 8 workers may deliver a few percent more (no gap between two requests) but are
    # no knee. The knee is the engine's slots, never above them.
    assert knee == max_num_seqs, seen
    per_level = {level["concurrency"]: level for level in result["levels"]}
    # As much as any level within the SLO that did not queue inside the engine (8 workers may
    # deliver more than 4: the next request waits in the engine, not in the client's turnaround).
    eligible = [level for level in result["levels"] if level["within_slo"] and not level["queued"]]
    best = max(level["output_tokens_per_s"] for level in eligible)
    assert per_level[knee]["output_tokens_per_s"] >= 0.9 * best, seen
    levels = sorted({s["concurrency"] for s in result["steps"]})
    assert levels == [2, 4, 8], seen  # the first level that queued in the engine ended the climb
    assert per_level[knee]["runs"] >= 2  # the knee was measured again
    assert all(s["engine_waiting"] is not None for s in result["steps"]), seen
    assert per_level[8]["queued"], per_level[8]
    assert per_level[8]["engine_running"] == max_num_seqs
    assert not per_level[4]["queued"], per_level[4]
    assert result["knee"]["limit"] == "engine_queue", (result["knee"], seen)
    assert "waiting inside the engine" in result["reason"]
    assert "engine: reading vllm:num_requests_waiting" in err
    # The first run in --out: at most medium, saying how to confirm; the run is kept for the next.
    assert result["confidence"] in ("medium", "low")
    assert result["previous_run"] is None
    assert "run calibrate again with the same --out" in result["confidence_reason"]
    kept = (tmp_path / "out" / "calibrate-runs.jsonl").read_text().splitlines()
    assert len(kept) == 1
    assert json.loads(kept[0])["max_concurrency"] == knee
    assert result["confidence_within_run"] in ("high", "medium", "low")
    # Answers varied in length: the upstream's own counts are means, not one fixed value.
    assert len({round(s["mean_output_tokens"], 3) for s in result["steps"]}) > 1
    rec = result["recommendation"]
    assert rec["max_concurrency"] == knee
    # The interactive wait: what the SDK's 5 s start budget leaves after the knee's p99 TTFT.
    assert rec["max_queue_wait"] == pytest.approx(5 - per_level[knee]["ttft_p99"], abs=0.0101)
    # The printed command is what `serve` accepts, with the same values.
    argv = shlex.split(rec["command"])
    assert argv[:2] == ["llm-backoff-shim", "serve"]
    settings = load_settings(known_to_serve(argv[2:]))
    assert str(settings.upstream).rstrip("/") == sim.url
    assert (settings.max_concurrency, settings.max_queue, settings.max_queue_wait) == (
        knee,
        None,  # no bound: each class holds what the engine drains within its wait
        rec["max_queue_wait"],
    )
    assert settings.class_limits()["batch"].max_queue_wait == rec["batch_max_queue_wait"]
    assert settings.retry_after_max == rec["retry_after_max"]
    # The cost budget: what the knee's slots of the mix hold 95 % of the time, rounded up to 64.
    slot = result["knee"]["slot_cost"]
    assert slot["requests"] >= sum(s["requests"] for s in result["steps"])
    assert rec["max_inflight_tokens"] == budget_tokens(SlotCost(**slot).quantile(knee))
    assert rec["max_inflight_tokens"] >= knee * slot["mean"]
    assert per_level[knee]["inflight_cost_high"] >= per_level[knee]["inflight_cost"]
    assert argv[argv.index("--max-inflight-tokens") + 1] == str(rec["max_inflight_tokens"])
    # Every level counted its window's completions (two per slot, at least 20, at most six
    # request durations) after its ramp-in.
    assert result["probe"]["ok"]
    assert result["plan"]["levels"] == [2, 4, 8, 16]  # planned; the climb stopped at 8
    for step in result["steps"]:
        assert step["requests"] >= Sizing().completions(step["concurrency"]), step
        assert step["window"] >= 1.0
    # The engine served the probe, every ramp-in and window, and the requests cancelled at the end.
    stats = _wait_for_idle(sim)
    assert all(step["errors"] == 0 for step in result["steps"])
    measured = sum(step["requests"] for step in result["steps"])
    assert stats["requests_completed"] > measured
    assert stats["peak_running"] == max_num_seqs
    # The PNG is a real image.
    png = Path(result["png"])
    assert png == tmp_path / "out" / "calibrate.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 400
    assert image.shape[1] > 400
    # Progress: the plan before the sweep, one line when a measurement starts and one when it ends.
    assert "plan: one request of the mix's mean lengths" in err
    starts = [line for line in err.splitlines() if re.match(r"\[\d+\] concurrency +\d+ \(", line)]
    assert len(starts) == len(result["steps"])
    assert err.count(" s window (") == len(result["steps"])


def test_text_output_through_the_cli_has_the_table_and_the_serve_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outputs = []
    with sim_server(max_num_seqs=2) as sim:
        for _ in range(2):  # the same engine twice, into the same --out
            status = cli.main(
                ["calibrate", "--upstream", sim.url + "/v1", "--ttft-slo", "3", "--steps", "1,8",
                 "--step-seconds", "0.2", "--prompt-words", "10", "--output-tokens", "5",
                 "--out", str(tmp_path)]
            )  # fmt: skip
            assert status == 0
            outputs.append(capsys.readouterr().out)
    lines = outputs[0].splitlines()
    # The simulator counts 1.3 tokens per word plus 4 for the chat template: 13 + 4.
    assert "prompt 10 words, output 5 tokens (17 prompt / 5 answer tokens on average" in lines[0]
    header = next(line for line in lines if line.lstrip().startswith("conc"))
    assert "TTFT p99" in header
    assert "TPOT p99" in header
    assert "waiting" in header
    rows = [line.split() for line in lines if line[:5].strip() in ("1", "2", "8")]
    assert [row[0] for row in rows] == ["1", "2", "8"]
    # 8 workers on 2 slots still meet a 3 s TTFT SLO, but 6 of them wait inside the engine: not a
    # knee. The 2 the engine ran at once were measured next, and are.
    assert "engine queue" in " ".join(rows[2])
    assert "KNEE" in " ".join(rows[1])
    command = next(line.strip() for line in lines if line.strip().startswith("llm-backoff-shim serve"))
    assert f"--upstream {sim.url} --max-concurrency 2 " in command
    assert load_settings(known_to_serve(shlex.split(command)[2:])).max_concurrency == 2
    assert (tmp_path / "calibrate.png").stat().st_size > 0
    # Confidence is earned across runs: the first says how to confirm, the second compares.
    first = next(line for line in lines if line.startswith("confidence: "))
    assert first.startswith(("confidence: medium (first run", "confidence: low (first run")), first
    second = next(line for line in outputs[1].splitlines() if line.startswith("confidence: "))
    assert "recommended --max-concurrency 2, --max-queue-wait " in second, second
    assert "this one --max-concurrency 2" in second, second
    assert len((tmp_path / "calibrate-runs.jsonl").read_text().splitlines()) == 2


def test_an_unwritable_png_is_reported_and_the_result_still_printed(
    sim: ServerThread, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    status, out, err = run(
        ["--upstream", sim.url, "--ttft-slo", "5", "--steps", "1", "--step-requests", "2",
         "--output-tokens", "3", "--prompt-words", "5", "--out", str(blocker / "sub"), "--json"]
    )  # fmt: skip
    assert status == 0
    assert f"cannot write {blocker / 'sub' / 'calibrate.png'}" in err
    assert f"cannot keep this run in {blocker / 'sub' / 'calibrate-runs.jsonl'}" in err
    result = json.loads(out)
    assert result["png"] is None
    assert result["recommendation"]["max_concurrency"] == 1


def test_completions_per_level_are_capped(sim: ServerThread, tmp_path: Path) -> None:
    # Each level's window may count only 5 completions, whatever two per slot would ask.
    status, out, err = run(
        ["--upstream", sim.url, "--ttft-slo", "5", "--steps", "1,2", "--step-requests", "5",
         "--step-seconds", "0", "--repeats", "1", "--output-tokens", "3", "--prompt-words", "5",
         "--out", str(tmp_path), "--json"]
    )  # fmt: skip
    assert status == 0, err
    result = json.loads(out)
    assert result["steps"][0]["requests"] == 5  # one worker: exactly the fifth ends the window
    assert 5 <= result["steps"][1]["requests"] <= 6  # two may end in the same instant
    # The probe, each level's ramp-in (one per worker), the windows and the two cancelled at the end.
    received = sim_stats(sim)["requests_received"]
    assert 1 + (1 + 5) + (2 + 5) <= received <= 1 + (1 + 6) + (2 + 6) + 2


def test_total_time_cap_cancels_running_requests(tmp_path: Path) -> None:
    # Answers of 2000 tokens at 10 ms each never finish within the 2 s cap.
    with sim_server(output_tokens=2000, itl=0.01, ttft=0.0) as sim:
        status, out, err = run(
            [
                "--upstream",
                sim.url,
                "--ttft-slo",
                "5",
                "--steps",
                "2,4",
                "--step-seconds",
                "1",
                "--max-seconds",
                "2",
                "--output-tokens",
                "2000",
                "--out",
                str(tmp_path),
                "--json",
            ]
        )
        result = json.loads(out)
        assert status == 1
        assert result["steps"] == []
        assert result["recommendation"] is None
        assert result["stopped"] == "--max-seconds 2 reached during the probe"
        assert "a probe request first sizes the steps" in err
        assert result["png"] is None
        # The cancelled stream was closed: the engine aborts it instead of generating on.
        stats = _wait_for_idle(sim)
        assert stats["requests_aborted"] == 1
        assert stats["requests_completed"] == 0


def test_a_level_that_does_not_fit_the_time_left_is_not_started(tmp_path: Path) -> None:
    # Requests of 0.3 s: the probe fits, but two per slot at 4 workers do not fit in 2 s.
    with sim_server(output_tokens=30, itl=0.01, ttft=0.0) as sim:
        status, out, err = run(
            ["--upstream", sim.url, "--ttft-slo", "5", "--steps", "4", "--step-seconds", "10",
             "--max-seconds", "10.5", "--output-tokens", "30", "--prompt-words", "5", "--out", str(tmp_path),
             "--json"]
        )  # fmt: skip
        result = json.loads(out)
        assert status == 1
        assert result["steps"] == []
        assert result["stopped"].startswith("--max-seconds 10.5: ")
        assert "concurrency 4 (climb) needs about" in result["stopped"]
        assert "plan: still over the 10 s --max-seconds leaves" in err
        stats = _wait_for_idle(sim)
        assert stats["requests_completed"] == 1  # the probe alone: nothing was started that could not end


def _wait_for_idle(sim: ServerThread) -> dict[str, Any]:
    # Bounded poll: the disconnects reach the engine asynchronously; 5 s only bounds a broken test.
    end = time.monotonic() + 5
    stats = sim_stats(sim)
    while (stats["running"] or stats["waiting"]) and time.monotonic() < end:
        time.sleep(0.02)
        stats = sim_stats(sim)
    assert stats["running"] == stats["waiting"] == 0
    return stats


def test_slo_out_of_reach_stops_after_the_first_level(tmp_path: Path) -> None:
    with sim_server(ttft=0.3) as sim:
        status, out, _ = run(
            [
                "--upstream",
                sim.url,
                "--ttft-slo",
                "0.1",
                "--max-level",
                "64",
                "--step-seconds",
                "0.5",
                "--output-tokens",
                "3",
                "--prompt-words",
                "5",
                "--out",
                str(tmp_path),
                "--json",
            ]
        )
    result = json.loads(out)
    assert status == 1
    assert [s["concurrency"] for s in result["steps"]] == [1, 1]  # confirmed once, no higher
    assert result["levels"][0]["within_slo"] is False
    assert result["knee"] is None
    assert "concurrency 1, the lowest level measured, already misses the SLO (TTFT p99" in result["reason"]
    assert result["stopped"] == "no level meets the SLO"
    assert Path(result["png"]).exists()  # the curves still help to see why


def refusing_upstream() -> Starlette:
    async def chat(_: Request) -> Response:
        body = {"error": {"message": "invalid api key", "type": "auth", "param": None, "code": 401}}
        return JSONResponse(body, status_code=401)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": []})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


def recording_upstream(bodies: list[dict[str, Any]], auth: list[str]) -> Starlette:
    """A minimal streaming chat upstream that keeps every request body and Authorization header."""

    def chunk(delta: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": None}]
        body = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "rec",
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def chat(request: Request) -> Response:
        bodies.append(await request.json())
        auth.append(request.headers.get("authorization", ""))
        parts = [
            chunk({"role": "assistant", "content": ""}),  # vLLM's role chunk carries no token
            chunk({"content": "a"}),
            chunk({"content": " b"}),
            chunk(None, {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}),
            b"data: [DONE]\n\n",
        ]
        return Response(b"".join(parts), media_type="text/event-stream")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "rec", "object": "model"}, {"id": "other"}]})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_requests_on_the_wire(ignore_eos: bool, tmp_path: Path) -> None:
    bodies: list[dict[str, Any]] = []
    auth: list[str] = []
    flags = ["--ttft-slo", "5", "--steps", "1", "--step-requests", "6", "--api-key", "sk-test", "--json",
             "--repeats", "1", "--step-seconds", "0",
             "--prompt-words", "3-9", "--output-tokens", "4-6", "--out", str(tmp_path)]  # fmt: skip
    with ServerThread(recording_upstream(bodies, auth)) as server:
        status, out, _ = run(["--upstream", server.url, *flags, *([] if ignore_eos else ["--no-ignore-eos"])])
    assert status == 0
    # The probe, one ramp-in request, the window's 6, and at most one cancelled at the end.
    assert 8 <= len(bodies) <= 9
    assert set(auth) == {"Bearer sk-test"}
    # The probe has the mix's mean lengths: 6 words of 3-9, max_tokens 5 of 4-6.
    assert (len(bodies[0]["messages"][0]["content"].split()), bodies[0]["max_tokens"]) == (6, 5)
    for body in bodies:
        assert body["model"] == "rec"  # the first model /v1/models lists
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert 4 <= body["max_tokens"] <= 6
        assert ("ignore_eos" in body) is ignore_eos
        words = body["messages"][0]["content"].split()
        assert 3 <= len(words) <= 9
        assert set(words) <= set(WORDS)
    assert len({b["messages"][0]["content"] for b in bodies}) > 1  # prompts differ: no prefix-cache hits
    step = json.loads(out)["steps"][0]
    assert step["mean_prompt_tokens"] == 7  # the upstream's count, not the request's
    assert step["mean_output_tokens"] == 2
    assert step["requests"] == 6


def test_an_upstream_that_refuses_everything_gets_no_recommendation(tmp_path: Path) -> None:
    with ServerThread(refusing_upstream()) as server:
        status, out, err = run(["--upstream", server.url, "--ttft-slo", "1", "--out", str(tmp_path)])
        assert status == 1
        assert "lists no model; pass --model" in err
        assert out == ""

        status, out, err = run(
            [
                "--upstream",
                server.url,
                "--model",
                "m",
                "--ttft-slo",
                "1",
                "--steps",
                "1,2",
                "--step-seconds",
                "0.3",
                "--out",
                str(tmp_path),
                "--json",
            ]
        )
    assert status == 1
    result = json.loads(out)
    assert result["steps"] == []
    assert result["stopped"].startswith("the probe failed: HTTP 401: ")
    assert "the probe request failed: HTTP 401" in err


def test_an_unreachable_upstream_is_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    status, out, err = run(
        ["--upstream", f"http://127.0.0.1:{port}", "--ttft-slo", "1", "--out", str(tmp_path)]
    )
    assert status == 1
    assert out == ""
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"llm-backoff-shim calibrate: cannot list models at http://127.0.0.1:{port}: ")
    )


def test_a_silent_upstream_is_bounded_by_the_time_cap(tmp_path: Path) -> None:
    # A listening socket nobody answers: connections open, no response ever comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        status, out, err = run(
            ["--upstream", url, "--ttft-slo", "1", "--step-seconds", "0.5", "--max-seconds", "1",
             "--out", str(tmp_path)]
        )  # fmt: skip
    assert status == 1
    assert out == ""
    assert f"{url}/v1/models did not answer within 1 s (or pass --model)" in err


def test_an_engine_slower_than_the_step_is_measured_by_completions_with_the_mix(tmp_path: Path) -> None:
    # A request lasts about 0.4 s alone and longer in a batch, more than --step-seconds 0.1: each
    # level runs until it has its completions, whatever that takes. A quarter of the prompts are long.
    with sim_server(max_num_seqs=4, ttft=0.05, itl=0.015, itl_batch_factor=0.1) as sim:
        status, out, err = run(
            ["--upstream", sim.url, "--ttft-slo", "5", "--tpot-slo", "none", "--steps", "2,4,8",
             "--step-seconds", "0.1", "--completions-per-slot", "1", "--min-completions", "4",
             "--repeats", "2", "--prompt-words", "10", "--output-tokens", "20", "--long-share", "0.25",
             "--long-prompt-words", "400-600", "--out", str(tmp_path), "--json"]
        )  # fmt: skip
    assert status == 0, err
    result = json.loads(out)
    probe = result["probe"]
    assert probe["ok"]
    assert probe["output_tokens"] == 20
    assert probe["seconds"] > result["step_seconds"]
    # The plan was printed before the sweep, from the probe, with its estimate.
    plan_at = err.index("plan: one request of the mix's mean lengths (20 tokens out) took")
    assert plan_at < err.index("] concurrency")
    assert "at the probe's pace" in err
    assert result["plan"]["request_seconds"] == pytest.approx(probe["seconds"])
    sizing = Sizing(per_slot=1, minimum=4)
    per_level: dict[int, list[dict[str, Any]]] = {}
    for step in result["steps"]:
        assert step["requests"] >= sizing.completions(step["concurrency"]), step
        per_level.setdefault(step["concurrency"], []).append(step)
    # Long prompts were sent: the upstream counted far more prompt tokens than 10 words make (17).
    assert statistics.fmean(s["mean_prompt_tokens"] for s in result["steps"]) > 60
    # Past the engine's 4 slots the extra workers only queue, as the engine's own gauges say over
    # each level-8 window: its 4 slots busy and the rest waiting. (Throughputs of two levels are
    # windows taken at different times, so on a shared machine their ratio tests the machine.)
    for step in per_level[8]:
        assert step["engine_running"] == 4, step
        assert step["engine_waiting"] >= 1, step
    rec = result["recommendation"]
    knee = result["knee"]
    assert rec["max_inflight_tokens"] == budget_tokens(
        SlotCost(**knee["slot_cost"]).quantile(knee["concurrency"])
    )
    assert f"--max-inflight-tokens {rec['max_inflight_tokens']}" in rec["command"]
