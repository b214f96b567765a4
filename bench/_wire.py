"""Time to rejection on the wire: kernel-timestamped TCP segments on loopback (root only).

In a burst of 200 calls started at once, the load generator's own loop is the slowest part of
a rejection as the caller sees it: the response waits in its socket while the process builds
the other 199 requests (measured: 0.2-0.27 s at p99, against 2 ms inside the shim after
the body). What the shim does, from the request's last byte on the wire to its answer's first
byte on the wire, is measured here from the segments themselves: an ``AF_PACKET`` socket on
``lo`` with ``SO_TIMESTAMPNS``, so each segment carries the time the kernel saw it, however late
this process reads it. Matching is by the load generator's ``x-request-id`` (``<call>-<attempt>``)
in the request's head.

Written here rather than with a capture library (scapy, pcapy): the standard library's raw
socket does it in a page, and the benchmark must not need another install to run.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ETH_P_ALL = 0x0003
SO_TIMESTAMPNS = 35  # Linux
PACKET_OUTGOING = 4  # each loopback segment is seen twice: keep the incoming copy
_KEEP = 4096  # bytes of a segment kept: every header of interest is in a request's head


@dataclass(frozen=True)
class WireExchange:
    """One request and its answer on one connection, by kernel time (seconds)."""

    request_id: str
    last_request_byte: float
    first_answer_byte: float
    status: int

    @property
    def seconds(self) -> float:
        return self.first_answer_byte - self.last_request_byte


def capture_unavailable() -> str | None:
    """Why this machine cannot capture (None when it can)."""
    try:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
    except (PermissionError, OSError, AttributeError) as exc:
        return f"no raw loopback capture here ({type(exc).__name__}: needs Linux and root)"
    sock.close()
    return None


class WireCapture:
    """Segments to and from ``port`` on loopback, captured by a child process until :meth:`stop`.

    A process of its own, not a thread: a thread reading every segment of a burst holds the
    load generator's interpreter lock in the very moments the load generator's own times are
    taken (tried: its caller-side p99 time to rejection in the burst went from 0.17 to 0.36 s).
    """

    def __init__(self, port: int) -> None:
        self.port = port
        handle, name = tempfile.mkstemp(prefix="wire-", suffix=".pickle")
        os.close(handle)
        self._out = Path(name)
        self._frames: list[tuple[float, bytes]] = []
        self._child: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> WireCapture:
        self._child = subprocess.Popen(
            [sys.executable, __file__, str(self.port), str(self._out)],
            stdout=subprocess.PIPE,
        )
        assert self._child.stdout is not None
        if self._child.stdout.readline().strip() != b"capturing":  # bound before any request goes
            self._child.wait()
            raise RuntimeError("the loopback capture did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=30)
        with self._out.open("rb") as f:
            self._frames = pickle.load(f)
        self._out.unlink()

    def exchanges(self) -> list[WireExchange]:
        """Every answered request seen, in the order the answers began."""
        # Per connection (the client's port): its payload-carrying segments in capture order.
        segments: dict[int, list[tuple[float, bool, bytes]]] = defaultdict(list)
        for stamp, frame in self._frames:
            parsed = _tcp_payload(frame)
            if parsed is None:
                continue
            source, destination, payload = parsed
            if destination == self.port:
                segments[source].append((stamp, True, payload))
            elif source == self.port:
                segments[destination].append((stamp, False, payload))
        found: list[WireExchange] = []
        for flow in segments.values():
            last_request: float | None = None
            request_id: str | None = None
            for stamp, to_server, payload in flow:
                if to_server:
                    head = _request_id(payload)
                    if head is not None:
                        request_id = head
                    last_request = stamp
                elif payload.startswith(b"HTTP/1.1 ") and last_request is not None and request_id:
                    status = int(payload[9:12]) if payload[9:12].isdigit() else 0
                    found.append(WireExchange(request_id, last_request, stamp, status))
                    last_request = request_id = None
        return sorted(found, key=lambda e: e.first_answer_byte)


def _tcp_payload(frame: bytes) -> tuple[int, int, bytes] | None:
    """(source port, destination port, payload) of an IPv4 TCP segment with data, else None."""
    if len(frame) < 14 + 20 + 20 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    if ip[9] != 6:  # not TCP
        return None
    header = (ip[0] & 0x0F) * 4
    total = struct.unpack("!H", ip[2:4])[0]
    tcp = ip[header:total]
    if len(tcp) < 20:
        return None
    source, destination = struct.unpack("!HH", tcp[:4])
    payload = tcp[(tcp[12] >> 4) * 4 :]
    return (source, destination, payload) if payload else None


def _request_id(payload: bytes) -> str | None:
    """The ``x-request-id`` of a request head that starts in this segment, else None."""
    if not payload.startswith((b"POST ", b"GET ", b"PUT ", b"DELETE ", b"PATCH ")):
        return None
    at = payload.lower().find(b"\r\nx-request-id: ")
    if at < 0:
        return None
    end = payload.find(b"\r\n", at + 2)
    value = payload[at + 16 : end if end >= 0 else None]
    return value.decode("ascii", "replace").strip() or None


def _capture(port: int, out: str) -> None:
    """The child: every incoming loopback segment with its kernel time, until SIGTERM."""
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.bind(("lo", 0))
    sock.settimeout(0.2)
    print("capturing", flush=True)
    frames: list[tuple[float, bytes]] = []
    space = socket.CMSG_SPACE(16)
    while not stopping:
        try:
            data, ancillary, _flags, address = sock.recvmsg(_KEEP, space)
        except (TimeoutError, InterruptedError):
            continue
        if address[2] == PACKET_OUTGOING:
            continue
        parsed = _tcp_payload(data)
        if parsed is None or port not in parsed[:2]:
            continue
        for level, kind, value in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                seconds, nanos = struct.unpack("qq", value[:16])
                frames.append((seconds + nanos / 1e9, data))
    with open(out, "wb") as f:
        pickle.dump(frames, f)


if __name__ == "__main__":
    _capture(int(sys.argv[1]), sys.argv[2])
