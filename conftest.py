"""Hypothesis profiles for every test folder of the repository.

``ci`` (the default): derandomized (a fixed seed per test), no example database, so a run
is decided by the code alone: never by an example a previous run saved in this checkout, and
never by luck. ``random``: a new seed each run and still no database, for the longer
randomized runs of ``scripts/test-properties-long.sh``. Choose with
``LLM_BACKOFF_HYPOTHESIS_PROFILE`` (or hypothesis's own ``--hypothesis-profile``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {"database": None, "deadline": None, "print_blob": True}
settings.register_profile(
    "ci", derandomize=True, suppress_health_check=[HealthCheck.too_slow], **_COMMON
)
settings.register_profile("random", derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("LLM_BACKOFF_HYPOTHESIS_PROFILE", "ci"))
