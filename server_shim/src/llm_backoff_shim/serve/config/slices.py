"""The slices of the settings that the request path's pieces are built from.

Each piece of the request path takes the few values it needs as one frozen slice, made by
:class:`~llm_backoff_shim.serve.config.settings.ShimSettings` (``intake_settings()``,
``gate_settings()``): a new setting of a piece reaches it through its slice, and the
composition root (app.py) hands slices on without reading them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_backoff_shim.serve.api.auth import ApiKeys


@dataclass(frozen=True)
class IntakeSettings:
    """What the intake (request_path/intake.py) checks against: the operator routes allowed,
    the API keys, and the body's size and time limits."""

    allow_operator_route: tuple[str, ...]
    api_keys: ApiKeys
    max_body_bytes: int
    body_read_timeout: float | None


@dataclass(frozen=True)
class GateSettings:
    """What the admission gate (request_path/gate.py) refuses with: the status of an admission
    refusal that names none, and the Redis the replicas share their hints in (None: this
    replica's Retry-After alone)."""

    reject_status: int
    fleet_hints_url: str | None
