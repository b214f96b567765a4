"""A fleet on loopback: N engines, a shim beside each, a real nginx or HAProxy in front.

:class:`Fleet` starts the engines (simulators, or real engines given by URL), one shim per
engine and the load balancer, each a child process (:mod:`llm_backoff_shim.lab.procs`); the
load balancer runs the shipped configuration rendered for the replicas' addresses
(:mod:`llm_backoff_shim.lab.fleet_configs`), in a temporary directory removed on close.
Optionally a Prometheus scrapes the shims (:mod:`llm_backoff_shim.lab.prometheus`).

Replicas keep their ports for the life of the fleet (the load balancer's configuration
names them), so a shim stopped with :meth:`Fleet.stop_shim` or an engine killed with
:meth:`Fleet.kill_engine` comes back on the same address with :meth:`Fleet.start_shim` /
:meth:`Fleet.start_engine`. ``llm-backoff-shim fleet`` (:func:`main`) starts one and waits
for Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from llm_backoff_shim.lab import procs
from llm_backoff_shim.lab.fleet_configs import (
    LB_HEALTH_PATH,
    LB_SHIM_FLAGS,
    LOAD_BALANCERS,
    lb_binary,
    nginx_main_config,
    render_haproxy,
    render_nginx,
)
from llm_backoff_shim.lab.procs import ChildServer, ServerStartError

#: Seconds a SIGTERMed shim may take to drain before it is killed (its own grace is 30 s).
SHIM_STOP_GRACE = 35.0


@dataclass
class Replica:
    """One engine and the shim beside it. ``engine`` is None for a real engine given by URL."""

    shim: ChildServer
    engine: ChildServer | None
    upstream_url: str

    @property
    def engine_url(self) -> str:
        return self.engine.url if self.engine is not None else self.upstream_url

    @property
    def shim_url(self) -> str:
        return self.shim.url

    @property
    def address(self) -> str:
        """``host:port`` of the shim, as the load balancer and Prometheus name it."""
        return f"{self.shim.host}:{self.shim.port}"


class LoadBalancer(ChildServer):
    """nginx or HAProxy running the shipped configuration rendered for ``replicas``."""

    def __init__(self, lb: str, replicas: Sequence[str], directory: Path, *, port: int = 0) -> None:
        found = lb_binary(lb)
        if found is None:
            raise FileNotFoundError(f"{lb} is not installed (Debian/Ubuntu: apt-get install {lb})")
        self.lb = lb
        self.binary = found
        self.dir = directory
        self.replicas = list(replicas)
        self.config_path = directory / ("nginx.conf" if lb == "nginx" else "haproxy.cfg")
        super().__init__(lb, self._command, health_path=LB_HEALTH_PATH, port=port)

    def _command(self, port: int) -> list[str]:
        listen = f"{self.host}:{port}"
        if self.lb == "nginx":
            site = self.dir / "llm-backoff-fleet.conf"
            site.write_text(render_nginx(self.replicas, listen))
            self.config_path.write_text(nginx_main_config(self.dir, site))
            return [
                self.binary, "-p", str(self.dir), "-e", "stderr",
                "-c", str(self.config_path), "-g", "daemon off;",
            ]  # fmt: skip
        self.config_path.write_text(render_haproxy(self.replicas, listen, stats_socket=self.stats_socket))
        return [self.binary, "-db", "-f", str(self.config_path)]

    @property
    def stats_socket(self) -> Path:
        """HAProxy's runtime API (a unix socket in the run's directory)."""
        return self.dir / "admin.sock"

    def runtime_api(self, command: str, timeout: float = 2.0) -> str:
        """HAProxy's answer to one runtime API ``command`` (e.g. ``show stat``)."""
        if self.lb != "haproxy":
            raise RuntimeError("nginx OSS has no runtime API")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.stats_socket))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def server_states(self) -> list[str]:
        """HAProxy's view of each replica, in order: ``UP``, ``DOWN``, ``MAINT``, ``UP 1/2``..."""
        rows = csv.DictReader(self.runtime_api("show stat").lstrip("# ").splitlines())
        states = {row["svname"]: row["status"] for row in rows if row["svname"].startswith("replica")}
        return [states[f"replica{i + 1}"] for i in range(len(self.replicas))]

    def check_config(self) -> str:
        """``nginx -t`` / ``haproxy -c`` on the configuration as rendered; raises on failure."""
        argv = self._command(self.port or self.fixed_port or 8000)
        check = [*argv[:-2], "-t"] if self.lb == "nginx" else [self.binary, "-c", "-f", str(self.config_path)]
        result = subprocess.run(check, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise ValueError(f"{self.lb} rejects the rendered configuration:\n{result.stderr}{result.stdout}")
        return result.stderr + result.stdout


class Fleet:
    """``replicas`` engines with a shim each behind ``lb`` (``"nginx"`` or ``"haproxy"``).

    ``upstreams``: URLs of real engines (one replica each) instead of simulators started with
    ``sim_flags``. ``shim_flags`` go to every shim after the flags the load balancer's recipe
    needs (HAProxy: ``--reject-status 503``), so they win. ``lb_port``: a fixed port for the
    load balancer (0: a free one). ``prometheus``: also run a Prometheus scraping the shims
    (its URL is :attr:`prometheus_url`).
    """

    def __init__(
        self,
        replicas: int = 3,
        lb: str = "nginx",
        *,
        sim_flags: Sequence[str] = (),
        shim_flags: Sequence[str] = (),
        upstreams: Sequence[str] | None = None,
        lb_port: int = 0,
        prometheus: bool = False,
    ) -> None:
        if lb not in LOAD_BALANCERS:
            raise ValueError(f"unknown load balancer {lb!r}: one of {', '.join(LOAD_BALANCERS)}")
        if upstreams is not None:
            replicas = len(upstreams)
        if replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        self.lb_name = lb
        self.shim_flags = (*LB_SHIM_FLAGS[lb], *shim_flags)
        self.replicas: list[Replica] = []
        for i in range(replicas):
            if upstreams is not None:
                engine = None
                upstream: ChildServer | str = upstreams[i].rstrip("/")
            else:
                engine = procs.sim_server(sim_flags)
                upstream = engine
            shim = procs.shim_server(upstream, self.shim_flags)
            shim.name = f"shim {i}"
            self.replicas.append(Replica(shim, engine, upstream if isinstance(upstream, str) else ""))
        self._lb_port = lb_port
        self._want_prometheus = prometheus
        self._dir = tempfile.TemporaryDirectory(prefix=f"llm-backoff-fleet-{lb}-")
        self.lb: LoadBalancer | None = None
        self.prometheus: ChildServer | None = None

    # -- addresses ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The load balancer's base URL (``http://127.0.0.1:PORT``): point clients here (+ ``/v1``)."""
        if self.lb is None:
            raise RuntimeError("the fleet is not started")
        return self.lb.url

    @property
    def shim_urls(self) -> list[str]:
        return [r.shim_url for r in self.replicas]

    @property
    def engine_urls(self) -> list[str]:
        return [r.engine_url for r in self.replicas]

    @property
    def prometheus_url(self) -> str | None:
        return None if self.prometheus is None else self.prometheus.url

    @property
    def directory(self) -> Path:
        """Where the load balancer's rendered configuration and logs are."""
        return Path(self._dir.name)

    # -- life cycle --------------------------------------------------------------------
    def start(self) -> Fleet:
        """Engines, then shims, then the load balancer (and Prometheus); all stopped on failure."""
        try:
            self._start_replicas()
            addresses = [r.address for r in self.replicas]
            self.lb = LoadBalancer(self.lb_name, addresses, self.directory, port=self._lb_port)
            self.lb.start()
            if self._want_prometheus:
                from llm_backoff_shim.lab.prometheus import PrometheusServer

                self.prometheus = PrometheusServer(addresses, scrape_interval=1.0)
                self.prometheus.start()
        except BaseException:
            self.close()
            raise
        return self

    def _start_replicas(self) -> None:
        # Launched together, so the start-ups overlap; a shim launched before its engine
        # had to move to another port is launched again against the engine really running.
        for r in self.replicas:
            if r.engine is not None:
                r.engine.launch()
            r.shim.launch()
        for r in self.replicas:
            if r.engine is not None:
                r.engine.start()
                if r.engine.url not in r.shim.argv:
                    r.shim.stop()
                    r.shim.launch()
            r.shim.start()
        # From now on each replica keeps its ports.
        for r in self.replicas:
            r.shim.fixed_port = r.shim.port
            if r.engine is not None:
                r.engine.fixed_port = r.engine.port

    def close(self) -> None:
        """Everything stopped (load balancer first, so no call reaches a stopping shim)."""
        for server in (self.prometheus, self.lb):
            if server is not None:
                server.close()
        for r in self.replicas:
            r.shim.close()
            if r.engine is not None:
                r.engine.close()
        self._dir.cleanup()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- faults ------------------------------------------------------------------------
    def stop_shim(self, i: int, grace: float = SHIM_STOP_GRACE) -> float:
        """SIGTERM replica ``i``'s shim and wait until it has exited (it drains first): seconds taken."""
        t0 = time.monotonic()
        self.replicas[i].shim.stop(grace)
        return time.monotonic() - t0

    def start_shim(self, i: int) -> float:
        """Start replica ``i``'s shim again on its port; seconds until its /health answers."""
        t0 = time.monotonic()
        self.replicas[i].shim.restart()
        return time.monotonic() - t0

    def kill_engine(self, i: int) -> None:
        """SIGKILL replica ``i``'s engine (a crash: streams in progress are cut)."""
        self._engine(i).kill()

    def start_engine(self, i: int) -> float:
        """Start replica ``i``'s engine again on its port; seconds until its /health answers."""
        t0 = time.monotonic()
        self._engine(i).restart()
        return time.monotonic() - t0

    def _engine(self, i: int) -> ChildServer:
        engine = self.replicas[i].engine
        if engine is None:
            raise RuntimeError(f"replica {i} runs a real engine ({self.replicas[i].upstream_url}), not ours")
        return engine

    # -- logs --------------------------------------------------------------------------
    def shim_log(self, i: int, limit: int = 10_000_000) -> str:
        """Replica ``i``'s shim output (its access log with ``--log-level info``), last ``limit`` chars."""
        return self.replicas[i].shim.log_tail(limit)

    def access_records(self, i: int) -> list[dict[str, Any]]:
        """Replica ``i``'s access-log lines so far, parsed (shims run with ``--log-format json``
        and ``--log-level info``; other lines are skipped)."""
        records: list[dict[str, Any]] = []
        for line in self.shim_log(i).splitlines():
            if line.startswith("{") and '"outcome"' in line:
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
        return records

    def lb_log(self, limit: int = 10_000_000) -> str:
        """The load balancer's output (HAProxy: its request log) and, for nginx, its access log."""
        if self.lb is None:
            return ""
        text = self.lb.log_tail(limit)
        access = self.directory / "access.log"
        if access.exists():
            text += access.read_text()[-limit:]
        return text

    def describe(self) -> str:
        config = self.lb.config_path if self.lb else "-"
        lines = [f"load balancer ({self.lb_name}): {self.url}/v1   (config: {config})"]
        for i, r in enumerate(self.replicas):
            lines.append(f"replica {i}: shim {r.shim_url}   engine {r.engine_url}")
        if self.prometheus is not None:
            lines.append(f"prometheus: {self.prometheus.url}")
        return "\n".join(lines)


def _split(values: Sequence[str]) -> list[str]:
    return [part for value in values for part in shlex.split(value)]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="llm-backoff-shim fleet",
        description=(
            "Run a fleet on loopback: N simulated (or real) engines, a shim beside each, and a real "
            "nginx or HAProxy in front running the shipped configuration (server_shim/deploy/). "
            "Prints the addresses and runs until Ctrl-C."
        ),
    )
    parser.add_argument("--replicas", type=int, default=3, help="engines, each with a shim (default: 3)")
    parser.add_argument(
        "--lb", choices=LOAD_BALANCERS, default="nginx", help="the load balancer (default: nginx)"
    )
    parser.add_argument("--port", type=int, default=0, help="the load balancer's port (default: a free one)")
    parser.add_argument(
        "--sim-flag", action="append", default=[], metavar="FLAGS",
        help="flags for every simulator, e.g. --sim-flag='--max-num-seqs 4' (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--shim-flag", action="append", default=[], metavar="FLAGS",
        help="flags for every shim, e.g. --shim-flag='--max-concurrency 4' (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--upstream", action="append", default=[], metavar="URL",
        help="a real engine's base URL instead of a simulator (repeat for each; overrides --replicas)",
    )  # fmt: skip
    parser.add_argument("--prometheus", action="store_true", help="also run a Prometheus scraping the shims")
    return parser.parse_args(list(argv))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        fleet = Fleet(
            args.replicas,
            args.lb,
            sim_flags=_split(args.sim_flag),
            shim_flags=_split(args.shim_flag),
            upstreams=args.upstream or None,
            lb_port=args.port,
            prometheus=args.prometheus,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"llm-backoff-shim fleet: {exc}", file=sys.stderr)
        return 2
    try:
        with procs.sigterm_as_interrupt():
            try:
                fleet.start()
            except (ServerStartError, FileNotFoundError) as exc:
                print(f"llm-backoff-shim fleet: {exc}", file=sys.stderr)
                return 1
            print(fleet.describe(), flush=True)
            print("Ctrl-C stops the fleet.", flush=True)
            while True:
                signal.pause() if hasattr(signal, "pause") else time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        fleet.close()


__all__ = ["SHIM_STOP_GRACE", "Fleet", "LoadBalancer", "Replica", "main", "parse_args"]
