"""llm-backoff: resilient calls to self-hosted LLM endpoints.

``client = llm_backoff.wrap(openai.OpenAI(...), llm_backoff.RetryPolicy(deadline=30))``
returns a client of the same class whose every request is retried with
Retry-After-aware, jittered, deadline-bound backoff (``anthropic.Anthropic`` clients
too). ``wrap(client, request_class="interactive")`` without a policy fails fast when
the answer cannot begin within 5 s (`RetryPolicy.interactive`); ``"batch"`` waits
patiently (`RetryPolicy.batch`).
"""

from .adaptive import AdaptiveRate
from .attempts import Attempt
from .budget import RetryBudget
from .errors import LLMBackoffError, RateLimitTimeout, UnsupportedClientError
from .events import CallObserver, RetryEvent, RetryObservers
from .policy import RetryPolicy
from .ratelimit import RateLimiter, RequestTooLargeError, TokenBucket
from .redis_bucket import RedisRateLimiter, RedisTokenBucket
from .stats import ClientStats, StatsSnapshot
from .strategies import retry_if_retryable, wait_retry_after
from .wrap import call_observers, client_stats, retry_observers, wrap

__version__ = "0.1.0"

__all__ = [
    "AdaptiveRate",
    "Attempt",
    "CallObserver",
    "ClientStats",
    "LLMBackoffError",
    "RateLimitTimeout",
    "RateLimiter",
    "RedisRateLimiter",
    "RedisTokenBucket",
    "RequestTooLargeError",
    "RetryBudget",
    "RetryEvent",
    "RetryObservers",
    "RetryPolicy",
    "StatsSnapshot",
    "TokenBucket",
    "UnsupportedClientError",
    "__version__",
    "call_observers",
    "client_stats",
    "retry_if_retryable",
    "retry_observers",
    "wait_retry_after",
    "wrap",
]
