"""Every use the HTTP layer makes of a dependency's internals, in one list, with the versions tested.

The fast path (relay_protocol.py, relay_cycle.py, connection_guard.py) extends
uvicorn's httptools protocol from inside; nothing else in the shim reaches past a
library's public interface. capability.py checks the names below at start-up (and
drives the protocol through real requests); when any is missing or behaves otherwise,
the shim serves through the public path (public_path.py) instead.

``TESTED`` says where each path was tested: the releases the whole suite passed on, and
the verdict of the start-up check on each uvicorn release it was run against
(docs/shim.md, "Serving paths").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    """One name the fast path uses that its library does not document."""

    name: str
    used_in: str
    why: str

    @property
    def private(self) -> bool:
        """Whether the name itself says it is private (a leading underscore)."""
        return self.name.rsplit(".", 1)[-1].split("(")[0].startswith("_")


_PROTOCOL = "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol"

FAST_PATH: tuple[Internal, ...] = (
    Internal(_PROTOCOL, "relay_protocol.py, connection_guard.py", "subclassed: the protocol extended"),
    Internal(
        f"{_PROTOCOL}.tasks",
        "relay_protocol.py",
        "the server's set of request tasks: a /v1/ request's task joins it, so shutdown waits for it",
    ),
    Internal(
        f"{_PROTOCOL}.pipeline",
        "relay_protocol.py",
        "queues a pipelined /v1/ request behind the answer in progress, in uvicorn's own queue",
    ),
    Internal(
        f"{_PROTOCOL}.on_headers_complete/on_body/on_message_complete",
        "relay_protocol.py",
        "httptools parser callbacks: the direct path takes over a /v1/ request once its head is parsed",
    ),
    Internal(
        f"{_PROTOCOL}.on_response_complete()",
        "relay_protocol.py, relay_cycle.py",
        "called when an answer ends, so uvicorn starts the next pipelined request",
    ),
    Internal(
        f"{_PROTOCOL}.send_400_response(msg)",
        "connection_guard.py",
        "overridden: an unparsable head gets the shim's OpenAI-format 400",
    ),
    Internal(
        f"{_PROTOCOL}: url, parser, scope, cycle, expect_100_continue, flow, transport, loop, logger, "
        "root_path, limit_concurrency",
        "relay_protocol.py, connection_guard.py",
        "per-connection and per-request state the parser callbacks read",
    ),
    Internal(
        "uvicorn's request cycle contract: disconnected, keep_alive, body, more_body, message_event, "
        "response_complete, run_asgi(app)",
        "relay_cycle.py",
        "the attributes uvicorn's protocol reads and sets on a cycle, which RelayCycle provides",
    ),
    Internal(
        "uvicorn.protocols.http.flow_control.FlowControl: write_paused, drain(), pause_reading(), "
        "resume_reading()",
        "relay_cycle.py, relay_protocol.py",
        "uvicorn's per-connection back-pressure, shared with its own cycles",
    ),
)

#: Methods of uvicorn's httptools protocol the fast path overrides or calls, with their parameters.
PROTOCOL_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "config", "server_state", "app_state"),
    "connection_made": ("self", "transport"),
    "connection_lost": ("self", "exc"),
    "data_received": ("self", "data"),
    "on_headers_complete": ("self",),
    "on_body": ("self", "body"),
    "on_message_complete": ("self",),
    "on_response_complete": ("self",),
    "send_400_response": ("self", "msg"),
}

#: What the public path uses: documented settings, plus two public but undocumented names.
PUBLIC_PATH: tuple[Internal, ...] = (
    Internal(
        "uvicorn.config.HTTP_PROTOCOLS['h11'] with uvicorn.importer.import_from_string",
        "paths.py",
        "finds the protocol class uvicorn itself loads for http='h11', to wrap it",
    ),
)

#: Where each path was tested. "suite": the shim's whole test suite passed there; "check": the
#: start-up check alone was run on that uvicorn (with httptools 0.9.0) and gave that verdict.
TESTED: dict[str, dict[str, tuple[str, ...]]] = {
    "fast path, suite": {"uvicorn": ("0.30.0", "0.54.0"), "httptools": ("0.6.0", "0.9.0")},
    "public path, suite": {"uvicorn": ("0.30.0", "0.54.0"), "httptools": ("0.6.0", "0.9.0")},
    "check passes (fast path)": {
        "uvicorn": (
            "0.30.0",
            "0.30.6",
            "0.32.1",
            "0.34.3",
            "0.36.1",
            "0.38.0",
            "0.40.0",
            "0.42.0",
            "0.44.0",
            "0.45.0",
            "0.50.2",
            "0.54.0",
        ),
        "httptools": ("0.6.0",),
    },
}
