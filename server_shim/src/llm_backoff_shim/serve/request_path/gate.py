"""The admission gate: the one place the shim refuses a request for load, over decide/.

The proxy asks the gate, as Envoy's adaptive-concurrency filter asks its controller, at four
points of a generation request's way; every "no" for load and the Retry-After it carries are
decided here (a malformed request is the intake's, a broken connection http/'s):

- on the head (:meth:`AdmissionGate.refuse_at_once`): a refusal that cannot depend on the
  body, answered before it is read (``Proxy.refuse_from_head`` says why), or None;
- entering (:meth:`Passage.enter`, the request's :meth:`AdmissionGate.passage`): the tenant's
  quota taken, a slot from the controller (waiting in its queue), and for a refusal the
  fleet's soonest Retry-After (fleet_hints.py) in place of this replica's; whether the try is
  its caller's attempt's first, from the fleet's record of it (fleet_attempts.py), so that an
  attempt is counted once however many replicas the load balancer asks;
- the engine's refusal (:meth:`AdmissionGate.engine_refused`): an admitted request's 503 is
  the engine at capacity, any other failure the upstream unavailable, with the outage's
  Retry-After (:class:`~llm_backoff_shim.decide.retry_after.OutageClock`);
- leaving (:meth:`Passage.leave`): the slot released, the quota settled, the outcome counted.

Each refusal leaves as a :class:`~llm_backoff_shim.serve.api.rejection.Refusal`
rendered by rejection.py; the proxy only sends it and logs it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.fleet_size import FleetSize
from llm_backoff_shim.decide.requests import AdmissionRequest
from llm_backoff_shim.decide.retry_after import OutageClock
from llm_backoff_shim.decide.tickets import Outcome, Rejection
from llm_backoff_shim.serve.api.rejection import Refusal, rejection_response
from llm_backoff_shim.serve.config.slices import GateSettings
from llm_backoff_shim.serve.observe.access_log import request_id_of
from llm_backoff_shim.serve.observe.metrics import ShimMetrics
from llm_backoff_shim.serve.policy.fleet_attempts import FleetAttempts, attempt_key
from llm_backoff_shim.serve.policy.fleet_hints import RECORD_TTL_MS, FleetHints, connect
from llm_backoff_shim.serve.policy.request_hooks import RequestHooks, RequestScope
from llm_backoff_shim.serve.request_path.exchange import Clock, Exchange, ForwardRequest, UpstreamRefused
from llm_backoff_shim.serve.request_path.headers import RawHeaders
from llm_backoff_shim.serve.request_path.intake import parse_request_start
from llm_backoff_shim.serve.request_path.waiting import AsyncAdmission, Grant


class AdmissionGate:
    """Every refusal for load, and each generation request's :class:`Passage` through
    admission (module docstring).

    ``reject_status``: the status of an admission refusal that names none (``--reject-status``);
    ``fleet_hints``: the fleet's Retry-After, None for this replica's alone; ``fleet_attempts``:
    the fleet's record of callers' attempts, None to count each request as one; ``on_first_byte``:
    (seconds from admission to the upstream's first body byte, requests in flight), for an
    adaptive limit.
    """

    def __init__(
        self,
        *,
        admission: AsyncAdmission,
        metrics: ShimMetrics,
        clock: Clock,
        reject_status: int,
        hooks: RequestHooks | None = None,
        fleet_hints: FleetHints | None = None,
        fleet_attempts: FleetAttempts | None = None,
        on_first_byte: Callable[[float, int], None] | None = None,
    ) -> None:
        self.admission = admission
        self.metrics = metrics
        self.clock = clock
        self.reject_status = reject_status
        # Classes by tenant, quotas, SLO headers, vLLM priority; none by default.
        self.hooks = hooks if hooks is not None else RequestHooks()
        self.fleet_hints = fleet_hints
        self.fleet_attempts = fleet_attempts
        # Admissions being looked up in the fleet's record: counted when Redis answers, off the
        # request's path (an admitted call need not wait for its count).
        self._counting: set[asyncio.Task[None]] = set()
        self.on_first_byte = on_first_byte
        estimates = admission.controller.estimator.config
        # Retry-After of upstream_unavailable: the outage's length so far (retry_after.py says why).
        self.outage = OutageClock(clock, estimates.retry_after_min, estimates.retry_after_max)

    @classmethod
    def from_settings(
        cls,
        settings: GateSettings,
        *,
        admission: AsyncAdmission,
        metrics: ShimMetrics,
        clock: Clock,
        hooks: RequestHooks | None = None,
        on_first_byte: Callable[[float, int], None] | None = None,
    ) -> AdmissionGate:
        """The gate for its slice of the settings; with a Redis for the fleet's hints, the
        controller's estimate also learns the fleet's size from them (promises.py)."""
        fleet_hints = fleet_attempts = None
        if settings.fleet_hints_url is not None:
            controller = admission.controller
            estimator = controller.estimator
            fleet = FleetSize(clock)
            estimator.promises.fleet = fleet
            client = connect(settings.fleet_hints_url)
            fleet_hints = FleetHints(
                client, fleet=fleet, clock=clock, minimum=estimator.config.retry_after_min
            )
            # A record must outlive a later replica's queue wait: that replica admits (or
            # refuses) the call only after it.
            waits = [controller.policy(c).max_queue_wait for c in controller.classes]
            longest = max((w for w in waits if math.isfinite(w)), default=0.0)
            fleet_attempts = FleetAttempts(client, clock=clock, ttl_ms=RECORD_TTL_MS + round(longest * 1000))
        return cls(
            admission=admission,
            metrics=metrics,
            clock=clock,
            reject_status=settings.reject_status,
            hooks=hooks,
            fleet_hints=fleet_hints,
            fleet_attempts=fleet_attempts,
            on_first_byte=on_first_byte,
        )

    async def close(self) -> None:
        """Count the admissions still being looked up, then close the connection to the fleet's
        Redis, if any."""
        if self._counting:
            await asyncio.gather(*self._counting, return_exceptions=True)
        if self.fleet_hints is not None:
            await self.fleet_hints.close()

    @property
    def controller(self) -> AdmissionController:
        return self.admission.controller

    def may_refuse_at_once(self) -> bool:
        """Whether a request may now be refused from its head at all: every slot is taken, and
        no fleet's hint is asked (a round trip to Redis: the asynchronous path answers it)."""
        return self.fleet_hints is None and self.controller.saturated()

    def refuse_at_once(self, request: AdmissionRequest) -> Refusal | None:
        """The refusal of ``request`` decided from its head alone, counted; None when its
        answer may depend on its body: hooks that read the body before it queues (a tenant's
        quota), or a Retry-After that depends on whether the body asks for a stream (a budget
        to begin, or ``stream_served_at="first_token"`` with a budget)."""
        controller = self.controller
        hooks = self.hooks
        if not hooks.admits_without_body(request) or (
            request.budget is not None
            and (request.budget_to_start or controller.estimator.config.stream_served_at != "end")
        ):
            return None
        rejection = controller.refuse_at_once(request)
        if rejection is None:
            return None
        self.metrics.rejected(request.cls, rejection.code, rejection.retry_after)
        self.metrics.attempt(request.cls, rejection.code)  # no fleet's record: a try is an attempt
        return self.refusal(rejection, hooks.rejection_headers(request))

    def passage(self, request: AdmissionRequest, forward: ForwardRequest) -> Passage:
        """``request``'s way through the gate, its hooks made; :meth:`Passage.leave` ends it."""
        scope = self.hooks.scope(request, forward.body, forward.path, forward.parsed)
        return Passage(request, forward, scope, self)

    def count_admission(self, cls: str, headers: RawHeaders) -> None:
        """Count an admitted try: a caller's attempt, or with the fleet's record what the
        record says it is (fleet_attempts.py), once Redis answers."""
        attempts = self.fleet_attempts
        if attempts is None:
            self.metrics.attempt(cls)
            return

        async def count() -> None:
            admission = await attempts.admitted(attempt_key_of(headers))
            if admission.first:
                self.metrics.attempt(cls)
            elif admission.rescued_from is not None:
                self.metrics.rescued(cls, admission.rescued_from)

        task = asyncio.get_running_loop().create_task(count())
        self._counting.add(task)
        task.add_done_callback(self._counting.discard)

    def engine_refused(self, refused: UpstreamRefused, cls: str | None, exchange: Exchange) -> Refusal:
        """The refusal for a request the upstream could not serve, noted in ``exchange``: the
        engine at capacity (an admitted request's 503), else the upstream unavailable."""
        controller = self.controller
        if refused.overloaded and cls is not None:
            rejection = controller.overloaded_upstream(cls, refused.detail)
            exchange.reject(rejection, Outcome.OVERLOADED)
        else:
            retry_after = self.outage.failed()
            rejection = controller.upstream_unavailable(
                cls or controller.default_class, refused.detail, retry_after
            )
            exchange.reject(rejection, Outcome.UPSTREAM_ERROR)
        return self.refusal(rejection)

    def upstream_answered(self) -> None:
        """The upstream answered in HTTP: an outage, if one was counted, is over."""
        self.outage.answered()

    def first_body_byte(self, grant: Grant) -> None:
        """The first *body* byte of an admitted request's answer: vLLM sends a stream's headers
        before its first token, even while the request waits in the engine, so the header time
        says nothing about load."""
        if grant.ticket.admitted_at is None:
            return
        controller = self.controller
        seconds = self.clock() - grant.ticket.admitted_at
        if grant.ticket.request.stream:
            controller.estimator.observe_first_byte(seconds, grant.ticket.cls)
        if self.on_first_byte is not None:
            self.on_first_byte(seconds, controller.in_flight())

    def refusal(self, rejection: Rejection, headers: RawHeaders | None = None) -> Refusal:
        """The answer to ``rejection`` (the configured status unless it names its own)."""
        response = rejection_response(rejection, self.reject_status)
        return response.with_headers(headers) if headers else response


@dataclass(slots=True)
class Passage:
    """One generation request's way through the gate, entered and left once: what it asks
    for, what is forwarded (its body as the hooks rewrote it), its hooks, and its slot once
    granted; holding one, it is the relay's
    :class:`~llm_backoff_shim.serve.request_path.exchange.Admitted`."""

    request: AdmissionRequest
    forward: ForwardRequest
    scope: RequestScope
    gate: AdmissionGate
    grant: Grant | None = None
    #: Whether a refusal of this try is its caller's attempt's first (then counted as an
    #: attempt refused): without the fleet's record every try is; with it, as the record says,
    #: and never after this replica admitted the try (the admission counted the attempt).
    first_try: bool = True

    async def enter(self, exchange: Exchange) -> Refusal | None:
        """Take the tenant's quota and wait for a slot: None once granted (:attr:`grant`), else
        the refusal to answer, noted in ``exchange``."""
        gate, scope = self.gate, self.scope
        quota = await scope.take_quota()
        if quota is not None:
            self.request = replace(self.request, quota=quota)
        if scope.body is not self.forward.body:
            self.forward = self.forward._replace(body=scope.body)
        queued_at = gate.clock()
        decision = await gate.admission.acquire(self.request)
        if isinstance(decision, Rejection):
            if gate.fleet_hints is not None and gate.fleet_attempts is not None:
                headers = self.forward.headers
                soonest, self.first_try = await asyncio.gather(
                    gate.fleet_hints.soonest(request_id_of(headers), decision.retry_after),
                    gate.fleet_attempts.refused(attempt_key_of(headers), decision.code),
                )
                decision = replace(decision, retry_after=soonest)
            exchange.reject(decision)
            exchange.queue_time = gate.clock() - queued_at
            return gate.refusal(decision, scope.response_headers())
        self.grant = decision
        exchange.queue_time = decision.queue_time
        cls = self.request.cls
        gate.metrics.count(cls, "admitted")
        gate.count_admission(cls, self.forward.headers)
        self.first_try = gate.fleet_attempts is None
        gate.metrics.observe_queue_wait(cls, decision.queue_time)
        return None

    async def leave(self, exchange: Exchange) -> None:
        """Release the slot, settle the quota and count the outcome: once, on every path."""
        gate, grant = self.gate, self.grant
        if grant is not None:
            gate.admission.release(grant, exchange.outcome, exchange.answer_tokens)
        await self.scope.finish(served=grant is not None, status=exchange.status)
        cls = self.request.cls
        if exchange.metric == "rejected":
            gate.metrics.rejected(cls, exchange.code, exchange.retry_after or 0.0)
            if self.first_try:
                gate.metrics.attempt(cls, exchange.code)
        else:
            gate.metrics.count(cls, exchange.metric)

    @property
    def cls(self) -> str:
        return self.request.cls

    def answer_headers(self) -> RawHeaders:
        assert self.grant is not None
        queue_time = (b"x-queue-time-ms", str(round(self.grant.queue_time * 1000)).encode())
        return [queue_time, *self.scope.response_headers()]

    def observer(self) -> Callable[[bytes], None] | None:
        scope = self.scope
        # The base hooks read nothing: a stream's chunks then skip a call each.
        return None if type(scope).observe is RequestScope.observe else scope.observe

    def first_body_byte(self) -> None:
        assert self.grant is not None
        self.gate.first_body_byte(self.grant)


def attempt_key_of(headers: RawHeaders) -> str | None:
    """The fleet's name for the caller's attempt a request is a try of (fleet_attempts.py)."""
    start = None
    for key, value in headers:
        if key == b"x-request-start":
            start = parse_request_start(value.decode("latin-1"))
            break
    return attempt_key(request_id_of(headers), start)
