"""Every ```python block of README.md and docs/*.md runs as written against the simulator.

One simulator and one shim in front of it are started in-process for the module; each block
runs in a fresh namespace with only the documented addresses replaced: the shim's
``127.0.0.1:8080`` and the engine's ``127.0.0.1:8000`` by the real ports. A block passes
when it raises nothing. Blocks that cannot run here are listed in :data:`NOT_RUN_HERE` with
the reason; a block that needs an optional package which is not installed is skipped.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig

#: conftest's ``sim_and_shim_servers``.
SimAndShim = Callable[[SimConfig], contextlib.AbstractContextManager[tuple[ServerThread, ServerThread]]]

ROOT = Path(__file__).resolve().parents[2]

#: Pages whose python blocks are run elsewhere, with the reason.
NOT_RUN_HERE = {
    "docs/integrations.md": (
        "its blocks build on one another and need the frameworks installed: "
        "tests/integrations/test_docs.py runs them in order against a real shim"
    ),
}

#: Packages some blocks use that a lean environment (the shim's dependency floors) lacks.
OPTIONAL = frozenset({"tenacity", "opentelemetry", "redis"})

_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def snippets() -> list[Snippet]:
    found = []
    for path in pages():
        text = path.read_text(encoding="utf-8")
        page = str(path.relative_to(ROOT))
        for match in _BLOCK.finditer(text):
            found.append(Snippet(page, text.count("\n", 0, match.start()) + 1, match.group(1)))
    return found


def to_run() -> list[Snippet]:
    return [s for s in snippets() if s.page not in NOT_RUN_HERE]


@pytest.fixture(scope="module")
def servers(sim_and_shim_servers: SimAndShim) -> Iterator[tuple[ServerThread, ServerThread]]:
    # Five-token answers at 1 ms a token: each block's calls take milliseconds.
    with sim_and_shim_servers(SimConfig(ttft=0.001, itl=0.001, output_tokens=5, seed=1)) as pair:
        yield pair


def _close_clients(namespace: dict[str, Any]) -> None:
    import openai

    for value in namespace.values():
        if isinstance(value, openai.OpenAI):
            value.close()


@pytest.mark.parametrize("snippet", to_run(), ids=lambda s: s.name)
def test_snippet_runs_as_written(snippet: Snippet, servers: tuple[ServerThread, ServerThread]) -> None:
    sim, shim = servers
    code = snippet.code.replace("127.0.0.1:8080", f"127.0.0.1:{shim.port}")
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{sim.port}")
    namespace: dict[str, Any] = {"__name__": "doc_snippet"}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, snippet.name, "exec"), namespace)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{snippet.name} needs {exc.name}, not installed here")
        raise
    finally:
        _close_clients(namespace)


def test_the_docs_have_snippets_and_every_exception_names_a_page() -> None:
    found = snippets()
    assert len(to_run()) >= 10, [s.name for s in found]
    assert set(NOT_RUN_HERE) <= {s.page for s in found}, "an exception names a page without python blocks"


def test_the_finder_sees_python_blocks_only() -> None:
    text = "a\n```python\nx = 1\n```\n```bash\necho\n```\n```python\ny = 2\n```\n"
    assert [m.group(1) for m in _BLOCK.finditer(text)] == ["x = 1\n", "y = 2\n"]
