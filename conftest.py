"""Hypothesis profiles for every test folder of the repository.

``ci`` (the default): derandomized (a fixed seed per test), no example database, so a run
is decided by the code alone: never by an example a previous run saved in this checkout, and
never by luck. ``random``: a new seed each run and still no database, for the longer
randomized runs of ``scripts/test-properties-long.sh``. Choose with
``LLM_BACKOFF_HYPOTHESIS_PROFILE`` (or hypothesis's own ``--hypothesis-profile``).

Ports: a test that releases a port for a child server to bind races every other ``bind(0)``
on the machine, and under pytest-xdist (and the two lanes of ``scripts/test.sh``) those are
many. Each worker gets a block of its own below the kernel's ephemeral range, which
``llm_backoff_shim.lab.procs.free_port`` draws from (``LLM_BACKOFF_TEST_PORT_LANE`` 0 or 1
names the lane; each lane has 5,000 ports, 625 per worker).
"""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import HealthCheck, settings

_COMMON = {"database": None, "deadline": None, "print_blob": True}
settings.register_profile("ci", derandomize=True, suppress_health_check=[HealthCheck.too_slow], **_COMMON)
settings.register_profile("random", derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("LLM_BACKOFF_HYPOTHESIS_PROFILE", "ci"))


_PORTS_FROM, _LANE_PORTS, _WORKER_PORTS = 20_000, 5_000, 625


def _port_block(worker: int) -> str:
    lane = int(os.environ.get("LLM_BACKOFF_TEST_PORT_LANE", "0")) % 2
    start = _PORTS_FROM + lane * _LANE_PORTS + worker % (_LANE_PORTS // _WORKER_PORTS) * _WORKER_PORTS
    return f"{start}-{start + _WORKER_PORTS}"


def pytest_configure(config: pytest.Config) -> None:
    """This process's block: an xdist worker's own (``gwN``), or the first of the lane."""
    workerinput: dict[str, str] | None = getattr(config, "workerinput", None)
    match = re.fullmatch(r"gw(\d+)", workerinput["workerid"]) if workerinput else None
    os.environ["LLM_BACKOFF_PORT_BLOCK"] = _port_block(int(match.group(1)) if match else 0)
