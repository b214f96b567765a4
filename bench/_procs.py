"""Child processes of the proxy benchmark: start pinned, wait healthy, read CPU, stop.

Bench-only. Each child runs under ``taskset -c CPU`` when taskset exists and the
machine has that CPU, so the proxy under test owns one core and the fake engine
and load generator share the other. CPU time comes from /proc/<pid>/stat
(utime + stime, all threads) summed over the child and its descendants, which
covers nginx's worker under its master.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from llm_backoff_shim.lab.procs import free_port, is_healthy, terminate

__all__ = ["Child", "cpu_seconds", "free_port", "nginx_argv", "nginx_config", "pin_prefix"]

_TICKS = os.sysconf("SC_CLK_TCK")
NGINX = "/usr/sbin/nginx"


def pin_prefix(cpu: int | None) -> list[str]:
    """``taskset -c CPU`` when pinning is possible, else nothing (the run says so)."""
    if cpu is None or shutil.which("taskset") is None or cpu not in os.sched_getaffinity(0):
        return []
    return ["taskset", "-c", str(cpu)]


def boost(pid: int, nice: int) -> bool:
    """Give ``pid``'s scheduling group ``nice``; False when not permitted.

    With autogroup scheduling (Linux's default for desktop-like kernels) a nice value
    only ranks processes inside one session, and every other shell session on a
    shared machine is a group of equal weight. So each child starts in a session of
    its own and the nice value goes on that session's autogroup.
    """
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, nice)
            return True
        return False
    return True


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its live descendants, in seconds."""
    total = 0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces; fields after it are fixed.
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        stack += _children(current)
    return total / _TICKS


class Child:
    """A server process on 127.0.0.1:``port``; stopped with SIGTERM, then SIGKILL."""

    def __init__(
        self, name: str, argv: Sequence[str], port: int, *, cpu: int | None, nice: int | None = None
    ) -> None:
        self.name = name
        self.nice = nice
        self.boosted = False
        self.port = port
        self.argv = [*pin_prefix(cpu), *argv]
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in __exit__

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> Child:
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.boosted = self.nice is not None and boost(self.proc.pid, self.nice)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if is_healthy(f"http://{self.address}/health"):
                return self
            time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"{self.name} did not start ({' '.join(self.argv)}); its output:\n{tail}")

    def log_tail(self, limit: int = 3000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-limit:]

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self, grace: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        terminate(proc, grace)

    def __enter__(self) -> Child:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._log.close()


def nginx_config(workdir: Path, listen_port: int, upstream: str) -> Path:
    """A reverse-proxy config: one worker, upstream keep-alive, no response buffering."""
    temp = {name: workdir / name for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    for path in temp.values():
        path.mkdir(exist_ok=True)
    # As root the worker would switch to "nobody", which cannot use our private temp dirs.
    user = f"user {getpass.getuser()};\n" if os.geteuid() == 0 else ""
    text = f"""{user}daemon off;
master_process on;
worker_processes 1;
pid {workdir / "nginx.pid"};
error_log {workdir / "error.log"} warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {temp["client_body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    keepalive_requests 1000000;
    upstream engine {{
        server {upstream};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{listen_port} backlog=4096;
        location = /health {{ return 200 "ok"; }}
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""
    path = workdir / "nginx.conf"
    path.write_text(text)
    return path


def nginx_argv(config: Path) -> list[str]:
    return [NGINX, "-p", str(config.parent), "-c", str(config), "-e", str(config.parent / "error.log")]
