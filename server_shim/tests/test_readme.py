"""The README's examples run as written, and every relative link in the docs resolves.

- "The SDK in one screen": the python block runs against the simulator and a shim
  started in-process, with only the port 8080 replaced by the shim's real one.
- "The shim in one screen": the shell block's commands run as subprocesses (ports
  8000/8080 replaced by free ones); the curl lines must get a chat completion and the
  ``llm_backoff_shim_requests_total`` lines.
- ``python examples/quickstart.py`` (and docs/sdk.md's tenacity example) exits 0; every
  example command in the README uses ``.venv/bin/python`` and runs as written.
- Relative links in README.md and docs/*.md point to files that exist.

Waits are polls bounded only so that a broken test ends; no latency is asserted.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.lab import procs
from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig

#: conftest's ``sim_and_shim_servers``.
SimAndShim = Callable[[SimConfig], contextlib.AbstractContextManager[tuple[ServerThread, ServerThread]]]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: Bounds a broken start-up only: on a loaded 2-core machine `serve` takes seconds to import.
STARTUP_LIMIT = 60.0
COMMAND_LIMIT = 30.0


def section(markdown: str, title: str) -> str:
    """The text of the ``## title`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    if match is None:
        raise AssertionError(f"README.md has no section '## {title}'")
    return match.group(1)


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{re.escape(language)}[ \t]*\n(.*?)^```", text, re.M | re.S)


def first_block(title: str, language: str) -> str:
    blocks = fenced_blocks(section(README.read_text(encoding="utf-8"), title), language)
    assert blocks, f"README.md section '{title}' has no ```{language} block"
    return blocks[0]


def shell_commands(block: str) -> list[str]:
    """Commands of a shell block: comments dropped, backslash continuations joined."""
    commands: list[str] = []
    pending = ""
    for line in block.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        commands.append(pending + stripped)
        pending = ""
    assert not pending, "shell block ends in a continuation line"
    return commands


def free_port() -> int:
    return procs.free_port()


def with_ports(text: str, ports: dict[str, int]) -> str:
    for old, new in ports.items():
        text = re.sub(rf"\b{old}\b", str(new), text)
    return text


def requests_total(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """``llm_backoff_shim_requests_total`` samples as {(class, outcome, code): value}."""
    found: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "llm_backoff_shim_requests_total":
                labels = sample.labels
                found[(labels["class"], labels["outcome"], labels["code"])] = sample.value
    return found


# -- "The SDK in one screen" ---------------------------------------------------------------


@pytest.fixture
def sim_and_shim(sim_and_shim_servers: SimAndShim) -> Iterator[tuple[ServerThread, ServerThread]]:
    with sim_and_shim_servers(SimConfig(ttft=0.01, itl=0.002, output_tokens=40, seed=1)) as pair:
        yield pair


def test_sdk_block_runs_against_the_shim(sim_and_shim: tuple[ServerThread, ServerThread]) -> None:
    _, shim = sim_and_shim
    block = first_block("The SDK in one screen", "python")
    assert "127.0.0.1:8080" in block, "the block no longer targets the shim's documented port"
    code = with_ports(block, {"8080": shim.port})
    namespace: dict[str, Any] = {"__name__": "readme_sdk_block"}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md:The SDK in one screen", "exec"), namespace)
    finally:
        client = namespace.get("client")
        if client is not None:
            client.close()
    words = printed.getvalue().split()
    # The simulator answers filler tokens; max_tokens=16 in the block cuts the answer there.
    assert words == [f"token{i}" for i in range(16)]
    counts = requests_total(httpx.get(shim.url + "/metrics", timeout=10).text)
    assert counts[("interactive", "completed", "")] == 1.0  # went through the shim, class sent


# -- "The shim in one screen" --------------------------------------------------------------


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        # Each child leads its own process group (start_new_session): end that group only.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_LIMIT
    while True:
        if process.poll() is not None:
            raise AssertionError(
                f"{url}: process exited with {process.returncode}:\n{log.read_text(errors='replace')}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{url} not healthy in {STARTUP_LIMIT} s:\n{log.read_text(errors='replace')}"
            )
        time.sleep(0.1)


def test_shim_block_runs_as_written(tmp_path: Path) -> None:
    block = first_block("The shim in one screen", "bash")
    commands = shell_commands(block)
    servers = [c for c in commands if re.search(r"llm-backoff-shim (sim|serve)\b", c)]
    clients = [c for c in commands if c.startswith("curl ")]
    assert len(servers) == 2, commands
    assert len(clients) == 2, commands
    assert len(commands) == 4, commands
    executable = servers[0].split()[0]
    if not (ROOT / executable).exists():
        pytest.skip(f"{executable} is not installed here (the README assumes scripts/setup-venv.sh ran)")
    ports = {"8000": free_port(), "8080": free_port()}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for index, command in enumerate(servers):
            log = tmp_path / f"server{index}.log"
            with log.open("wb") as out:
                processes.append(
                    subprocess.Popen(
                        ["bash", "-c", "exec " + with_ports(command, ports)],
                        cwd=ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        for (port, process), index in zip(zip(ports.values(), processes, strict=True), range(2), strict=True):
            _wait_healthy(f"http://127.0.0.1:{port}", process, tmp_path / f"server{index}.log")
        outputs = [
            subprocess.run(
                ["bash", "-c", with_ports(command, ports)],
                cwd=ROOT,
                capture_output=True,
                timeout=COMMAND_LIMIT,
                check=True,
            ).stdout.decode()
            for command in clients
        ]
    finally:
        for process in reversed(processes):
            _stop(process)
    completion = json.loads(outputs[0])
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"]
    lines = outputs[1].splitlines()
    assert lines, outputs[1]
    assert all(line.startswith("llm_backoff_shim_requests_total{") for line in lines), outputs[1]
    assert requests_total(outputs[1])[("interactive", "completed", "")] == 1.0


# -- examples/*.py (quickstart, interactive_and_batch: README; tenacity_retry: docs/sdk.md) ------

#: What an example prints when it did what its docstring says.
EXAMPLE_OUTPUT = {"examples/quickstart.py": "answer: Hello!", "examples/tenacity_retry.py": "answer: Hello!"}


@pytest.mark.parametrize("example", ["examples/tenacity_retry.py"])
def test_example_exits_zero(example: str) -> None:
    """The examples the README's commands do not run (those run in the test below)."""
    result = subprocess.run(
        [sys.executable, example],
        cwd=ROOT,
        capture_output=True,
        timeout=COMMAND_LIMIT,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert EXAMPLE_OUTPUT[example] in result.stdout.decode()


#: A command running an example, in a code span of the README (it may wrap onto a second line).
_EXAMPLE_COMMAND = re.compile(r"`([^`]*?\bpython\s+(examples/[\w./-]+\.py))`")


def readme_example_commands() -> list[tuple[str, str]]:
    """(command, example path) of every example the README tells readers to run."""
    text = README.read_text(encoding="utf-8")
    return [(" ".join(command.split()), path) for command, path in _EXAMPLE_COMMAND.findall(text)]


def test_the_readme_runs_every_example_with_the_venvs_python() -> None:
    # A bare `python` is the system's, without openai or llm_backoff: the command would fail.
    commands = readme_example_commands()
    assert {path for _, path in commands} >= {"examples/quickstart.py", "examples/interactive_and_batch.py"}
    for command, path in commands:
        assert command == f".venv/bin/python {path}", command
        assert (ROOT / path).is_file(), path


@pytest.mark.parametrize("command", sorted({c for c, _ in readme_example_commands()}))
def test_the_readmes_example_commands_run_as_written(command: str) -> None:
    interpreter = command.split()[0]
    if not (ROOT / interpreter).exists():
        pytest.skip(f"{interpreter} is not installed here (the README assumes scripts/setup-venv.sh ran)")
    result = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, timeout=COMMAND_LIMIT)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    expected = EXAMPLE_OUTPUT.get(command.split()[-1])
    assert expected is None or expected in result.stdout.decode()


# -- relative links --------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def relative_links(markdown: str) -> list[str]:
    """Link targets outside code, without URLs with a scheme and without pure #anchors."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def _markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("document", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(document: Path) -> None:
    missing = []
    for target in relative_links(document.read_text(encoding="utf-8")):
        resolved = (document.parent / target).resolve()
        if not resolved.is_relative_to(ROOT):
            # Outside the repository (../shared/DESIGN.md): not part of a clone, not checkable.
            continue
        if not resolved.exists():
            missing.append(target)
    assert not missing, f"{document.relative_to(ROOT)} links to missing files: {missing}"


def test_link_finder_sees_links_and_skips_code() -> None:
    text = (
        '[a](docs/x.md) ![img](img/p.png "t") [web](https://e.org) [here](#top) '
        "[sec](deploy.md#4-metrics)\n`[not](code.md)`\n```\n[nor](block.md)\n```\n"
    )
    assert relative_links(text) == ["docs/x.md", "img/p.png", "deploy.md"]
