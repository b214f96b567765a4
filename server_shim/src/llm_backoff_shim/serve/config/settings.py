"""The shim's configuration: one validated pydantic-settings model.

Values come from command-line flags, ``LLM_BACKOFF_SHIM_<FIELD>`` environment
variables and a TOML file (``--config``); flag > env > file > default.
:mod:`~llm_backoff_shim.serve.config.sources` merges them,
:mod:`~llm_backoff_shim.serve.config.flags` builds the flags,
:mod:`~llm_backoff_shim.serve.config.file` reads and writes the file and
:mod:`~llm_backoff_shim.serve.config.values` holds the names and value syntax.

Per-class values are maps from class name to value (``class_max_queue``,
``reserved_share``, ...; :data:`PER_CLASS_KEYS`): ``NAME=value,...`` on the command
line and in the environment, one ``[classes.NAME]`` table per class in the file.

This module is longer than the others for one reason: the model is one class, and its
fields with their descriptions are the single reference that ``--help``, ``--help-all``
and the example file print.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from llm_backoff_shim.serve.api.auth import ApiKeys, read_keys_file
from llm_backoff_shim.serve.api.routes import UnknownOperatorRouteError, check_allowed
from llm_backoff_shim.serve.config.slices import GateSettings, IntakeSettings
from llm_backoff_shim.serve.config.values import (
    DEFAULT_CLASSES,
    ENV_PREFIX,
    PER_CLASS_KEYS,
    Budget,
    ClassLimits,
    NotBool,
    Share,
    check_class_names,
    check_networks,
    not_bool,
    only_bool,
    parse_class_map,
    scalar_kind,
    split_list,
)


class ShimSettings(BaseSettings):
    """Everything ``llm-backoff-shim serve`` can be told.

    Per-class queue limits (``class_max_queue`` ...) default to the shared
    ``max_queue`` / ``max_queue_wait``; ``max_queue`` is also the bound on all
    classes together, so "at most --max-queue waiting" holds whatever the classes. Without
    either, a class's queue holds what the engine drains within its wait at the measured pace.
    Field names are the keys of the ``--config`` file.
    """

    # A number field refuses inf and nan (as SimConfig does).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, allow_inf_nan=False)

    upstream: AnyHttpUrl = Field(
        default=AnyHttpUrl("http://127.0.0.1:8000"),
        description="base URL of the OpenAI-compatible engine (vLLM), e.g. http://127.0.0.1:8000",
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(default=8080, ge=0, le=65535, description="port to listen on (0: any free port)")
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="serve /metrics and /shim/state on this port of --host instead of the main one "
        "(/health too); firewall it apart from the proxy's port",
    )
    max_concurrency: int = Field(
        default=8, ge=1, le=100_000, description="most generation requests in flight upstream at once"
    )
    max_inflight_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000_000,
        description="most KV-cache tokens the generation requests in flight may hold together, each "
        "counted as its prompt (in the engine's tokens, from its /tokenize) plus the answer the class's "
        "recent answers say (90th percentile, at most its max_tokens; before any, a slot's share of the "
        "budget); a request counts what its own class and the higher classes hold (batch: everything, "
        "interactive: its own); one costing more is admitted once those hold none (none: the request "
        "count cap alone; docs/shim.md, cost budget)",
    )
    max_queue: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="most generation requests waiting for a slot, all classes together (0: no queue; "
        "none: each class holds what the engine drains within its queue wait at the pace measured)",
    )
    max_queue_wait: float = Field(
        default=10.0, gt=0, le=86_400, description="seconds a request may wait in the queue before a 429"
    )
    class_max_queue: Annotated[dict[str, Annotated[int, NotBool, Field(ge=0, le=1_000_000)]], NoDecode] = (
        Field(
            default={},
            description="queue bound per class (class=N,...); a class not named uses --max-queue, or "
            "without it what the engine drains within the class's queue wait",
        )
    )
    class_max_queue_wait: Annotated[
        dict[str, Annotated[float, NotBool, Field(gt=0, le=86_400)]], NoDecode
    ] = Field(
        default={},
        description="queue wait per class in seconds (class=seconds,...); a class not named uses "
        "--max-queue-wait",
    )
    classes: Annotated[tuple[str, ...], NoDecode] = Field(
        default=DEFAULT_CLASSES,
        description="traffic classes, highest priority first, comma-separated (x-request-class values)",
    )
    default_class: str = Field(
        default="interactive", description="class of requests without an x-request-class header"
    )
    reserved_share: Annotated[dict[str, Share], NoDecode] = Field(
        default={"interactive": 0.25},
        description="share of the in-flight slots that lower classes may never take, per class "
        "(class=fraction,...; rounded up to whole slots)",
    )
    min_share: Annotated[dict[str, Share], NoDecode] = Field(
        default={"batch": 0.1},
        description="share of the in-flight slots a class gets even while higher classes wait, once "
        "its queue's head must start to be served within its queue wait, and not before it has spent half "
        "of it (anti-starvation; class=fraction,...; "
        "rounded up to whole slots)",
    )
    ttft_slo: Annotated[dict[str, Budget], NoDecode] = Field(
        default={},
        description="time-to-first-token budget per class in seconds (e.g. interactive=2,batch=60); "
        "turns on queue-time SLO shedding for the classes named",
    )
    forward_priority: bool = Field(
        default=False,
        description="set vLLM's 'priority' request field from the class: its position in --classes, "
        "0 for the first (upstream runs --scheduling-policy priority)",
    )
    tenants_file: Path | None = Field(
        default=None,
        description="JSON or TOML file: per-API-key (or tenant-header value) limits and allowed classes",
    )
    tenant_header: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$",
        description="identify tenants by this request header instead of the API key",
    )
    tenant_requests_per_minute: float | None = Field(
        default=None, gt=0, description="request limit of tenants the tenants file does not list"
    )
    tenant_tokens_per_minute: float | None = Field(
        default=None, gt=0, description="LLM-token limit of tenants the tenants file does not list"
    )
    redis_url: str | None = Field(
        default=None,
        pattern=r"^(redis|rediss|unix)://",
        description="keep tenant buckets in this Redis so several shims enforce one quota",
    )
    fleet_retry_after: bool = Field(
        default=False,
        description=(
            "behind a load balancer that asks every replica before it refuses: answer a call the "
            "whole fleet refuses with the soonest replica's Retry-After (the replicas share each "
            "call's hints, by X-Request-Id, in --redis-url)"
        ),
    )
    engine_metrics: bool = Field(
        default=False,
        description="scrape the upstream's /metrics every 0.25 s and admit nothing new while the engine is "
        "saturated: a request waiting in it, or its KV-cache usage at 0.95 (docs/shim.md, engine-aware "
        "admission)",
    )
    adaptive_concurrency: bool = Field(
        default=False,
        description="adapt the concurrency limit to measured time to first byte (gradient), between "
        "1 and --max-concurrency",
    )
    reject_status: int = Field(default=429, description="HTTP status of admission rejections: 429 or 503")
    retry_after_min: float = Field(
        default=1.0, gt=0, le=86_400, description="smallest Retry-After hint, seconds"
    )
    retry_after_max: float = Field(
        default=30.0, gt=0, le=86_400, description="largest Retry-After hint, seconds"
    )
    returning_first: bool = Field(
        default=True,
        description="serve retries (x-stainless-retry-count >= 1 with an x-request-timeout-ms budget) "
        "before fresh requests of their class, and keep queue places for callers told to come back",
    )
    initial_service_time: float = Field(
        default=1.0,
        gt=0,
        le=3_600,
        description="assumed seconds per request until the first completion is measured (the prior "
        "of Retry-After and of the queue bounds without --max-queue)",
    )
    upstream_read_timeout: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="seconds the upstream may stay silent before its answer's head and within a "
        "non-streaming answer (prefill of a long prompt included); an event stream, once its first event "
        "has come, may stay silent a minute",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="log level of the shim and uvicorn (request lines are info)"
    )
    log_format: Literal["plain", "json"] = Field(
        default="plain",
        description="log line format: plain (key=value request lines) or json (one object per line)",
    )
    access_log: bool = Field(
        default=True,
        description="log one line per /v1/ request to stdout (class, outcome, status, timings; never "
        "keys or prompts)",
    )
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1, le=1024**3, description="largest request body; larger ones get a 413"
    )
    body_read_timeout: float = Field(
        default=30.0,
        gt=0,
        le=3_600,
        description="seconds a client may take to send a request body (408 after)",
    )
    http_path: Literal["auto", "fast", "public"] = Field(
        default="auto",
        description="how connections are served: fast (uvicorn's httptools protocol, extended), public "
        "(uvicorn's h11 protocol, public interfaces only) or auto (fast when the start-up check passes)",
    )
    trusted_proxies: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="addresses or networks (comma-separated, e.g. 10.0.0.0/8) of proxies in front of the "
        "shim whose X-Forwarded-For/Forwarded are kept and appended to; from any other peer they are "
        "replaced by the peer's address",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="require this key as 'Authorization: Bearer <key>' (prefer the environment variable)",
    )
    api_keys_file: str | None = Field(
        default=None, min_length=1, description="file of accepted API keys, one per line ('#' comments)"
    )
    allow_operator_route: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="forward this operator route of the engine (e.g. /sleep) instead of refusing it "
        "with a 403; repeat the flag, or comma-separate in the variable (docs/shim.md, route table)",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        """A number field refuses a boolean and a boolean field a number, from any source."""
        assert info.field_name is not None
        kind = scalar_kind(cls.model_fields[info.field_name].annotation)
        if kind == "number":
            return not_bool(value)
        if kind == "boolean":
            return only_bool(value)
        return value

    @field_validator("allow_operator_route", mode="before")
    @classmethod
    def _operator_routes(cls, value: Any) -> Any:
        paths = [p for p in value.split(",") if p.strip()] if isinstance(value, str) else value
        try:
            return check_allowed(paths)
        except UnknownOperatorRouteError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("api_keys_file")
    @classmethod
    def _keys_file(cls, value: str | None) -> str | None:
        if value is not None:
            read_keys_file(value)  # fail at start-up, not on the first request
        return value

    def api_keys(self) -> ApiKeys:
        """The keys clients must present; empty (authentication off) when none is configured."""
        keys = [] if self.api_key is None else [self.api_key.get_secret_value()]
        if self.api_keys_file is not None:
            keys += read_keys_file(self.api_keys_file)
        return ApiKeys(keys)

    @field_validator("upstream")
    @classmethod
    def _no_path_query(cls, value: AnyHttpUrl) -> AnyHttpUrl:
        if value.query or value.fragment:
            raise ValueError("must be a base URL without query or fragment")
        if value.path not in (None, "", "/"):
            raise ValueError("must be a base URL without a path (the shim forwards /v1/... itself)")
        return value

    @field_validator("reject_status")
    @classmethod
    def _reject_status(cls, value: int) -> int:
        # A Literal[429, 503] would refuse the string "503" from the environment.
        if value not in (429, 503):
            raise ValueError("must be 429 or 503")
        return value

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _address_list(cls, value: Any) -> Any:
        return split_list(value)

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_networks(value)

    @field_validator("classes", mode="before")
    @classmethod
    def _class_list(cls, value: Any) -> Any:
        return split_list(value, lower=True)

    @field_validator("classes")
    @classmethod
    def _class_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_class_names(value)

    @field_validator(*PER_CLASS_KEYS.values(), mode="before")
    @classmethod
    def _class_map(cls, value: Any) -> Any:
        return parse_class_map(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _ranges(self) -> ShimSettings:
        if self.retry_after_max < self.retry_after_min:
            raise ValueError(
                f"retry_after_max ({self.retry_after_max}) must be >= "
                f"retry_after_min ({self.retry_after_min})"
            )
        if self.fleet_retry_after and self.redis_url is None:
            raise ValueError("fleet_retry_after needs redis_url: the replicas share each call's hints there")
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError("metrics_port must differ from port")
        if self.default_class not in self.classes:
            raise ValueError(
                f"default_class {self.default_class!r} is not one of classes {list(self.classes)}"
            )
        for name in PER_CLASS_KEYS.values():
            unknown = sorted(set(getattr(self, name)) - set(self.classes))
            if unknown:
                raise ValueError(f"{name} names unknown classes {unknown}; classes are {list(self.classes)}")
        if sum(self.reserved_share.values()) > 1.0:
            raise ValueError("reserved_share adds up to more than 1")
        if self.tenants_file is not None:
            # Imported here: tenants imports this module's parse helpers.
            from llm_backoff_shim.decide.tenants import TenantsFileError, load_tenants_file

            try:
                load_tenants_file(self.tenants_file, self.classes)
            except TenantsFileError as exc:
                raise ValueError(str(exc)) from None
        return self

    @property
    def upstream_base(self) -> str:
        """The upstream URL without a trailing slash, ready for ``base + "/v1/..."``."""
        return str(self.upstream).rstrip("/")

    def class_limits(self) -> dict[str, ClassLimits]:
        """Queue bound and wait per class, highest priority first: the class's entry in
        ``class_max_queue`` / ``class_max_queue_wait``, else the shared ``max_queue`` /
        ``max_queue_wait``."""
        return {
            name: ClassLimits(
                max_queue=self.class_max_queue.get(name, self.max_queue),
                max_queue_wait=self.class_max_queue_wait.get(name, self.max_queue_wait),
            )
            for name in self.classes
        }

    def intake_settings(self) -> IntakeSettings:
        """The intake's slice (slices.py)."""
        return IntakeSettings(
            allow_operator_route=self.allow_operator_route,
            api_keys=self.api_keys(),
            max_body_bytes=self.max_body_bytes,
            body_read_timeout=self.body_read_timeout,
        )

    def gate_settings(self) -> GateSettings:
        """The admission gate's slice (slices.py)."""
        return GateSettings(
            reject_status=self.reject_status,
            fleet_hints_url=self.redis_url if self.fleet_retry_after else None,
        )

    def vllm_priority(self) -> dict[str, int]:
        """The ``priority`` each class sends to vLLM (lower is served first): its position in
        ``classes``, which is the shim's own order of the classes."""
        return {name: index for index, name in enumerate(self.classes)}
