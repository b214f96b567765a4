"""The route table: what the shim does with each path of vLLM's OpenAI-compatible server.

Every path the shim forwards, or refuses on purpose, is a row of :data:`ROUTES`; docs/reference.md
renders the same table (``python -m llm_backoff_shim.serve.api.routes`` prints it). A row has a kind:

- ``engine``: the request makes the engine work (generation, pooling, scoring, audio). A
  ``POST`` there goes through admission: queued by class, refused with the protocol's 429 (or
  ``--reject-status``) when its queue is full. Other methods are forwarded without admission
  (vLLM answers them 405).
- ``pass``: cheap routes (tokenizer, version, models, health, load), forwarded straight through.
- ``operator``: vLLM's development and operator routes (sleep, weight transfer, caches,
  profiling, LoRA loading, collective RPC, elastic EP scaling). A public shim must never let a
  client reach them: they are refused with a 403 unless the operator names the path in
  ``--allow-operator-route``; then they are forwarded as ``pass`` routes. vLLM itself leaves most
  of them unauthenticated (its ``--api-key`` guards only ``/v1`` paths).

Paths under ``/v1/`` that no row names (``/v1/responses/{id}``, ``/v1/models/{id}``, new vLLM
endpoints) are forwarded as ``pass``, as the shim always did; any other path gets an OpenAI-format
404. The shim's own ``/health``, ``/ready``, ``/metrics`` and ``/shim/state`` win over vLLM's
routes of the same name; vLLM's ``/health``, ``/ready`` and ``/metrics`` are reachable as
``/engine/health``, ``/engine/ready`` and ``/engine/metrics`` (the prefix is dropped upstream).

A row also says which error shape the shim's own answers take there: the OpenAI one, or on
``/v1/messages`` the Anthropic one (rejection.py).

Paths are matched after folding repeated slashes and dropping a trailing slash, and only after
percent-decoding (``/v1/load%5Flora_adapter`` is the operator route it spells). WebSocket routes
(vLLM's ``/v1/realtime``) are not proxied.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace


class Kind(enum.Enum):
    ENGINE = "engine"
    PASS = "pass"
    OPERATOR = "operator"


class Shape(enum.Enum):
    """The error shape of the shim's own answers on a route."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    kind: Kind
    #: What the route is, for the rendered table.
    what: str
    #: Methods vLLM serves there (for the docs; the shim forwards any method).
    methods: tuple[str, ...] = ("POST",)
    shape: Shape = Shape.OPENAI
    #: Whether the body must be a JSON object to be admitted (multipart audio uploads are not).
    json_body: bool = True
    #: The path sent upstream when it differs from ``path`` (``/engine/health`` -> ``/health``).
    upstream_path: str | None = None
    #: Set on a copy of an operator row the operator allowed; such a row is forwarded as ``pass``.
    allowed: bool = False

    @property
    def admitted(self) -> bool:
        """Whether a ``POST`` here goes through admission."""
        return self.kind is Kind.ENGINE

    @property
    def refused(self) -> bool:
        """Whether the shim answers 403 instead of forwarding."""
        return self.kind is Kind.OPERATOR and not self.allowed


_E, _P, _O = Kind.ENGINE, Kind.PASS, Kind.OPERATOR
_GET = ("GET",)

#: The table. Order is the rendered order: engine work, cheap routes, operator routes.
ROUTES: tuple[Route, ...] = (
    Route("/v1/chat/completions", _E, "OpenAI chat completions (streamed or not)"),
    Route("/v1/completions", _E, "OpenAI completions"),
    Route("/v1/responses", _E, "OpenAI Responses API"),
    Route("/v1/embeddings", _E, "OpenAI embeddings"),
    Route("/v1/chat/completions/batch", _E, "batch of chat completions in one request"),
    Route("/v1/messages", _E, "Anthropic Messages API", shape=Shape.ANTHROPIC),
    Route("/v1/audio/transcriptions", _E, "speech to text (multipart upload)", json_body=False),
    Route("/v1/audio/translations", _E, "speech translation (multipart upload)", json_body=False),
    Route("/pooling", _E, "pooling models: hidden states"),
    Route("/classify", _E, "classification models"),
    Route("/score", _E, "score models: sentence-pair scores"),
    Route("/v1/score", _E, "score models: sentence-pair scores"),
    Route("/rerank", _E, "Jina/Cohere-style rerank"),
    Route("/v1/rerank", _E, "Jina/Cohere-style rerank"),
    Route("/v2/rerank", _E, "Cohere v2 rerank"),
    Route("/v2/embed", _E, "Cohere embed"),
    Route("/generative_scoring", _E, "next-token probabilities of label tokens"),
    Route("/invocations", _E, "SageMaker inference (routed by body to the endpoints above)"),
    Route("/v1/messages/count_tokens", _P, "Anthropic token count (tokenizer only)", shape=Shape.ANTHROPIC),
    Route("/tokenize", _P, "tokenizer: text to token ids"),
    Route("/detokenize", _P, "tokenizer: token ids to text"),
    Route("/tokenizer_info", _P, "tokenizer configuration (--enable-tokenizer-info-endpoint)", _GET),
    Route("/v1/chat/completions/render", _P, "chat template rendering, no generation"),
    Route("/v1/completions/render", _P, "prompt rendering, no generation"),
    Route("/v1/models", _P, "served models", _GET),
    Route("/version", _P, "vLLM version", _GET),
    Route("/load", _P, "vLLM's count of requests in its server", _GET),
    Route("/ping", _P, "SageMaker health check", ("GET", "POST")),
    Route("/engine/health", _P, "vLLM's /health", _GET, upstream_path="/health"),
    Route("/engine/ready", _P, "vLLM's /ready", _GET, upstream_path="/ready"),
    Route("/engine/metrics", _P, "vLLM's /metrics", _GET, upstream_path="/metrics"),
    Route("/sleep", _O, "sleep mode: free GPU memory (stops serving)"),
    Route("/wake_up", _O, "sleep mode: wake"),
    Route("/is_sleeping", _O, "sleep mode: state", _GET),
    Route("/release_kv_cache_memory", _O, "sleep mode: free the KV cache"),
    Route("/pause", _O, "weight transfer: pause generation (aborts requests by default)"),
    Route("/resume", _O, "weight transfer: resume generation"),
    Route("/is_paused", _O, "weight transfer: state", _GET),
    Route("/abort_requests", _O, "abort in-flight requests (all by default)"),
    Route("/init_weight_transfer_engine", _O, "weight transfer: set up"),
    Route("/start_weight_update", _O, "weight transfer: begin"),
    Route("/start_draft_weight_update", _O, "weight transfer: begin (draft model)"),
    Route("/update_weights", _O, "weight transfer: replace model weights"),
    Route("/finish_weight_update", _O, "weight transfer: end"),
    Route("/update_weight_version", _O, "weight transfer: set the version label"),
    Route("/weight_info", _O, "weight transfer: version label", _GET),
    Route("/weight_checker", _O, "weight checksums; 'reset' overwrites the weights"),
    Route("/get_world_size", _O, "distributed world size", _GET),
    Route("/collective_rpc", _O, "call any worker method by name"),
    Route("/reset_prefix_cache", _O, "drop the prefix cache"),
    Route("/reset_mm_cache", _O, "drop the multimodal cache"),
    Route("/reset_encoder_cache", _O, "drop the encoder cache"),
    Route("/start_profile", _O, "start the torch profiler"),
    Route("/stop_profile", _O, "stop the torch profiler"),
    Route("/v1/load_lora_adapter", _O, "load a LoRA adapter from a path or URL"),
    Route("/v1/unload_lora_adapter", _O, "unload a LoRA adapter"),
    Route("/scale_elastic_ep", _O, "elastic expert parallelism: rescale"),
    Route("/is_scaling_elastic_ep", _O, "elastic expert parallelism: state"),
    Route("/server_info", _O, "full server configuration", _GET),
)

#: The row of a ``/v1/`` path no other row names.
V1_FALLBACK = Route("/v1/...", _P, "anything else under /v1/ (e.g. /v1/responses/{id})", ("any",))

OPERATOR_PATHS: frozenset[str] = frozenset(r.path for r in ROUTES if r.kind is Kind.OPERATOR)

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SLASHES = re.compile(r"//+")


class UnknownOperatorRouteError(ValueError):
    """An ``--allow-operator-route`` value that is not an operator route of the table."""


def check_allowed(paths: Iterable[str]) -> tuple[str, ...]:
    """The allowed operator paths, canonical; raises :class:`UnknownOperatorRouteError`."""
    result = []
    for path in paths:
        key = canonical(path.strip())
        if key not in OPERATOR_PATHS:
            raise UnknownOperatorRouteError(
                f"{path!r} is not an operator route; those are: {', '.join(sorted(OPERATOR_PATHS))}"
            )
        result.append(key)
    return tuple(dict.fromkeys(result))


def canonical(path: str) -> str:
    """``path`` as the table spells it: repeated slashes folded, no trailing slash."""
    if "//" in path:
        path = _SLASHES.sub("/", path)
    return path.rstrip("/") or "/"


class RouteTable:
    """The table with the operator's ``--allow-operator-route`` choices applied."""

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        allow = set(check_allowed(allowed))
        self._rows: dict[str, Route] = {
            r.path: replace(r, allowed=True) if r.path in allow else r for r in ROUTES
        }

    def lookup(self, path: str) -> Route | None:
        """The row of a percent-decoded request path, or None: the shim answers 404.

        A ``/v1/`` path must also stay under ``/v1/`` (:func:`stays_under_v1`), so that only
        the configured upstream's API is reachable however the upstream normalises it.
        """
        row = self._rows.get(path)  # the common case: exactly as the table spells it
        if row is not None:
            return row
        # No row has a control character, so none can match one; stays_under_v1 refuses them.
        row = self._rows.get(canonical(path))
        if row is not None:
            return row
        if path.startswith("/v1/") and stays_under_v1(path):
            return V1_FALLBACK
        return None

    def rows(self) -> tuple[Route, ...]:
        return tuple(self._rows.values())


def stays_under_v1(path: str) -> bool:
    """Whether ``path`` (percent-decoded) stays under ``/v1/``: no dot segments, no backslashes."""
    if not path.startswith("/v1/") or "\\" in path or "%" in path:
        # "%" after decoding is double encoding: an upstream that decodes again must not see "..".
        return False
    if _CONTROL.search(path):
        return False
    if "/." not in path:
        return True  # no segment can be "." or ".."
    return all(segment not in (".", "..") for segment in path.split("/"))


def render_markdown(rows: Iterable[Route] = ROUTES) -> str:
    """The table as docs/reference.md shows it."""
    kinds = {
        Kind.ENGINE: "engine: admitted",
        Kind.PASS: "pass through",
        Kind.OPERATOR: "operator: 403",
    }
    lines = ["| path | methods | kind | errors | what |", "| --- | --- | --- | --- | --- |"]
    for r in (*rows, V1_FALLBACK):
        path = f"`{r.path}`" + (f" (upstream `{r.upstream_path}`)" if r.upstream_path else "")
        lines.append(f"| {path} | {', '.join(r.methods)} | {kinds[r.kind]} | {r.shape.value} | {r.what} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
