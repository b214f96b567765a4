"""How soon a call gives up when no one can serve it: a dead server, and a shim whose engine is down.

Real processes on loopback: ``llm-backoff-shim serve`` with ``--upstream`` a closed port (its
engine is down), and a closed port alone (a dead server). For each, one chat completion by
plain ``openai`` (its own two retries), by ``llm_backoff.wrap(client)`` (the default policy),
and by the interactive and batch presets; the time until it raises, the attempts made and why
it gave up. Each call gets a fresh shim, so its outage starts with the call (the shim's hint is
the outage's length so far: 1 s at first); ``--aged S`` adds a run where the shim has seen the
outage for ``S`` seconds already (its hints then say ``S`` s, up to 30).

Then the batch preset through a shim in front of the simulator, whose engine is killed
(SIGKILL) under the call and started again ``--down`` seconds later on the same port: the
call is expected to succeed.

    .venv/bin/python bench/bench_dead_engine.py [--aged 20] [--down 3] [--skip-batch]

The batch preset waits out its 10-minute deadline against a dead server or shim: it is run only
in the restart scenario (and against a dead server with ``--batch-dead``).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import openai

import llm_backoff
from llm_backoff_shim.lab.procs import ChildServer, free_port, shim_server, sim_server

MESSAGES = [{"role": "user", "content": "hi"}]


def shim_to(upstream: ChildServer | str) -> ChildServer:
    return shim_server(upstream, ())


def clients() -> dict[str, Callable[[str], Any]]:
    return {
        "plain openai (max_retries=2)": lambda url: openai.OpenAI(base_url=url, api_key="x"),
        "wrap(client)": lambda url: llm_backoff.wrap(openai.OpenAI(base_url=url, api_key="x")),
        "wrap(client, request_class='interactive')": lambda url: llm_backoff.wrap(
            openai.OpenAI(base_url=url, api_key="x"), request_class="interactive"
        ),
    }


def attempts(history: tuple[llm_backoff.Attempt, ...] | None) -> str:
    if history is None:
        return "attempts -"
    return f"attempts {len(history)} [{' '.join(str(a.status or 'conn') for a in history)}]"


def time_call(client: Any, max_tokens: int = 4) -> tuple[float, str]:
    """(seconds, what the call ended with) of one chat completion."""
    started = time.monotonic()
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=MESSAGES, max_tokens=max_tokens
        )
    except Exception as exc:
        seconds = time.monotonic() - started
        reason = getattr(exc, "_llm_backoff_reason", None) or ""
        history = getattr(exc, "llm_backoff_attempts", None)
        return seconds, f"{type(exc).__name__}, {attempts(history)} {reason[:90]}"
    history = raw.http_response.extensions.get("llm_backoff.attempts")
    return time.monotonic() - started, f"status {raw.http_response.status_code}, {attempts(history)}"


def dead_targets(aged: float) -> None:
    print(f"{'target':34s} {'client':44s} {'seconds':>8s}  outcome")
    for name, make in clients().items():
        dead = f"http://127.0.0.1:{free_port()}/v1"
        seconds, outcome = time_call(make(dead))
        print(f"{'dead server (closed port)':34s} {name:44s} {seconds:8.2f}  {outcome}", flush=True)
        with shim_to(f"http://127.0.0.1:{free_port()}") as shim:
            seconds, outcome = time_call(make(shim.url + "/v1"))
        print(f"{'shim, engine down (fresh outage)':34s} {name:44s} {seconds:8.2f}  {outcome}", flush=True)
    if aged > 0:
        for name, make in clients().items():
            with shim_to(f"http://127.0.0.1:{free_port()}") as shim:
                time_call(openai.OpenAI(base_url=shim.url + "/v1", api_key="x", max_retries=0))
                time.sleep(aged)
                seconds, outcome = time_call(make(shim.url + "/v1"))
            label = f"shim, engine down {aged:g} s already"
            print(f"{label:34s} {name:44s} {seconds:8.2f}  {outcome}", flush=True)


def batch_through_restart(down: float) -> None:
    sim_flags = ("--ttft", "0.1", "--itl", "0.02", "--output-tokens", "100", "--output-tokens-sigma", "0")
    with sim_server(sim_flags) as engine, shim_to(engine) as shim:
        plain = openai.OpenAI(base_url=shim.url + "/v1", api_key="x")
        client = llm_backoff.wrap(plain, request_class="batch")
        result: list[tuple[float, str]] = []
        caller = threading.Thread(target=lambda: result.append(time_call(client, max_tokens=100)))
        started = time.monotonic()
        caller.start()
        time.sleep(0.5)  # the call is in the engine (100 tokens at 20 ms: 2 s)
        engine.kill()
        killed = time.monotonic() - started
        time.sleep(down)
        engine.restart()
        back = time.monotonic() - started
        caller.join()
    seconds, outcome = result[0]
    print(
        f"batch preset through a shim, engine SIGKILLed at {killed:.2f} s, back at {back:.2f} s: "
        f"{outcome} after {seconds:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--aged", type=float, default=20.0, help="also measure an outage this old (0: no)")
    parser.add_argument("--down", type=float, default=3.0, help="seconds the engine is down in the batch run")
    parser.add_argument("--skip-batch", action="store_true", help="no engine-restart run")
    args = parser.parse_args()
    dead_targets(args.aged)
    if not args.skip_batch:
        batch_through_restart(args.down)


if __name__ == "__main__":
    main()
