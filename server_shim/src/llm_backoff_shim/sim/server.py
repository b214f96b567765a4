"""``llm-backoff-shim sim``: a vLLM-like OpenAI-compatible server for tests, the demo and benchmarks.

    llm-backoff-shim sim --port 8000 --max-num-seqs 8 --ttft 0.2 --itl 0.025 --output-tokens 40
    llm-backoff-shim sim --port 8000 --profile gpu-small      # a GPU box (``sim.profiles``)

The work follows each request as on vLLM: prefill time grows with the prompt (estimated
at 1.3 tokens per word), the answer is ``max_tokens`` long with ``ignore_eos`` and
otherwise a natural length drawn per request (lognormal around ``--output-tokens``) cut
to ``max_tokens``; the running requests advance together in engine steps that get
slower as the batch grows, prompts prefilled in chunks between the decode tokens; with
``--kv-cache-tokens`` the youngest request is preempted when the cache is full
(``sim_engine``'s doc has the cost model).

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or
not), ``POST /v1/messages`` (Anthropic's, streaming or not: sim_anthropic.py),
``POST /tokenize`` (vLLM's: ``{"count", "max_model_len", "tokens"}`` for a ``prompt`` or
``messages``, counted as prefill counts them), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text, vLLM
names + ``sim_*``), ``GET /sim/stats`` (JSON accounting) and ``POST /sim/reset`` (zero
the accounting between benchmark runs: the ``sim_*`` and ``vllm:*_tokens_total`` counters
restart from 0, which Prometheus reads as a counter reset; the latency histograms keep
their history because prometheus_client histograms cannot be reset).

Public API: :class:`SimConfig`, :func:`create_sim_app`, :func:`main`. The pieces live
in ``sim_engine`` (scheduler model), ``sim_runtime`` (engine loop), ``sim_http``
(generation endpoints), ``sim_protocol`` (wire format), ``sim_faults``, ``sim_metrics``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .anthropic_api import MessagesEndpoint
from .config import SimConfig
from .endpoints import GenerationEndpoint
from .metrics import CONTENT_TYPE
from .profiles import PROFILES
from .protocol import BadRequestError, error_body, tokenize_count
from .runtime import SimRuntime

__all__ = ["SimConfig", "create_sim_app", "main"]

#: The ``sim`` command's spread of natural answer lengths: varied, as chat answers are.
#: (``SimConfig`` defaults to 0, fixed lengths, which tests of other components want.)
CLI_OUTPUT_SIGMA = 0.8


def _stats_json(runtime: SimRuntime) -> dict[str, object]:
    engine = runtime.engine
    data: dict[str, object] = dataclasses.asdict(runtime.stats)
    data["running"] = engine.num_running
    data["waiting"] = engine.num_waiting
    data["kv_cache_usage_perc"] = engine.kv_cache_usage
    data["kv_tokens_used"] = engine.kv_tokens_used
    return data


def create_sim_app(config: SimConfig, *, clock: Callable[[], float] = time.monotonic) -> Starlette:
    """The simulator as an ASGI app. Its engine loop starts with the lifespan (or the first request).

    ``app.state.sim`` is the :class:`~llm_backoff_shim.sim.runtime.SimRuntime`, for
    in-process tests that want the live engine rather than ``/sim/stats``.
    """
    runtime = SimRuntime(config, clock=clock)
    created = int(time.time())

    async def models(_: Request) -> Response:
        card = {
            "id": config.model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def metrics(_: Request) -> Response:
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(request: Request) -> Response:
        try:
            count = tokenize_count(await request.body())
        except BadRequestError as exc:
            return Response(
                error_body(exc.message, "BadRequestError", 400, exc.param), 400, media_type="application/json"
            )
        # Filler ids: the simulator has no vocabulary, only counts.
        limit = config.kv_cache_tokens
        return JSONResponse({"count": count, "max_model_len": limit, "tokens": list(range(count))})

    async def stats(_: Request) -> Response:
        return JSONResponse(_stats_json(runtime))

    async def reset(_: Request) -> Response:
        runtime.engine.reset_stats()
        return JSONResponse(_stats_json(runtime))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", GenerationEndpoint(runtime, "chat")),
            Route("/v1/completions", GenerationEndpoint(runtime, "completion")),
            Route("/v1/messages", MessagesEndpoint(runtime)),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/sim/stats", stats, methods=["GET"]),
            Route("/sim/reset", reset, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    app.state.sim = runtime
    return app


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "") else int(text)


class _DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    defaults = SimConfig()
    p = argparse.ArgumentParser(
        prog="llm-backoff-shim sim",
        allow_abbrev=False,
        description="Run a vLLM-like OpenAI-compatible simulator (continuous batching, vLLM metrics, "
        "fault injection). No GPU, no model: answers are filler tokens on a realistic schedule.",
        formatter_class=_DefaultsOnceFormatter,
    )
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="engine defaults of a GPU box (flags given here win): "
        + "; ".join(f"{name}: {PROFILES[name].summary}" for name in sorted(PROFILES))
        + " (default: none, the flags' own defaults)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--model", default=defaults.model, help="model name listed by /v1/models")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help="sequences generated at once (vLLM --max-num-seqs); the rest wait in FIFO order",
    )
    p.add_argument(
        "--max-num-queued-reqs",
        type=_optional_int,
        default=None,
        help="like vLLM: max unfinished (running + waiting) requests; beyond it answer 503 "
        "'Request queue full.' without Retry-After (default: unbounded)",
    )
    p.add_argument(
        "--ttft",
        type=float,
        default=defaults.ttft,
        help="seconds from admission into the batch to the first token",
    )
    p.add_argument(
        "--itl",
        type=float,
        default=defaults.itl,
        help="seconds between two tokens of one sequence when it runs alone",
    )
    p.add_argument(
        "--itl-batch-factor",
        type=float,
        default=defaults.itl_batch_factor,
        help="batch slowdown: itl * (1 + factor * (running - 1))",
    )
    p.add_argument(
        "--output-tokens",
        type=int,
        default=defaults.output_tokens,
        help="median natural answer length; a smaller max_tokens/max_completion_tokens in the request "
        "wins, and with ignore_eos the request's max_tokens is the exact length",
    )
    p.add_argument(
        "--output-tokens-sigma",
        type=float,
        default=CLI_OUTPUT_SIGMA,
        help="spread of the natural answer lengths (sigma of a lognormal around --output-tokens; "
        "0 = every answer exactly --output-tokens)",
    )
    p.add_argument(
        "--output-tokens-max",
        type=_optional_int,
        default=None,
        help="longest natural answer (default: 8 x --output-tokens)",
    )
    p.add_argument(
        "--prefill-time-per-token",
        type=float,
        default=defaults.prefill_time_per_token,
        help="engine step seconds per prompt token prefilled (slows the decode steps it shares)",
    )
    p.add_argument(
        "--prefill-attention-time",
        type=float,
        default=defaults.prefill_attention_time,
        help="engine step seconds per prompt token per 1000 tokens of context before it (attention: "
        "prefill grows with the square of the prompt, as on a real engine)",
    )
    p.add_argument(
        "--admit-time",
        type=float,
        default=defaults.admit_time,
        help="engine step seconds each request costs once, with its first prefill chunk: the server's "
        "own work per request where it shares the engine's CPU (vLLM's CPU build); 0 for a GPU engine",
    )
    p.add_argument(
        "--decode-attention-time",
        type=float,
        default=defaults.decode_attention_time,
        help="decode step seconds per 1000 tokens in the decoding sequences' KV cache (attention reads "
        "every context at each step: long contexts decode slower)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="like vLLM: tokens per engine step, decode tokens plus a chunk of prefill",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=_optional_int,
        default=None,
        help="KV-cache size in tokens (prompt + generated of the running requests); when full the "
        "youngest request is preempted and recomputed later, like vLLM (default: unbounded)",
    )
    p.add_argument(
        "--error-rate", type=float, default=0.0, help="fraction of requests answered with HTTP 500"
    )
    p.add_argument(
        "--reset-rate",
        type=float,
        default=0.0,
        help="fraction of requests whose TCP connection is reset before any response byte",
    )
    p.add_argument(
        "--slow-first-byte-rate",
        type=float,
        default=0.0,
        help="fraction of requests whose response headers are held back",
    )
    p.add_argument(
        "--slow-first-byte-delay",
        type=float,
        default=defaults.slow_first_byte_delay,
        help="seconds the first byte is held back for those requests",
    )
    p.add_argument(
        "--stream-cut-rate",
        type=float,
        default=0.0,
        help="fraction of streamed answers whose connection is reset after a random token",
    )
    p.add_argument("--seed", type=int, default=None, help="seed for the fault draws (default: random)")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn log level",
    )
    p.add_argument("--access-log", action="store_true", help="log every request (off: it slows the demo)")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line; a ``--profile``'s values become the defaults the other flags override."""
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.profile is not None:
        parser.set_defaults(**PROFILES[known.profile].defaults)
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build the validated config; raises ``pydantic.ValidationError``."""
    return SimConfig(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_queued_reqs=args.max_num_queued_reqs,
        ttft=args.ttft,
        itl=args.itl,
        itl_batch_factor=args.itl_batch_factor,
        output_tokens=args.output_tokens,
        output_tokens_sigma=args.output_tokens_sigma,
        output_tokens_max=args.output_tokens_max,
        prefill_time_per_token=args.prefill_time_per_token,
        prefill_attention_time=args.prefill_attention_time,
        admit_time=args.admit_time,
        decode_attention_time=args.decode_attention_time,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        error_rate=args.error_rate,
        reset_rate=args.reset_rate,
        slow_first_byte_rate=args.slow_first_byte_rate,
        slow_first_byte_delay=args.slow_first_byte_delay,
        stream_cut_rate=args.stream_cut_rate,
        seed=args.seed,
    )


def format_validation_error(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "config"
        flag = "--" + where.replace("_", "-") if err["loc"] else where
        problems.append(f"{flag}: {err['msg']}")
    return "; ".join(problems)


def main(argv: list[str]) -> int:
    """Entry point of ``llm-backoff-shim sim``; returns the process exit code (2 on bad flags)."""
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        print(f"llm-backoff-shim sim: invalid configuration: {format_validation_error(exc)}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(
            f"llm-backoff-shim sim: invalid configuration: --port: {args.port} is not 0..65535",
            file=sys.stderr,
        )
        return 2
    uvicorn.run(
        create_sim_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        server_header=False,
        date_header=False,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
