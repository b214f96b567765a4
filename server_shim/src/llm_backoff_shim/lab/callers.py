"""The load generator's callers: one openai client per request class, plain or wrapped by llm_backoff."""

from __future__ import annotations

from typing import Any

import openai

from llm_backoff import RetryPolicy, wrap
from llm_backoff.budget import RetryBudget
from llm_backoff_shim.lab.scenario import RequestClass, Scenario, Setup


def _budget(scenario: Scenario) -> RetryBudget:
    # One retry per first attempt, remembered for a whole call deadline: enough for a
    # caller to come back at its Retry-After, not enough for a fleet to double again.
    return RetryBudget(ratio=1.0, min_per_second=2.0, ttl=scenario.longest_deadline)


def retry_policy(cls: RequestClass, scenario: Scenario, *, start_deadline: bool = True) -> RetryPolicy:
    """The ``llm_backoff`` policy of a caller of ``cls``: the call's deadline, and for an
    interactive caller (``start_deadline``) its time-to-first-token budget as the time the
    answer must begin by. That is a caller stating a budget it knows, not a tuning: the SDK
    then sends what is left of it as ``x-request-timeout-ms``, so the shim refuses at once a
    request that cannot start in time, and no retry waits past it. Batch callers have no
    such budget. Plain openai callers have no such knob."""
    deadline = scenario.deadline_of(cls)
    if start_deadline and cls == "interactive":
        return RetryPolicy(deadline=deadline, start_deadline=scenario.ttft_budget)
    return RetryPolicy(deadline=deadline)


def build_clients(
    setup: Setup, scenario: Scenario, base_url: str, http_client: Any, *, start_deadline: bool = True
) -> dict[RequestClass, openai.AsyncOpenAI]:
    """One openai client per class, all sharing ``http_client`` (and its counting transport).

    ``start_deadline``: interactive ``llm_backoff`` callers state their TTFT budget
    (:func:`retry_policy`); off, they have the call's deadline only (the reference
    to compare ``start_deadline`` against).
    """
    budget = _budget(scenario)
    clients: dict[RequestClass, openai.AsyncOpenAI] = {}
    classes: tuple[RequestClass, ...] = ("interactive", "batch")
    for cls in classes:
        if setup.client == "plain":
            # What a team writes today: the defaults (2 retries), the deadline as timeout,
            # and the class header, which any client can send and the engine ignores.
            clients[cls] = openai.AsyncOpenAI(
                base_url=base_url + "/v1",
                api_key="demo",
                http_client=http_client,
                timeout=scenario.deadline_of(cls),
                default_headers={"x-request-class": cls},
            )
        else:
            raw = openai.AsyncOpenAI(
                base_url=base_url + "/v1",
                api_key="demo",
                http_client=http_client,
                timeout=scenario.deadline_of(cls),
            )
            if setup.client == "llm_backoff_presets" and cls == "interactive" and setup.interactive_fields:
                given: dict[str, Any] = dict(setup.interactive_fields)
                policy = RetryPolicy.interactive(**given)
                clients[cls] = wrap(raw, policy, request_class=cls, budget=budget)
            elif setup.client == "llm_backoff_presets":
                clients[cls] = wrap(raw, request_class=cls, budget=budget)  # the class's preset
            else:
                policy = retry_policy(cls, scenario, start_deadline=start_deadline)
                clients[cls] = wrap(raw, policy, request_class=cls, budget=budget)
    return clients
