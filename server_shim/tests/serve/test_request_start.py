"""A caller's budget counts from its load balancer's ``X-Request-Start`` stamp: one shim on
loopback, real HTTP, the stamp set as nginx and HAProxy set it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def sim() -> Iterator[ServerThread]:
    config = SimConfig(max_num_seqs=4, ttft=0.0, itl=0.001, output_tokens=4, seed=2)
    with ServerThread(create_sim_app(config)) as server:
        yield server


def post(url: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=BODY, headers=headers, timeout=10)


def test_a_budget_spent_before_the_shim_saw_the_call_is_refused_at_once(
    sim: ServerThread, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(sim.url)
    now = time.time()
    # Stamped 6 s ago by the load balancer (nginx's form), 5 s of budget: nothing is left.
    spent = post(shim.url, **{"x-request-timeout-ms": "5000", "x-request-start": f"t={now - 6:.3f}"})
    assert spent.status_code == 429, spent.text
    assert spent.json()["error"]["code"] == "queue_timeout"
    assert "already spent" in spent.json()["error"]["message"]
    # Stamped 1 s ago (HAProxy's form, milliseconds): 4 s left, served.
    assert (
        post(
            shim.url, **{"x-request-timeout-ms": "5000", "x-request-start": f"t={round((now - 1) * 1000)}"}
        ).status_code
        == 200
    )
    # Without a budget the stamp changes nothing; an unreadable stamp is ignored, not refused.
    assert post(shim.url, **{"x-request-start": f"t={now - 60:.3f}"}).status_code == 200
    assert (
        post(shim.url, **{"x-request-timeout-ms": "5000", "x-request-start": "yesterday"}).status_code == 200
    )
    waiter(lambda: shim.runtime.controller.in_flight() == 0, what="every slot back")
