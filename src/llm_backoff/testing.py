"""Test helpers: make retries instant without touching the code under test.

``with llm_backoff.testing.instant_retries():`` makes every wrapped client skip its
waits (the waits are still computed and recorded in the attempt history and
events, so tests can assert on them) and optionally caps the number of attempts.

The switch is a `contextvars.ContextVar`, not a global flag: it applies to the
current thread and to asyncio tasks created inside the block, and it is undone
when the block exits, so it cannot leak from one test into the next. Threads
started inside the block do not inherit it (use ``contextvars.copy_context().run``
to carry it over).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TestingMode:
    __test__ = False  # not a pytest test class

    max_attempts: int | None = None


_mode: ContextVar[TestingMode | None] = ContextVar("llm_backoff_testing", default=None)


def current_mode() -> TestingMode | None:
    """The active testing mode, or None in normal operation."""
    return _mode.get()


@contextlib.contextmanager
def instant_retries(*, max_attempts: int | None = None) -> Iterator[TestingMode]:
    """Skip retry waits (and cap attempts at ``max_attempts`` if given) inside the block."""
    if max_attempts is not None and max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    mode = TestingMode(max_attempts=max_attempts)
    token = _mode.set(mode)
    try:
        yield mode
    finally:
        _mode.reset(token)
