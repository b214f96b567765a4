"""The seam between the relay and the per-request policies: classes, quotas, SLO headers, priority.

The request path asks its :class:`RequestHooks` four things about each generation request:
which class and tenant it belongs to (the intake, before the body is read), what the
tenant's quota says of it and what body to forward (the admission gate, before it queues:
the quota's verdict goes to the admission controller with the request, whose quota gate
refuses it), which headers to add to the answer, and how it ended (to correct the token
charge). The base class does
nothing, so the relay works without any of it; :class:`ShimPolicies` implements:

- the class from ``x-request-class`` or, when absent, the tenant's default; a class
  the tenant may not use is a 403 (``code: class_not_allowed``), an unknown one a
  400 (:class:`~llm_backoff_shim.decide.requests.UnknownClassError`);
- the tenant quota (:mod:`llm_backoff_shim.serve.policy.quota`), taken before queueing; its
  refusals (:class:`~llm_backoff_shim.decide.tenants.QuotaGate`) are 429
  ``tenant_rate_limited`` with ``Retry-After`` and the rate-limit headers;
- vLLM's ``priority`` field set from the class (``--forward-priority``);
- ``x-slo-state: green|yellow|red`` of the request's class on every answer;
- usage read from the response body (a JSON body, or the tail of an SSE stream).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llm_backoff.tokens import estimate_request_tokens, estimate_tokens, usage_tokens
from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import AdmissionRequest, QuotaVerdict
from llm_backoff_shim.decide.slo import SloTracker
from llm_backoff_shim.decide.tenants import Tenant, TenantDirectory
from llm_backoff_shim.serve.api.rejection import Refusal, client_error
from llm_backoff_shim.serve.policy.quota import Charge, TenantQuotas

RawHeaders = list[tuple[bytes, bytes]]

log = logging.getLogger("llm_backoff_shim.tenants")

#: How much of a response is kept to find ``usage`` (a JSON body, or an SSE stream's tail).
USAGE_TAIL_BYTES = 16 * 1024


class RequestScope:
    """One generation request's view of the hooks; the base does nothing."""

    def __init__(self, request: AdmissionRequest, body: bytes) -> None:
        self.request = request
        self.body = body

    async def take_quota(self) -> QuotaVerdict | None:
        """What the tenant's quota says of the request, its charge taken when within it; None
        when it has no quota."""
        return None

    def response_headers(self) -> RawHeaders:
        return []

    def observe(self, chunk: bytes) -> None:
        return None

    async def finish(self, *, served: bool, status: int | None) -> None:
        return None


class RequestHooks:
    """The relay's hooks with no policy: class from the header, nothing else."""

    def choose_class(
        self, headers: RawHeaders, class_header: str | None, controller: AdmissionController
    ) -> tuple[str, str | None] | Refusal:
        """``(class, tenant id)``, or a refusal; raises UnknownClassError for a class the shim
        does not serve."""
        return controller.parse_class(class_header), None

    def scope(
        self, request: AdmissionRequest, body: bytes, path: str, parsed: dict[str, Any] | None = None
    ) -> RequestScope:
        """The request's hooks; ``parsed`` is ``body`` as the proxy already parsed it (a JSON object)."""
        return RequestScope(request, body)

    def rejection_headers(self, request: AdmissionRequest) -> RawHeaders:
        """Headers for an admission rejection of ``request`` (e.g. the SLO state)."""
        return []

    def admits_without_body(self, request: AdmissionRequest) -> bool:
        """Whether nothing the hooks do before ``request`` queues reads its body (so an
        admission refusal may be answered from the head, :meth:`AdmissionGate.refuse_at_once`)."""
        return True


@dataclass
class _PolicyScope(RequestScope):
    request: AdmissionRequest
    body: bytes
    policies: ShimPolicies
    tenant: Tenant | None
    path: str
    parsed: dict[str, Any] | None = None
    charge: Charge | None = None
    store_failed: bool = False
    quota_headers: RawHeaders = field(default_factory=list)
    _tail: bytearray = field(default_factory=bytearray)

    async def take_quota(self) -> QuotaVerdict | None:
        quotas = self.policies.quotas
        if quotas is None or self.tenant is None:
            return None
        # Priced on what the client sent (not on the body with vLLM's priority added).
        parsed = self.parsed
        estimate = (
            estimate_request_tokens(parsed, path=self.path)
            if parsed is not None
            else estimate_tokens(self.body, path=self.path)
        )
        try:
            decision = await quotas.take(self.tenant, estimate)
        except Exception as exc:  # redis.RedisError and friends: the store, not the request, failed
            log.warning("tenant quota store unavailable: %s: %s", type(exc).__name__, exc)
            self.store_failed = True
            return QuotaVerdict(self.tenant.id, store_error=type(exc).__name__)
        self.quota_headers = decision.headers
        if decision.granted:
            self.charge = decision.charge
            return QuotaVerdict(self.tenant.id)
        log.info("tenant %s over quota; retry in %.2f s", self.tenant.label, decision.retry_after)
        return QuotaVerdict(self.tenant.id, retry_after=decision.retry_after)

    def response_headers(self) -> RawHeaders:
        if self.store_failed:
            # The request is refused for the store alone: its answer says nothing of the
            # quota or of the class's SLO state (reading the state samples its trend).
            return []
        return [*self.quota_headers, *self.policies.slo_headers(self.request.cls)]

    def observe(self, chunk: bytes) -> None:
        if self.charge is None:
            return
        self._tail += chunk
        if len(self._tail) > USAGE_TAIL_BYTES:
            del self._tail[: len(self._tail) - USAGE_TAIL_BYTES]

    async def finish(self, *, served: bool, status: int | None) -> None:
        quotas = self.policies.quotas
        if quotas is None or self.charge is None:
            return
        used = usage_tokens(bytes(self._tail)) if served else None
        try:
            await quotas.settle(self.charge, served=served, status=status, used_tokens=used)
        except Exception as exc:  # the answer is out already; a lost correction only skews the quota
            log.warning("tenant quota correction lost: %s: %s", type(exc).__name__, exc)


class ShimPolicies(RequestHooks):
    """Classes by tenant, tenant quotas, vLLM priority and SLO headers (module docstring)."""

    def __init__(
        self,
        controller: AdmissionController,
        *,
        directory: TenantDirectory | None = None,
        quotas: TenantQuotas | None = None,
        slo: SloTracker | None = None,
        vllm_priority: Mapping[str, int] | None = None,
    ) -> None:
        self.controller = controller
        self.directory = directory
        self.quotas = quotas
        self.slo = slo
        self.vllm_priority = dict(vllm_priority) if vllm_priority is not None else None

    def choose_class(
        self, headers: RawHeaders, class_header: str | None, controller: AdmissionController
    ) -> tuple[str, str | None] | Refusal:
        tenant = self.directory.identify(headers) if self.directory is not None else None
        if tenant is None:
            return controller.parse_class(class_header), None
        allowed = tenant.limits.classes
        if class_header is None or not class_header.strip():
            cls = tenant.limits.default_class
            if cls is None:
                default = controller.default_class
                cls = default if allowed is None or default in allowed else allowed[0]
        else:
            cls = controller.parse_class(class_header)
            if allowed is not None and cls not in allowed:
                return client_error(
                    f"request class {cls!r} is not allowed for this API key; allowed: {', '.join(allowed)}",
                    param="x-request-class",
                    code="class_not_allowed",
                    status=403,
                    reason="invalid_header",
                )
        return cls, tenant.id

    def scope(
        self, request: AdmissionRequest, body: bytes, path: str, parsed: dict[str, Any] | None = None
    ) -> RequestScope:
        if self.quotas is None and self.slo is None and self.vllm_priority is None:
            # Only naming tenants: nothing to do per request, nor per streamed chunk.
            return RequestScope(request, body)
        tenant = None
        if self.directory is not None and request.tenant is not None:
            tenant = self.directory.identify_id(request.tenant)
        return _PolicyScope(request, self._prioritised(body, request.cls, parsed), self, tenant, path, parsed)

    def rejection_headers(self, request: AdmissionRequest) -> RawHeaders:
        return self.slo_headers(request.cls)

    def admits_without_body(self, request: AdmissionRequest) -> bool:
        # A tenant's quota is priced on the body (its tokens), and charged before queueing.
        return self.quotas is None or request.tenant is None

    def slo_headers(self, cls: str) -> RawHeaders:
        if self.slo is None or cls not in self.slo.config.budgets:
            return []
        return [(b"x-slo-state", self.slo.state(cls).header.encode())]

    def _prioritised(self, body: bytes, cls: str, parsed: dict[str, Any] | None) -> bytes:
        if self.vllm_priority is None:
            return body
        data: Any = parsed
        if data is None:
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                return body
        if not isinstance(data, dict):
            return body
        # The class decides, not the caller: a batch job cannot buy interactive priority.
        return json.dumps({**data, "priority": self.vllm_priority[cls]}, separators=(",", ":")).encode()


__all__ = ["RequestHooks", "RequestScope", "ShimPolicies"]
