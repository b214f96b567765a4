"""The connection limits both serving paths enforce, from the shim's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_backoff_shim.http.connection_guard import OnEvent


@dataclass(frozen=True)
class Limits:
    """The connection limits both paths enforce (the shim's settings)."""

    head_timeout: float
    max_head_bytes: int
    body_timeout: float
    on_event: OnEvent = field(default=lambda _reason: None)
