"""What every fleet test needs: the load balancer it runs, installed (CI installs both)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from llm_backoff_shim.lab.fleet_configs import lb_binary


def require_lb(lb: str) -> None:
    """Skip without ``lb`` installed; in CI, fail (scripts/test.sh installs it)."""
    if lb_binary(lb) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{lb} is not installed, and CI must run this test (scripts/test.sh installs it)")
        pytest.skip(f"{lb} is not installed (apt-get install {lb})")


@pytest.fixture
def need() -> Callable[[str], None]:
    """:func:`require_lb`, for the tests and fixtures of this folder."""
    return require_lb
