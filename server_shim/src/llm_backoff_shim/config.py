"""The shim's configuration: one validated pydantic-settings model.

Values come from ``LLM_BACKOFF_SHIM_<FIELD>`` environment variables and from
command-line flags (``--max-queue`` <-> ``LLM_BACKOFF_SHIM_MAX_QUEUE``); flags win.

Why argparse in front of pydantic-settings rather than pydantic-settings' own CLI
source: we want one hand-written help line per flag, the exact flag names of the
issue, and control of the failure path (a one-line message and exit status 2, never
a traceback). Flags are passed to the model as strings so that a bad value gets the
same validation message whether it came from a flag or from the environment.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AnyHttpUrl, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "LLM_BACKOFF_SHIM_"

#: The traffic classes the shim knows, highest priority first.
DEFAULT_CLASSES: tuple[str, ...] = ("interactive", "batch")


class ShimSettings(BaseSettings):
    """Everything ``llm-backoff-shim serve`` can be told.

    Per-class queue limits (``interactive_max_queue`` ...) default to the shared
    ``max_queue`` / ``max_queue_wait``; ``max_queue`` is also the bound on all
    classes together, so "at most --max-queue waiting" holds whatever the classes.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

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
        description="also serve /metrics on this separate port (it is always on the main port too)",
    )
    max_concurrency: int = Field(
        default=8, ge=1, le=100_000, description="most generation requests in flight upstream at once"
    )
    max_queue: int = Field(
        default=20,
        ge=0,
        le=1_000_000,
        description="most generation requests waiting for a slot, all classes together (0: no queue)",
    )
    max_queue_wait: float = Field(
        default=10.0, gt=0, le=86_400, description="seconds a request may wait in the queue before a 429"
    )
    interactive_max_queue: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="queue bound for class interactive (default --max-queue)",
    )
    batch_max_queue: int | None = Field(
        default=None, ge=0, le=1_000_000, description="queue bound for class batch (default --max-queue)"
    )
    interactive_max_queue_wait: float | None = Field(
        default=None,
        gt=0,
        le=86_400,
        description="queue wait for class interactive (default --max-queue-wait)",
    )
    batch_max_queue_wait: float | None = Field(
        default=None, gt=0, le=86_400, description="queue wait for class batch (default --max-queue-wait)"
    )
    default_class: Literal["interactive", "batch"] = Field(
        default="interactive", description="class of requests without an x-request-class header"
    )
    reject_status: int = Field(default=429, description="HTTP status of admission rejections: 429 or 503")
    retry_after_min: float = Field(
        default=1.0, gt=0, le=86_400, description="smallest Retry-After hint, seconds"
    )
    retry_after_max: float = Field(
        default=30.0, gt=0, le=86_400, description="largest Retry-After hint, seconds"
    )
    initial_service_time: float = Field(
        default=1.0,
        gt=0,
        le=3_600,
        description="assumed seconds per request until the first completion is measured (Retry-After prior)",
    )
    upstream_connect_timeout: float = Field(
        default=5.0, gt=0, le=600, description="seconds to open a connection to the upstream"
    )
    upstream_read_timeout: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="seconds the upstream may stay silent mid-response (prefill of a long prompt included)",
    )
    upstream_keepalive: float = Field(
        default=4.0,
        gt=0,
        le=3_600,
        description="seconds an idle pooled upstream connection is kept; keep it below the upstream's "
        "own idle timeout (uvicorn/vLLM: 5 s)",
    )
    ready_path: str = Field(
        default="/health", pattern=r"^/", description="upstream path probed by GET /ready (vLLM: /health)"
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="uvicorn log level"
    )

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

    @field_validator(
        "max_queue_wait",
        "retry_after_min",
        "retry_after_max",
        "initial_service_time",
        "upstream_connect_timeout",
        "upstream_read_timeout",
        "upstream_keepalive",
        "interactive_max_queue_wait",
        "batch_max_queue_wait",
    )
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @model_validator(mode="after")
    def _ranges(self) -> ShimSettings:
        if self.retry_after_max < self.retry_after_min:
            raise ValueError(
                f"retry_after_max ({self.retry_after_max}) must be >= "
                f"retry_after_min ({self.retry_after_min})"
            )
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError("metrics_port must differ from port")
        return self

    @property
    def upstream_base(self) -> str:
        """The upstream URL without a trailing slash, ready for ``base + "/v1/..."``."""
        return str(self.upstream).rstrip("/")

    def class_limits(self) -> dict[str, ClassLimits]:
        """Queue bound and wait per class, highest priority first."""
        return {
            "interactive": ClassLimits(
                max_queue=_pick(self.interactive_max_queue, self.max_queue),
                max_queue_wait=_pick(self.interactive_max_queue_wait, self.max_queue_wait),
            ),
            "batch": ClassLimits(
                max_queue=_pick(self.batch_max_queue, self.max_queue),
                max_queue_wait=_pick(self.batch_max_queue_wait, self.max_queue_wait),
            ),
        }


@dataclass(frozen=True)
class ClassLimits:
    max_queue: int
    max_queue_wait: float


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


class ConfigError(ValueError):
    """Settings that cannot start a shim; ``str()`` is a one-line, user-facing message."""


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def build_parser(prog: str = "llm-backoff-shim serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Admission-controlled OpenAI-compatible proxy in front of vLLM: caps what is in "
        "flight, keeps short bounded queues per traffic class and answers the rest at once with a 429 "
        "(or 503) carrying an estimated Retry-After. Every flag can also be set through the environment "
        f"variable {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}MAX_QUEUE=50); flags win.",
    )
    for name, field in ShimSettings.model_fields.items():
        default = field.default
        shown = "none" if default is None else str(default)
        parser.add_argument(
            flag_name(name),
            dest=name,
            default=None,
            metavar=name.split("_")[-1].upper(),
            help=f"{field.description} [env {env_name(name)}; default {shown}]",
        )
    return parser


def load_settings(argv: Sequence[str], *, prog: str = "llm-backoff-shim serve") -> ShimSettings:
    """Parse flags, merge them over the environment, validate.

    Raises :class:`ConfigError` with a one-line message on bad values; argparse itself
    exits (status 2) on unknown flags and prints ``--help``.
    """
    namespace = build_parser(prog).parse_args(list(argv))
    given = {key: value for key, value in vars(namespace).items() if value is not None}
    try:
        return ShimSettings(**given)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, set(given))) from None


def _describe(exc: ValidationError, from_flags: set[str]) -> str:
    problems = []
    for error in exc.errors(include_url=False):
        loc = [str(part) for part in error["loc"]]
        field = loc[0] if loc else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        if field in ShimSettings.model_fields:
            source = flag_name(field) if field in from_flags else env_name(field)
            value = error.get("input")
            problems.append(f"{source}={value!s}: {message}")
        else:
            problems.append(message)
    return "invalid configuration: " + "; ".join(problems)
