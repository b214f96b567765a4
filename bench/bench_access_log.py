"""CPU per request line: the shim's access log (plain, JSON) against uvicorn's access log it replaces.

Each variant logs through the logging module to an in-memory stream with the
formatter ``serve`` installs, in interleaved rounds, timed in process CPU time;
reported is the median and minimum over rounds of microseconds per line, and the
median difference to uvicorn's line measured in the same round (what turning the
shim's line on costs net, since ``serve`` switches uvicorn's off).

    .venv/bin/python bench/bench_access_log.py [--rounds 21] [--lines 20000]
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import time
from collections.abc import Callable

from uvicorn.logging import AccessFormatter

from llm_backoff_shim.serve.observe.access_log import AccessLog, AccessRecord


def isolated_logger(name: str, formatter: logging.Formatter) -> logging.Logger:
    logger = logging.getLogger(f"bench.{name}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    return logger


def shim_line(log_format: str) -> Callable[[], None]:
    access = AccessLog(
        log_format,  # type: ignore[arg-type]
        logger=isolated_logger(log_format, logging.Formatter("%(message)s")),
    )

    def one() -> None:
        now = time.monotonic()
        record = AccessRecord(
            method="POST", path="/v1/chat/completions", arrival=now - 0.5, client="10.0.0.7"
        )
        record.cls, record.tenant, record.outcome, record.status = (
            "interactive",
            "3f1a9c0d2b7e",
            "completed",
            200,
        )
        record.queue_time, record.upstream_start, record.first_byte = 0.002, now - 0.45, now - 0.3
        record.upstream_end = now
        access.write(record)

    return one


def uvicorn_line() -> Callable[[], None]:
    formatter = AccessFormatter(
        '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False
    )
    logger = isolated_logger("uvicorn", formatter)

    def one() -> None:
        logger.info('%s - "%s %s HTTP/%s" %d', "10.0.0.7:51234", "POST", "/v1/chat/completions", "1.1", 200)

    return one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--lines", type=int, default=20000)
    args = parser.parse_args()
    variants = {
        "uvicorn access log": uvicorn_line(),
        "shim plain": shim_line("plain"),
        "shim json": shim_line("json"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            one = variants[name]
            start = time.process_time()
            for _ in range(args.lines):
                one()
            times[name].append((time.process_time() - start) / args.lines * 1e6)
        print(
            f"round {r + 1:2d}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1]:.1f} us" for n in names),
            flush=True,
        )
    base = times["uvicorn access log"]
    print()
    print("| line | us/line (median) | us/line (min) | median extra vs uvicorn's line |")
    print("| --- | ---: | ---: | ---: |")
    for name in names:
        extra = statistics.median(t - b for t, b in zip(times[name], base, strict=True))
        shown = "-" if name == "uvicorn access log" else f"{extra:+.1f} us"
        print(f"| {name} | {statistics.median(times[name]):.1f} | {min(times[name]):.1f} | {shown} |")


if __name__ == "__main__":
    main()
