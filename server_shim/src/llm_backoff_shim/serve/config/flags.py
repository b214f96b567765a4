"""The command-line flags of ``llm-backoff-shim serve``, generated from :class:`ShimSettings`.

Every field is a flag (``max_queue`` -> ``--max-queue``). ``--help`` shows the common
path in groups (:data:`COMMON`); the other flags are accepted but hidden
(``argparse.SUPPRESS``), so scripts that pass them keep working, and ``--help-all``
lists every flag in its group (:data:`GROUPS`). Values stay strings here: the model
validates them, so a bad value gets the same message from a flag, a variable or a file.

Why argparse in front of pydantic-settings rather than pydantic-settings' own CLI
source: one hand-written help line per flag, groups, hidden flags, and control of the
failure path (a one-line message and exit status 2, never a traceback).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.values import ENV_PREFIX, env_name, flag_name

#: The groups of ``--help``: the settings most deployments set.
COMMON: dict[str, tuple[str, ...]] = {
    "upstream": ("upstream",),
    "listen address": ("host", "port"),
    "concurrency": ("max_concurrency", "max_inflight_tokens"),
    "queue": ("max_queue", "class_max_queue"),
    "queue wait": ("max_queue_wait", "class_max_queue_wait"),
    "classes": ("classes", "default_class", "reserved_share", "min_share"),
    "rejections": ("reject_status", "retry_after_min", "retry_after_max"),
    "metrics": ("metrics_port",),
}

#: The groups of ``--help-all``: every field of :class:`ShimSettings`, once.
GROUPS: dict[str, tuple[str, ...]] = {
    "upstream": ("upstream", "upstream_read_timeout"),
    "listen address": ("host", "port", "http_path", "trusted_proxies"),
    "client limits": ("max_body_bytes", "body_read_timeout"),
    "concurrency": ("max_concurrency", "max_inflight_tokens", "adaptive_concurrency", "engine_metrics"),
    "queue": ("max_queue", "class_max_queue", "returning_first"),
    "queue wait": ("max_queue_wait", "class_max_queue_wait"),
    "classes": (
        "classes",
        "default_class",
        "reserved_share",
        "min_share",
        "forward_priority",
    ),
    "queue-time SLO": ("ttft_slo",),
    "rejections": (
        "reject_status",
        "retry_after_min",
        "retry_after_max",
        "initial_service_time",
        "fleet_retry_after",
    ),
    "tenants": (
        "tenants_file",
        "tenant_header",
        "tenant_requests_per_minute",
        "tenant_tokens_per_minute",
        "redis_url",
    ),
    "authentication": ("api_key", "api_keys_file", "allow_operator_route"),
    "metrics and logs": ("metrics_port", "log_level", "log_format", "access_log"),
}

#: The table of each group in the ``--config`` file (``[queue]`` holds ``max_queue = 20``):
#: the one definition the file's reader and writer and docs/reference.md use. Per-class
#: values go in the ``[classes.NAME]`` tables whatever their group, so no group's table is
#: ``classes``, and ``[slo]`` stays empty (its one setting, ``ttft_slo``, is per class).
SECTIONS: dict[str, str] = {
    "upstream": "upstream",
    "listen address": "listen",
    "client limits": "limits",
    "concurrency": "concurrency",
    "queue": "queue",
    "queue wait": "queue_wait",
    "classes": "traffic",
    "queue-time SLO": "slo",
    "rejections": "rejections",
    "tenants": "tenants",
    "authentication": "auth",
    "metrics and logs": "metrics",
}

#: Flags given once per value (``--allow-operator-route /sleep --allow-operator-route /wake_up``).
REPEATABLE = frozenset({"allow_operator_route"})

PROG = "llm-backoff-shim serve"

_DESCRIPTION = (
    "Admission-controlled OpenAI-compatible proxy in front of vLLM: caps what is in flight, keeps "
    "short bounded queues per traffic class and answers the rest at once with a 429 (or 503) "
    "carrying an estimated Retry-After. "
)

_EPILOG = (
    f"Every setting can also be given as the environment variable {ENV_PREFIX}<FLAG> "
    f"(e.g. {ENV_PREFIX}MAX_QUEUE=50) and in the --config file (max_queue = 50 in the table of "
    "its group, [queue]; per-class values in one [classes.NAME] table per class). "
    "Precedence: flag > environment > file > default. "
    "--help shows the common settings; --help-all lists all of them (docs/shim.md, Configuration)."
)


def _shown_default(default: Any) -> str:
    if default is None:
        return "none"
    if isinstance(default, dict):
        return ",".join(f"{k}={v}" for k, v in default.items()) or "none"
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    return str(default)


def _add_field(group: Any, name: str, *, hidden: bool) -> None:
    field = ShimSettings.model_fields[name]
    default = field.default
    # Booleans work as bare switches (--forward-priority) and with a value (... false).
    extra: dict[str, Any] = {"nargs": "?", "const": "true"} if field.annotation is bool else {}
    if name in REPEATABLE:
        extra = {"action": "append"}
    if field.annotation is bool:
        metavar = "BOOL"
    elif isinstance(default, dict):
        metavar = "CLASS=VALUE,..."
    else:
        metavar = name.split("_")[-1].upper()
    description = field.description or ""
    # A description that says its default in words ("(default: --host)") is not given a second one.
    shown = "" if "(default:" in description else f"; default {_shown_default(default)}"
    text = f"{description} [env {env_name(name)}{shown}]"
    group.add_argument(
        flag_name(name),
        dest=name,
        default=None,
        metavar=metavar,
        help=argparse.SUPPRESS if hidden else text,
        **extra,
    )


class _HelpAll(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        build_parser(parser.prog, show_all=True).print_help()
        parser.exit(0)


def build_parser(prog: str = PROG, *, show_all: bool = False) -> argparse.ArgumentParser:
    """The ``serve`` parser: every field a flag; with ``show_all`` all of them in ``--help``."""
    # No abbreviations: --max-conc would silently mean --max-concurrency, and a flag added
    # later could change what an abbreviation in a deployed command line means.
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False)
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help="TOML file of settings (keys as in --help-all with '_' for '-'; "
        f"example: server_shim/deploy/shim.toml) [env {ENV_PREFIX}CONFIG]",
    )
    parser.add_argument("--help-all", action=_HelpAll, help="list every setting, in groups, and exit")
    shown = GROUPS if show_all else COMMON
    for title, names in shown.items():
        group = parser.add_argument_group(title)
        for name in names:
            _add_field(group, name, hidden=False)
    listed = {name for names in shown.values() for name in names}
    for name in ShimSettings.model_fields:
        if name not in listed:
            _add_field(parser, name, hidden=True)
    return parser
