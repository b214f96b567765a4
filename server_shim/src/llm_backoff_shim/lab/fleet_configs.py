"""The shipped load-balancer configurations, rendered for a fleet on loopback.

``server_shim/deploy/nginx/llm-backoff-fleet.conf`` and
``server_shim/deploy/haproxy/llm-backoff-fleet.cfg`` are what users copy; the loopback fleet
(:mod:`llm_backoff_shim.lab.fleet`) runs them with only addresses and file paths changed, so
what the tests exercise is what is shipped:

- nginx: the ``server`` lines of the upstream block become one per replica (keeping the
  first line's parameters) and ``listen`` becomes the load balancer's loopback address. The
  file is an http-context file; :func:`nginx_main_config` wraps it in a minimal ``nginx.conf``
  whose pid, logs and temporary paths are in the run's directory.
- HAProxy: the backend's ``server`` lines become one per replica (``replica1``...), ``bind``
  becomes the loopback address and the runtime API's ``stats socket`` is in the run's
  directory (the shipped file logs to stdout: the child's log).

A line the renderer expects and does not find raises :class:`ConfigShapeError`, so a change
to a shipped file that would make the fleet run something else fails loudly.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path

#: ``server_shim/deploy`` in a checkout of the repository.
DEPLOY_DIR = Path(__file__).resolve().parents[3] / "deploy"
NGINX_CONFIG = DEPLOY_DIR / "nginx" / "llm-backoff-fleet.conf"
HAPROXY_CONFIG = DEPLOY_DIR / "haproxy" / "llm-backoff-fleet.cfg"

LOAD_BALANCERS = ("nginx", "haproxy")

#: Shim flags each load balancer's recipe needs (the caller's own flags come after, and win).
LB_SHIM_FLAGS: dict[str, tuple[str, ...]] = {
    "nginx": (),
    # HAProxy's retry-on cannot match a 429: the shims refuse with 503.
    "haproxy": ("--reject-status", "503"),
}

#: The path both configurations answer for the load balancer's own liveness.
LB_HEALTH_PATH = "/lb/health"


class ConfigShapeError(ValueError):
    """A shipped configuration no longer has the lines the renderer replaces."""


def lb_binary(lb: str) -> str | None:
    """The load balancer's executable (Debian installs both in /usr/sbin), or None."""
    if lb not in LOAD_BALANCERS:
        raise ValueError(f"unknown load balancer {lb!r}: one of {', '.join(LOAD_BALANCERS)}")
    found = shutil.which(lb)
    if found is None and Path(f"/usr/sbin/{lb}").exists():
        found = f"/usr/sbin/{lb}"
    return found


def _replace_once(pattern: str, replacement: str, text: str, what: str) -> str:
    new, count = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
    if count != 1:
        raise ConfigShapeError(f"the configuration has no {what} line to replace")
    return new


def _replace_servers(text: str, pattern: str, lines: Sequence[str], what: str) -> str:
    """The block of consecutive ``server`` lines matching ``pattern`` replaced by ``lines``."""
    matches = list(re.finditer(pattern, text, flags=re.MULTILINE))
    if not matches:
        raise ConfigShapeError(f"the configuration has no {what} server line to replace")
    start, end = matches[0].start(), matches[-1].end()
    return text[:start] + "\n".join(lines) + text[end:]


_NGINX_SERVER = r"^(?P<indent>[ \t]*)server[ \t]+(?P<addr>[^\s;]+:\d+)(?P<params>[^;\n]*);[ \t]*$"


def render_nginx(replicas: Sequence[str], listen: str, text: str | None = None) -> str:
    """The shipped nginx file for shims at ``replicas`` (``host:port``), listening on ``listen``."""
    if not replicas:
        raise ValueError("a fleet needs at least one replica")
    source = NGINX_CONFIG.read_text() if text is None else text
    first = re.search(_NGINX_SERVER, source, flags=re.MULTILINE)
    if first is None:
        raise ConfigShapeError("the configuration has no upstream server line to replace")
    indent, params = first.group("indent"), first.group("params")
    lines = [f"{indent}server {addr}{params};" for addr in replicas]
    out = _replace_servers(source, _NGINX_SERVER, lines, "upstream")
    return _replace_once(r"^([ \t]*)listen[ \t]+[^;\n]+;", rf"\g<1>listen {listen};", out, "listen")


def nginx_main_config(directory: Path, site: Path, *, worker_processes: int = 1) -> str:
    """A minimal ``nginx.conf`` including ``site``, with every path it writes inside ``directory``."""
    d = directory
    temp = "\n".join(
        f"    {kind}_temp_path {d / (kind + '_temp')};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""worker_processes {worker_processes};
pid {d / "nginx.pid"};
error_log stderr warn;
events {{
    worker_connections 4096;
}}
http {{
    log_format fleet '$msec $status rid=$http_x_request_id up=$upstream_addr '
                     'upstatus=$upstream_status rt=$request_time';
    access_log {d / "access.log"} fleet;
{temp}
    include {site};
}}
"""


_HAPROXY_SERVER = r"^(?P<indent>[ \t]*)server[ \t]+(?P<name>\S+)[ \t]+(?P<addr>\S+:\d+)(?P<params>[^\n]*)$"


def render_haproxy(
    replicas: Sequence[str], bind: str, text: str | None = None, *, stats_socket: Path | None = None
) -> str:
    """The shipped HAProxy file for shims at ``replicas`` (``host:port``), bound to ``bind``, with
    its runtime API on ``stats_socket`` (None: the shipped path)."""
    if not replicas:
        raise ValueError("a fleet needs at least one replica")
    source = HAPROXY_CONFIG.read_text() if text is None else text
    first = re.search(_HAPROXY_SERVER, source, flags=re.MULTILINE)
    if first is None:
        raise ConfigShapeError("the configuration has no backend server line to replace")
    indent, params = first.group("indent"), first.group("params")
    lines = [f"{indent}server replica{i + 1} {addr}{params}" for i, addr in enumerate(replicas)]
    out = _replace_servers(source, _HAPROXY_SERVER, lines, "backend")
    out = _replace_once(r"^([ \t]*)bind[ \t]+\S+", rf"\g<1>bind {bind}", out, "bind")
    if stats_socket is not None:
        out = _replace_once(
            r"^([ \t]*)stats socket[ \t]+\S+", rf"\g<1>stats socket {stats_socket}", out, "stats socket"
        )
    return out


__all__ = [
    "DEPLOY_DIR",
    "HAPROXY_CONFIG",
    "LB_HEALTH_PATH",
    "LB_SHIM_FLAGS",
    "LOAD_BALANCERS",
    "NGINX_CONFIG",
    "ConfigShapeError",
    "lb_binary",
    "nginx_main_config",
    "render_haproxy",
    "render_nginx",
]
