"""The listening socket of in-process servers (``ServerThread``, the soak's shim and engine)."""

from __future__ import annotations

import asyncio
import socket

from llm_backoff_shim.serve.serving import free_socket


def test_connections_accepted_on_a_free_socket_send_without_nagle_delay() -> None:
    """asyncio sets TCP_NODELAY on an accepted connection only when its socket says it is TCP;
    without it a response written as head then body waits for the peer's delayed ACK."""

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = free_socket()
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        async with server:
            port = listener.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(seen, 10)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay()) != 0
