"""The Retry-After of ``upstream_unavailable``: how long the engine has been unreachable.

The queue estimator cannot help here (nothing drains while the engine is down), and a
constant hint sends every caller back at the same short interval for as long as an
outage lasts. The rule: an outage seen for ``t`` seconds is expected to last about
``t`` more, so callers are told to come back in ``t`` (clamped to
``[minimum, maximum]``). Callers retrying through a long outage then back off
geometrically, as exponential backoff would, while a blip costs them only the
minimum. Any answer from the engine ends the outage.
"""

from __future__ import annotations

from collections.abc import Callable


class OutageClock:
    """Pure and clock-injected: ``failed()`` returns the hint, ``answered()`` resets."""

    def __init__(self, clock: Callable[[], float], minimum: float, maximum: float) -> None:
        if not 0 < minimum <= maximum:
            raise ValueError("need 0 < minimum <= maximum")
        self._clock = clock
        self._minimum = minimum
        self._maximum = maximum
        self._since: float | None = None

    @property
    def down_for(self) -> float:
        """Seconds since the first failure of the current outage (0 when the engine answers)."""
        return 0.0 if self._since is None else max(0.0, self._clock() - self._since)

    def failed(self) -> float:
        """Record a failure to reach the engine; the Retry-After to give, in seconds."""
        if self._since is None:
            self._since = self._clock()
        return min(self._maximum, max(self._minimum, self.down_for))

    def answered(self) -> None:
        self._since = None
