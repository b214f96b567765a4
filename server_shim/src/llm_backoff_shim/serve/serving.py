"""Run an ASGI app with uvicorn on a loopback port in a background thread.

Used by the demo, calibration, benchmarks and the end-to-end tests: each needs a
real server (the simulator, the shim) on a free port, started and stopped from
synchronous code. The server binds a socket we create ourselves on port 0, so the
port is known before uvicorn starts and two servers never race for one port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import uvicorn


def free_socket(host: str = "127.0.0.1") -> socket.socket:
    """A listening TCP socket on a free port of ``host``.

    Made with ``IPPROTO_TCP`` named: asyncio sets ``TCP_NODELAY`` only on connections whose
    socket says it is TCP, and an accepted socket inherits the listener's protocol number. With
    ``proto=0`` a response written in two parts (head, then body) waits out the peer's delayed
    ACK, about 40 ms a response on Linux.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """A uvicorn server for ``app`` in its own thread and event loop.

    ``with ServerThread(app) as srv: srv.url`` -> ``http://127.0.0.1:PORT``.
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", **uvicorn_options: Any) -> None:
        self._sock = free_socket(host)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        options: dict[str, Any] = {
            "log_level": "warning",
            "lifespan": "auto",
            "server_header": False,
            "date_header": False,
            "timeout_graceful_shutdown": 2,
        }
        options.update(uvicorn_options)
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        # uvicorn.Server.run would install signal handlers; off the main thread it skips them.
        with contextlib.suppress(BaseException):
            asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self._sock])

    def start(self, timeout: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"server on port {self.port} failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on port {self.port} did not start in {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def shim_server(app: Any, **options: Any) -> ServerThread:
    """A :class:`ServerThread` for a shim app (``create_app``), served as ``serve`` serves it: on the
    HTTP path its settings pick (``--http-path``), with the shim's connection limits."""
    from llm_backoff_shim.serve.command import shim_serving

    served = shim_serving(app)
    return ServerThread(served.app, **{**served.options, **options})


@contextlib.contextmanager
def serve_in_thread(app: Any, **options: Any) -> Iterator[ServerThread]:
    with ServerThread(app, **options) as srv:
        yield srv
