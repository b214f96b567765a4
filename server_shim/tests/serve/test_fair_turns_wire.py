"""Fair turns between tenants end to end: real openai clients with two API keys, a real shim
and a held upstream on loopback; no tenants file, no setting."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import openai
import pytest

HELD = {"x-fake-hold": "1"}


def chat(client: openai.OpenAI, name: str) -> str:
    """One chat call named ``name`` in its prompt; the upstream echoes it back."""
    raw = client.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": name}], extra_headers=HELD
    )
    echoed: dict[str, Any] = json.loads(raw.http_response.text)["echo"]
    return str(echoed["messages"][0]["content"])


def test_a_quiet_key_beside_a_flooding_one_takes_its_turn_in_a_full_queue(
    upstream: Any, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    shim = make_shim(upstream.url, max_concurrency=1, max_queue=3, max_queue_wait=30.0)
    flood = openai.OpenAI(base_url=shim.url + "/v1", api_key="sk-flood", max_retries=0)
    quiet = openai.OpenAI(base_url=shim.url + "/v1", api_key="sk-quiet", max_retries=0)
    with ThreadPoolExecutor(5) as pool:
        calls: dict[str, Future[str]] = {}
        try:
            for i in range(4):  # one held upstream, three queued: the class's queue is full
                calls[f"flood-{i}"] = pool.submit(chat, flood, f"flood-{i}")
                waiter(lambda n=i: shim.state()["interactive"] == (1, n), what=f"flood-{i} in place")
            calls["quiet"] = pool.submit(chat, quiet, "quiet")
            # The flood's last place went to the quiet key: refused as a full queue refuses.
            with pytest.raises(openai.RateLimitError) as refused:
                calls["flood-3"].result(timeout=10)
            assert refused.value.response.headers["retry-after"]
            assert refused.value.body is not None
            assert refused.value.body["code"] == "queue_full"  # type: ignore[index]
            assert shim.state()["interactive"] == (1, 3)
        finally:
            upstream.release()  # the held calls end, whatever was asserted
        served = {name: call.result(timeout=10) for name, call in calls.items() if name != "flood-3"}
    assert served == {name: name for name in served}
    # Admitted one at a time: the upstream saw them in the shim's serve order.
    order = [json.loads(r.body)["messages"][0]["content"] for r in upstream.received]
    assert order == ["flood-0", "flood-1", "quiet", "flood-2"]
    assert shim.state()["interactive"] == (0, 0)
