"""The operations listener: ``/metrics``, ``/health`` and ``/shim/state`` on their own port.

With ``--metrics-port`` (on ``--host``: a firewall rule on the port keeps it private while
the proxy's port is open) these routes are served here, and the proxy's own
listener does not answer ``/metrics`` or ``/shim/state``. ``/health`` says the process
is up; ``/ready`` (which probes the upstream) stays on the proxy listener, where load
balancers look for it.

It is a second uvicorn server on the proxy's event loop, on the public serving path
(http/paths.py) with the proxy listener's request-head limits (its hostile heads counted
in the same ``bad_requests_total``), started and stopped by
the app's lifespan: on shutdown it serves until the proxy listener has drained. Being
on the same loop, its ``/health`` answers only while the loop that relays the traffic
runs (a stuck loop fails the probe), and ``/metrics`` and ``/shim/state`` read the
controller on the thread that changes it. A scrape costs the loop what it costs on the
proxy's listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from llm_backoff_shim.http.connection_guard import OnEvent
from llm_backoff_shim.http.limits import Limits
from llm_backoff_shim.http.paths import public_serving

#: How long a scrape in progress may finish once the proxy listener has drained.
STOP_GRACE = 2


async def _not_found(request: Request, exc: Exception) -> Response:
    return JSONResponse(
        {"error": {"message": "this listener serves /metrics, /health and /shim/state", "code": None}}, 404
    )


async def _get_only(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": {"message": "GET only"}}, 405, headers={"allow": "GET, HEAD"})


class _Listener(uvicorn.Server):
    """A uvicorn server that leaves signals to the proxy's: that one stops this one, through
    the app's lifespan, once its own connections have drained."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class OpsListener:
    """``routes`` on ``host:port``; :meth:`bind` early for a clear error, :meth:`start` and
    :meth:`stop` on the proxy's event loop (the app's lifespan calls them)."""

    def __init__(
        self,
        routes: Sequence[BaseRoute],
        host: str,
        port: int,
        *,
        head_timeout: float,
        max_head_bytes: int,
        on_event: OnEvent = lambda _reason: None,
    ) -> None:
        self.host = host
        self.port = port
        app = Starlette(routes=list(routes), exception_handlers={404: _not_found, 405: _get_only})
        limits = Limits(head_timeout, max_head_bytes, body_timeout=head_timeout, on_event=on_event)
        served = public_serving(app, limits)
        config = uvicorn.Config(
            served.app,
            **served.options,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=STOP_GRACE,
        )
        self._server = _Listener(config)
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def bind(self) -> None:
        """Take the address now (raises OSError); :meth:`start` binds if this was not called."""
        if self._sock is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            self._sock = socket.create_server((self.host, self.port), family=family)
            self.port = self._sock.getsockname()[1]

    async def start(self) -> None:
        self.bind()
        assert self._sock is not None
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its error, if it failed to start
                raise RuntimeError(f"the operations listener on {self.url} stopped at start")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._task = None
