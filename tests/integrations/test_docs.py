"""docs/integrations.md's recipes run as written against a real shim (the 429s are the other tests' job).

Each framework's python blocks run after the "The wrapped clients" block, in one
namespace, with the documented shim address replaced by the test shim's. The
simulator here answers five tokens, so the blocks need no ``max_tokens``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import llm_backoff
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

from .rig import FIVE_TOKENS, PERSON_JSON, Rig

pytestmark = pytest.mark.integrations

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
DOCUMENTED_SHIM = "http://127.0.0.1:8080/v1"


def python_blocks(title_start: str) -> list[str]:
    """The python blocks of the ``## `` section whose title starts with ``title_start``."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title_start)}[^\n]*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"docs/integrations.md has no section '## {title_start}...'"
    blocks: list[str] = re.findall(r"^```python[ \t]*\n(.*?)^```", match.group(1), re.M | re.S)
    assert blocks, f"section '{title_start}' has no python block"
    return blocks


def run_recipe(title_start: str, shim_url: str) -> dict[str, Any]:
    setup = python_blocks("The wrapped clients")[0]
    assert DOCUMENTED_SHIM in setup, "the setup block no longer names the documented shim address"
    namespace: dict[str, Any] = {"__name__": "integrations_doc"}
    code = "\n".join([setup, *python_blocks(title_start)]).replace(DOCUMENTED_SHIM, shim_url)
    exec(compile(code, f"docs/integrations.md:{title_start}", "exec"), namespace)
    return namespace


def assert_went_through(rig: Rig, namespace: dict[str, Any]) -> None:
    snapshots = [llm_backoff.client_stats(namespace[name]).snapshot() for name in ("w", "aw")]
    assert sum(s.calls for s in snapshots) >= 1, "no request went through the wrapped clients"
    assert sum(s.failed_calls for s in snapshots) == 0
    assert rig.refused() == {}


@pytest.fixture
def short_rig() -> Iterator[Rig]:
    with ServerThread(create_sim_app(SimConfig(ttft=0.001, itl=0.001, output_tokens=5, seed=1))) as sim:
        made = Rig(sim)
        try:
            yield made
        finally:
            made.close()


def test_langchain_recipe_runs(short_rig: Rig) -> None:
    pytest.importorskip("langchain_openai")
    namespace = run_recipe("LangChain", short_rig.url)
    assert namespace["llm"].invoke("again").content == FIVE_TOKENS
    assert_went_through(short_rig, namespace)


def test_pydantic_ai_recipe_runs(short_rig: Rig) -> None:
    pytest.importorskip("pydantic_ai")
    namespace = run_recipe("pydantic-ai", short_rig.url)
    assert namespace["result"].output == FIVE_TOKENS
    assert_went_through(short_rig, namespace)


def test_instructor_recipe_runs(json_rig: Rig) -> None:
    pytest.importorskip("instructor")
    namespace = run_recipe("instructor", json_rig.url)
    assert namespace["person"].model_dump() == json.loads(PERSON_JSON)
    assert_went_through(json_rig, namespace)


def test_openai_agents_recipe_runs(short_rig: Rig) -> None:
    pytest.importorskip("agents")
    namespace = run_recipe("openai-agents", short_rig.url)
    assert namespace["result"].final_output == FIVE_TOKENS
    assert_went_through(short_rig, namespace)


def test_llama_index_recipe_runs(short_rig: Rig) -> None:
    pytest.importorskip("llama_index.llms.openai_like")
    namespace = run_recipe("llama-index", short_rig.url)
    assert namespace["llm"].complete("again").text == FIVE_TOKENS
    assert_went_through(short_rig, namespace)
