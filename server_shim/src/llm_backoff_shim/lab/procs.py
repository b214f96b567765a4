"""Servers the demo and the benchmark run as child processes on loopback.

Why subprocesses: the load generator's CPU and GIL would otherwise distort the
servers' latency. Each child is started on a free loopback port, waited for until its
health URL answers, and always stopped (SIGTERM, then SIGKILL) when the ``with``
block ends, Ctrl-C included. Their output goes to a log file that is shown when a
child fails to start.

Ports: we ask the kernel for a free port, close it and hand the number to the child.
Another process could take it in between; the child then fails to bind and exits,
and :meth:`ChildServer.start` retries on a fresh port. Until it exits, that other process
answers the health URL: a child counts as up only once the listening socket on its port is
its own (:func:`listens_on`, read from ``/proc``; where that cannot be read, the health
answer alone).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType

START_ATTEMPTS = 3


class ServerStartError(RuntimeError):
    """A child server exited or did not become healthy in time; the message includes its log tail."""


#: ``START-END``: the ports :func:`free_port` hands out, set by a test run (conftest.py) to a
#: block of its own per worker, outside the kernel's ephemeral range.
PORT_BLOCK_ENV = "LLM_BACKOFF_PORT_BLOCK"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, for a child server to bind (the socket is released first).

    Released, the port could be handed to someone else's ``bind(0)`` before the child binds it.
    Where ``LLM_BACKOFF_PORT_BLOCK`` names a block (tests running in parallel), the port comes
    from it: outside the ephemeral range no ``bind(0)`` is handed it, and no other worker draws
    from the same block.
    """
    block = os.environ.get(PORT_BLOCK_ENV)
    if block:
        start, end = (int(n) for n in block.split("-"))
        candidates = list(range(start, end))
        random.shuffle(candidates)
        for port in candidates:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        bound: int = sock.getsockname()[1]
        return bound


def cli_command(subcommand: str, *args: str, python: str | None = None) -> list[str]:
    """``python -m llm_backoff_shim.cli <subcommand> ...`` with this very interpreter, or with
    ``python`` (another install of the shim, to set two builds side by side)."""
    return [python or sys.executable, "-m", "llm_backoff_shim.cli", subcommand, *args]


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (IPv4 or IPv6); None
    where ``/proc`` cannot tell (not Linux, or not readable)."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError), open(table) as rows:
                next(rows, None)
                for row in rows:
                    fields = row.split()
                    # local address "ADDR:PORT" in hex; state 0A is LISTEN; field 9 the inode.
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, ValueError):
        return None
    links: set[str] = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed since listed (listdir's own, for one)
            links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return any(f"socket:[{inode}]" in links for inode in inodes)


def is_healthy(url: str) -> bool:
    """True when ``url`` answers 2xx within half a second."""
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return 200 <= int(response.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def terminate(proc: subprocess.Popen[bytes] | None, grace: float) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; nothing if it already ended."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(grace)


def _append_only(fd: int) -> None:
    """Make every write to ``fd`` go to the end of the file (``O_APPEND``).

    The child writes through the same open file as :meth:`ChildServer.log_tail` reads, so
    they share one file offset: without ``O_APPEND`` a line the child writes while the log is
    being read lands at the reader's offset, over lines written before.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)


class ChildServer:
    """A server process; ``command(port)`` builds its argv, ``health_path`` says when it is up."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], Sequence[str]],
        *,
        health_path: str = "/health",
        host: str = "127.0.0.1",
        start_timeout: float = 20.0,
        env: dict[str, str] | None = None,
        port: int = 0,
        new_session: bool = False,
    ) -> None:
        self.name = name
        #: Start the child in a session of its own (so that a scheduling priority set on its
        #: autogroup is its own).
        self.new_session = new_session
        #: Nonzero: always this port (a load balancer's configuration names it), never a fresh one.
        self.fixed_port = port
        self._command = command
        self._health_path = health_path
        self.host = host
        self._start_timeout = start_timeout
        self._env = env
        self.port = 0
        self.argv: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None
        # Closed in close(); the child writes to it for the whole life of this object.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        _append_only(self._log.fileno())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def launch(self) -> ChildServer:
        """Start the process without waiting for it (see :meth:`wait_ready`): on
        :attr:`fixed_port` if set, else on a fresh port."""
        self.port = self.fixed_port or free_port(self.host)
        env = None if self._env is None else {**os.environ, **self._env}
        self.argv = list(self._command(self.port))
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=self.new_session,
        )
        return self

    def wait_ready(self) -> bool:
        """True once the health URL answers; False if the process exits or the start times out."""
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            if (
                is_healthy(self.url + self._health_path)
                and listens_on(self._proc.pid, self.port) is not False
            ):
                return True
            time.sleep(0.05)
        return False

    def start(self) -> ChildServer:
        """Launch and wait; on failure retry on a fresh port, then raise :class:`ServerStartError`.

        With a :attr:`fixed_port` there is no other port to try: the first failure raises."""
        if self._proc is None:
            self.launch()
        attempts = 1 if self.fixed_port else START_ATTEMPTS
        for attempt in range(attempts):
            if self.wait_ready():
                return self
            last = self.log_tail()
            self.stop()
            if attempt + 1 == attempts:
                raise ServerStartError(f"{self.name} did not start on {self.host}; its output:\n{last}")
            self.launch()
        raise AssertionError("unreachable")  # pragma: no cover

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, limit: int = 2000) -> str:
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode("utf-8", "replace")
        self._log.seek(0, os.SEEK_END)
        return text[-limit:]

    def stop(self, grace: float = 3.0) -> None:
        proc, self._proc = self._proc, None
        terminate(proc, grace)

    def kill(self) -> None:
        """SIGKILL, as a crash would end it (nothing drains), and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if proc is not None:
            proc.wait()

    def restart(self) -> ChildServer:
        """Start it again on the port it had (stopped first if still running), and wait."""
        port = self.port
        self.stop()
        keep, self.fixed_port = self.fixed_port, self.fixed_port or port
        try:
            return self.start()
        finally:
            self.fixed_port = keep

    def close(self) -> None:
        self.stop()
        self._log.close()

    def __enter__(self) -> ChildServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def sim_server(sim_flags: Sequence[str]) -> ChildServer:
    return ChildServer(
        "simulator",
        lambda port: cli_command("sim", "--host", "127.0.0.1", "--port", str(port), *sim_flags),
    )


def shim_server(
    upstream: ChildServer | str, shim_flags: Sequence[str], python: str | None = None
) -> ChildServer:
    """A shim in front of ``upstream`` (a server, whose URL is read when the shim is launched, or a
    URL); ``python``: the interpreter whose install of the shim runs (:func:`cli_command`)."""
    return ChildServer(
        "shim",
        lambda port: cli_command(
            "serve",
            "--upstream",
            upstream if isinstance(upstream, str) else upstream.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *shim_flags,
            python=python,
        ),
    )


def start_stack(engine: ChildServer, proxies: Sequence[ChildServer]) -> None:
    """Start an engine and the proxies in front of it, their start-ups overlapping.

    A proxy launched before the engine had to move to another port is relaunched, so
    every proxy points at the engine that is really running. Stops all on failure.
    """
    servers = [engine, *proxies]
    try:
        for server in servers:
            server.launch()
        engine.start()
        for proxy in proxies:
            if engine.url not in proxy.argv:
                proxy.stop()
                proxy.launch()
            proxy.start()
    except BaseException:
        for server in servers:
            server.close()
        raise


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises KeyboardInterrupt, so ``finally`` clauses stop the children."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
