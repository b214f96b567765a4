"""Does calibrate's cost budget turn away work an idle engine could do? (issue #36)

Starts the simulator (8 sequences, the fast engine of docs/calibrate.md, every natural
answer 64 tokens long), runs ``calibrate`` on the chat and long-prompt mix against it, starts
the shim with exactly the flags calibrate printed, and on the idle engine sends, through the
shim with the real openai client (no retries):

- one call alone and then 8 at once with ``max_tokens: 4096`` (a common client setting);
- one call alone and then 8 at once naming no ``max_tokens``.

It prints, per case, how many of the 8 were refused (429) and how long the 8 took together
against the one alone, and the same 8 sent straight to the engine (what the engine does with
them: each step is 10 % slower per extra sequence, so 8 together take about 1.6 times one)::

    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_cost_idle.py
    flock /tmp/llm-backoff-bench.lock .venv/bin/python bench/bench_cost_idle.py --python OLD/bin/python

``--python``: another install of the shim (the one before a change) runs the simulator,
calibrate and the shim. ``--flags "..."``: skip calibrate and serve with these flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import time

import openai

from llm_backoff_shim.lab.procs import ChildServer, cli_command

SIM_FLAGS = [
    "--max-num-seqs", "8", "--ttft", "0.02", "--itl", "0.008", "--itl-batch-factor", "0.1",
    "--prefill-time-per-token", "0.0001", "--output-tokens", "64", "--output-tokens-sigma", "0",
    "--seed", "1",
]  # fmt: skip
CALIBRATE_FLAGS = [
    "--ttft-slo", "1", "--tpot-slo", "0.1", "--max-level", "32", "--long-share", "0.2",
    "--long-prompt-words", "1100-2200", "--max-seconds", "120", "--json",
]  # fmt: skip


def calibrate(url: str, python: str | None) -> list[str]:
    """The ``serve`` flags calibrate recommends for the mix (without ``--upstream``)."""
    argv = cli_command("calibrate", "--upstream", url, *CALIBRATE_FLAGS, "--out", "/tmp", python=python)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        sys.exit(f"calibrate failed ({done.returncode}):\n{done.stderr[-2000:]}")
    command = json.loads(done.stdout)["recommendation"]["command"]
    words = shlex.split(command)[2:]
    i = words.index("--upstream")
    return words[:i] + words[i + 2 :]


async def one(client: openai.AsyncOpenAI, max_tokens: int | None) -> bool:
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    try:
        await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "Say hello to the team."}], **extra
        )
    except openai.RateLimitError:
        return False
    return True


async def case(client: openai.AsyncOpenAI, max_tokens: int | None) -> tuple[float, float, int]:
    """(seconds for one alone, seconds for 8 at once, how many of the 8 got a 429)."""
    start = time.perf_counter()
    await one(client, max_tokens)
    alone = time.perf_counter() - start
    start = time.perf_counter()
    served = await asyncio.gather(*(one(client, max_tokens) for _ in range(8)))
    return alone, time.perf_counter() - start, served.count(False)


async def drive(url: str) -> list[tuple[str, float, float, int]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        rows = []
        for label, max_tokens in (("max_tokens 4096", 4096), ("no max_tokens", None)):
            rows.append((label, *await case(client, max_tokens)))
        return rows
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="the interpreter of another install of the shim")
    parser.add_argument("--flags", help="serve flags to use instead of calibrating")
    args = parser.parse_args()
    sim = ChildServer("simulator", lambda port: cli_command(
        "sim", "--host", "127.0.0.1", "--port", str(port), *SIM_FLAGS, python=args.python))  # fmt: skip
    with sim:
        flags = shlex.split(args.flags) if args.flags else calibrate(sim.url, args.python)
        print("serve flags:", " ".join(flags))
        shim = ChildServer("shim", lambda port: cli_command(
            "serve", "--upstream", sim.url, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--access-log", "false", *flags, python=args.python))  # fmt: skip
        with shim:
            rows = asyncio.run(drive(shim.url))
        direct = asyncio.run(drive(sim.url))
    print(f"{'calls':<16} {'one alone':>10} {'8 at once':>10} {'ratio':>6} {'429s':>5}  engine alone: ratio")
    for (label, alone, together, refused), (_, one, eight, _) in zip(rows, direct, strict=True):
        print(
            f"{label:<16} {alone:>9.2f}s {together:>9.2f}s {together / alone:>6.2f} {refused:>5}/8"
            f"  {eight / one:>6.2f}"
        )


if __name__ == "__main__":
    main()
