"""What ``serve`` says when it starts: one INFO line, and warnings about the environment.

The line names what an operator checks first: the listen address and serving path, the
upstream and whether it answered a quick probe, the concurrency cap and the queues, where
``/metrics`` is served, and every setting that is not at its default (secrets masked).

The probe is ``GET /v1/models`` on the upstream, bounded in total by
:data:`PROBE_TIMEOUT` (resolution, connection and answer together), run before the
server starts. Its result is information only: a shim starts whatever it says, since
the engine may well come up after the shim (``/ready`` reports it then).
"""

from __future__ import annotations

import difflib
import http.client
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import SecretStr

from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import CONFIG_ENV
from llm_backoff_shim.serve.config.values import ENV_PREFIX, env_name

#: Longest the upstream probe may delay start-up, in seconds.
PROBE_TIMEOUT = 1.5

#: The upstream path probed (vLLM and the OpenAI API list their models there).
PROBE_PATH = "/v1/models"


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """One message per ``LLM_BACKOFF_SHIM_*`` variable that names no setting (it is ignored).

    Names compare without case, as the settings read them; the suggestion compares the
    part after the prefix, which every name shares.
    """
    known = {env_name(name).removeprefix(ENV_PREFIX) for name in ShimSettings.model_fields}
    known.add(CONFIG_ENV.removeprefix(ENV_PREFIX))
    messages = []
    for key in sorted(environ):
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper.removeprefix(ENV_PREFIX) in known:
            continue
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), sorted(known), n=1)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
        messages.append(f"environment variable {key} names no setting and is ignored{hint}")
    return messages


#: The variable uvicorn and gunicorn read as their number of worker processes.
WORKERS_ENV = "WEB_CONCURRENCY"


def several_workers_warning(environ: Mapping[str, str]) -> str | None:
    """Why ``WEB_CONCURRENCY`` (when it asks for more than one process) is ignored, or None.

    ``serve`` runs one process whatever the variable says: admission state (slots,
    queues, the drain estimate) is per process, so N processes would each admit
    ``--max-concurrency`` and the engine would see N times the cap. Platforms set the
    variable for every service (it sizes web servers to the machine), so it is ignored
    with a warning rather than refused.
    """
    value = environ.get(WORKERS_ENV, "").strip()
    if value in ("", "1"):
        return None
    return (
        f"{WORKERS_ENV}={value} is ignored: serve runs one process per engine, since each process "
        "admits up to --max-concurrency on its own; to serve several engines, run one shim per "
        "engine (docs/deploy.md)"
    )


def probe_upstream(base: str, timeout: float = PROBE_TIMEOUT) -> str:
    """``"answered GET /v1/models with 200"`` (any HTTP status) or ``"did not answer GET /v1/models:
    <reason>"``, within ``timeout``.

    Runs in a daemon thread joined with ``timeout``, so a resolver or a host that never
    answers cannot hold start-up longer than that.
    """
    result: list[str] = []

    def probe() -> None:
        parts = urlsplit(base)
        connection_class = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        connection = connection_class(parts.netloc, timeout=timeout)
        try:
            connection.request("GET", PROBE_PATH, headers={"accept": "application/json"})
            response = connection.getresponse()
            result.append(f"answered GET {PROBE_PATH} with {response.status}")
        except Exception as exc:  # any failure is the answer this reports
            text = str(exc).strip().splitlines()
            reason = type(exc).__name__ + (f": {text[0]}" if text else "")
            result.append(f"did not answer GET {PROBE_PATH}: {reason}")
        finally:
            connection.close()

    thread = threading.Thread(target=probe, name="upstream-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"did not answer GET {PROBE_PATH} within {timeout:g} s"


def _masked_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _shown(name: str, value: Any) -> str:
    if isinstance(value, SecretStr):
        return "***"
    if name == "redis_url" and isinstance(value, str):
        return _masked_url(value)
    if isinstance(value, dict):
        return ",".join(
            f"{key}={item:g}" if isinstance(item, float) else f"{key}={item}" for key, item in value.items()
        )
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).rstrip("/") if name == "upstream" else str(value)


def changed_settings(settings: ShimSettings) -> dict[str, str]:
    """The settings not at their default, as shown in the start-up line (secrets masked)."""
    changed = {}
    for name, field in ShimSettings.model_fields.items():
        value = getattr(settings, name)
        if value != field.default:
            changed[name] = _shown(name, value)
    return changed


def listen_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _cost_mode(settings: ShimSettings) -> str:
    """How admission counts, as the start-up line says it after max_concurrency."""
    budget = settings.max_inflight_tokens
    if budget is None:
        return " (requests counted, no cost budget)"
    return (
        f" and max_inflight_tokens {budget} (cost budget: prompt in the engine's tokens + the answer "
        "its recent answers say, at most max_tokens)"
    )


def startup_line(settings: ShimSettings, *, path: str, metrics_url: str, upstream: str) -> str:
    """The start-up line: ``upstream`` is :func:`probe_upstream`'s result."""
    address = listen_url(settings.host, settings.port)
    if settings.port == 0:
        address += " (any free port: uvicorn's line names it)"
    queues = ", ".join(
        f"{name} {'drained' if limits.max_queue is None else limits.max_queue}/{limits.max_queue_wait:g} s"
        for name, limits in settings.class_limits().items()
    )
    total = (
        "each what the engine drains within its wait"
        if settings.max_queue is None
        else f"{settings.max_queue} places in all"
    )
    changed = changed_settings(settings)
    differ = " ".join(f"{name}={value}" for name, value in changed.items()) or "none"
    return (
        f"listening on {address} ({path} path); upstream {settings.upstream_base} {upstream}; "
        f"max_concurrency {settings.max_concurrency}{_cost_mode(settings)}; queue places/wait: {queues} "
        f"({total}); metrics on {metrics_url}; "
        f"settings not at their default: {differ}"
    )
