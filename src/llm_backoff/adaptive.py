"""Adaptive client-side request rate, after the AWS SDKs' "adaptive" retry mode.

The controller is pure (clock injected, no locks, no I/O): the limiter that owns it
calls :meth:`AdaptiveRate.on_response` under its own lock and applies the returned
rate to a token bucket. The algorithm follows botocore's ``retries/adaptive.py``,
``retries/cubic.py`` and ``RateClocker`` closely, because that design is proven
at fleet scale and its constants are documented:

- It starts **unthrottled**: until the first throttle (HTTP 429 or 503) no rate is
  enforced, so a client that never meets a limit pays nothing.
- On a throttle the rate drops **multiplicatively** to ``beta`` (0.7) times the rate
  the client was actually sending at, and that rate becomes ``w_max``.
- On success it recovers along the **CUBIC** curve
  ``rate(t) = scale * (t - K)**3 + w_max`` with ``K = cbrt(w_max * (1 - beta) / scale)``:
  fast right after the cut, flat near ``w_max`` (where the last throttle happened),
  and probing above it only slowly. This is what keeps a fleet near a server's
  capacity instead of sawing between "too fast" and "much too slow".
- The new rate is never more than twice the measured sending rate (so an idle
  client does not "earn" a huge rate), never above ``ceiling`` and never below
  ``floor``.

Any response other than 429/503 counts as a success, as in the AWS SDKs (a 500 says
nothing about the rate). A request that failed without a response gives no signal.
"""

from __future__ import annotations

import math
from collections.abc import Callable

THROTTLE_STATUSES = frozenset({429, 503})


class SendRateMeter:
    """Smoothed rate of responses per second, measured in half-second buckets.

    Same scheme as botocore's ``RateClocker``: count events, and each time a new
    time bucket starts fold ``count / bucket_span`` into an exponentially weighted
    average (weight ``smoothing`` for the newest bucket).

    One change: botocore reports 0 until the first bucket completes, so a client
    throttled in its first half-second of traffic drops to the floor and then
    crawls back along the cubic from zero. Here, until a bucket has completed, the
    rate is the count so far over the time since the first event (at least a tenth
    of a bucket span), and the clock starts at the first event rather than at
    creation, so a limiter built long before its first call does not look idle.
    Early estimates err high on purpose: too high a rate is corrected within a few
    responses by further 429s, too low a one only slowly by the cubic climb.
    """

    __slots__ = ("_bucket_span", "_count", "_first", "_last_bucket", "_smoothing", "_warm", "rate")

    def __init__(self, *, smoothing: float = 0.8, bucket_span: float = 0.5) -> None:
        self._smoothing = smoothing
        self._bucket_span = bucket_span
        self._first: float | None = None
        self._last_bucket = 0.0
        self._count = 0
        self._warm = False
        self.rate = 0.0

    def record(self, now: float) -> float:
        bucket = math.floor(now / self._bucket_span) * self._bucket_span
        if self._first is None:
            self._first = now
            self._last_bucket = bucket
        self._count += 1
        if bucket > self._last_bucket:
            current = self._count / (bucket - self._last_bucket)
            if self._warm:
                self.rate = current * self._smoothing + self.rate * (1.0 - self._smoothing)
            else:
                self.rate = current
                self._warm = True
            self._count = 0
            self._last_bucket = bucket
        elif not self._warm:
            self.rate = self._count / max(now - self._first, self._bucket_span / 10)
        return self.rate


class AdaptiveRate:
    """CUBIC rate controller: call :meth:`on_response` after each response.

    ``rate`` is the allowed requests per second once ``enabled`` (after the first
    throttle); before that the caller should not limit at all. Not thread-safe on
    its own: the owning limiter serialises calls.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        ceiling: float = math.inf,
        floor: float = 0.5,
        beta: float = 0.7,
        scale: float = 0.4,
    ) -> None:
        if not floor > 0 or math.isnan(floor) or math.isinf(floor):
            raise ValueError(f"floor must be a positive finite rate, got {floor!r}")
        if not ceiling >= floor:
            raise ValueError(f"ceiling ({ceiling!r}) must be >= floor ({floor!r})")
        if not 0 < beta < 1:
            raise ValueError(f"beta must be in (0, 1), got {beta!r}")
        if not scale > 0 or math.isinf(scale):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        self._clock = clock
        self.ceiling = ceiling
        self.floor = floor
        self._beta = beta
        self._scale = scale
        now = clock()
        self._meter = SendRateMeter()
        self._w_max = 0.0
        self._k = 0.0
        self._last_throttle = now
        self.enabled = False
        self.rate = ceiling

    @property
    def measured_rate(self) -> float:
        return self._meter.rate

    def _zero_point(self) -> float:
        return float(math.pow(self._w_max * (1.0 - self._beta) / self._scale, 1.0 / 3.0))

    def _cubic(self, now: float) -> float:
        t = now - self._last_throttle - self._k
        return self._scale * t * t * t + self._w_max

    def on_response(self, *, throttled: bool) -> float:
        """Fold one response into the controller; return the new allowed rate."""
        now = self._clock()
        measured = self._meter.record(now)
        if throttled:
            # What we were really sending at, not what we were allowed: a client
            # allowed 100/s that sends 5/s and is throttled must drop below 5/s.
            sending = measured if not self.enabled else min(measured, self.rate)
            self._w_max = sending
            self._k = self._zero_point()
            self._last_throttle = now
            new_rate = sending * self._beta
            self.enabled = True
        else:
            new_rate = self._cubic(now)
        self.rate = min(self.ceiling, max(self.floor, min(new_rate, 2.0 * measured)))
        return self.rate
