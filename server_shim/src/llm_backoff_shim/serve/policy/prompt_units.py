"""Learn the engine's bytes per token once, from its tokenizer, so the cost budget counts prompts
in the engine's own tokens (:class:`~llm_backoff_shim.decide.pricing.Pricing`).

At start-up the shim sends the engine's ``POST /tokenize`` (vLLM's, and the simulator's) a
paragraph of English prose (:data:`~llm_backoff_shim.decide.cost.SAMPLE_TEXT`) and prices
prompts at the bytes per token the engine counted. One request, once: a model's tokenizer does
not change while the engine runs. The engine is often still loading when the shim starts, so
an engine that cannot be reached is asked again every :data:`RETRY_SECONDS`, up to
:data:`ATTEMPTS` times; an engine that answers without a count (no such endpoint: 404, or an
implausible count) leaves the estimate at 4 bytes a token, and the shim says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from llm_backoff_shim.decide.cost import BYTES_PER_TOKEN, SAMPLE_TEXT
from llm_backoff_shim.decide.pricing import Pricing

log = logging.getLogger("llm_backoff_shim.prompt_units")

#: Seconds between two attempts while the engine cannot be reached.
RETRY_SECONDS = 5.0
#: Attempts before the shim keeps the fallback of 4 bytes a token (10 minutes at RETRY_SECONDS).
ATTEMPTS = 120
#: Seconds one attempt may take.
TIMEOUT = 5.0


async def ask_tokenizer(session: aiohttp.ClientSession, url: str, pricing: Pricing) -> bool | None:
    """One attempt: True when the engine's count was learned, False when the engine answered
    without a usable one (do not ask again), None when it could not be reached (ask later)."""
    try:
        async with session.post(
            url,
            json={"prompt": SAMPLE_TEXT, "add_special_tokens": False},
            timeout=aiohttp.ClientTimeout(total=TIMEOUT),
            allow_redirects=False,
        ) as response:
            if response.status >= 500:
                return None
            data = await response.json(content_type=None) if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
        log.debug("engine tokenizer not reached: %s", exc)
        return None
    count = data.get("count") if isinstance(data, dict) else None
    if isinstance(count, int) and pricing.learn_ratio(SAMPLE_TEXT, count):
        log.info(
            "cost budget: prompts counted at %.2f UTF-8 bytes per token, the engine's tokenizer's (%s)",
            pricing.ratio,
            url,
        )
        return True
    log.warning(
        "cost budget: the engine's %s gave no usable token count (status %s); prompts are counted "
        "at %g bytes per token, which may not be this model's (docs/shim.md, cost budget)",
        url,
        response.status,
        BYTES_PER_TOKEN,
    )
    return False


class PromptUnits:
    """The start-up task that asks the engine's tokenizer (module docstring)."""

    def __init__(self, pricing: Pricing, *, url: str, session: Callable[[], aiohttp.ClientSession]) -> None:
        self.pricing = pricing
        self.url = url
        self._session = session
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        for _ in range(ATTEMPTS):
            if await ask_tokenizer(self._session(), self.url, self.pricing) is not None:
                return
            await asyncio.sleep(RETRY_SECONDS)
        log.warning(
            "cost budget: the engine's tokenizer (%s) was never reached; prompts are counted at %g "
            "bytes per token",
            self.url,
            BYTES_PER_TOKEN,
        )

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="prompt-units")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
