"""``pip install llm-backoff-shim`` serves without the ``lab`` extra (matplotlib, numpy).

Each run is a child interpreter with a meta-path finder in front that refuses matplotlib
and numpy, as if they were not installed (whatever this venv holds): the whole package
imports, the proxy serves a request through to the simulator, a lab command that needs a
plot says in one line which extra to install and exits 2, and calibrate measures without
it. Beside them, a source check: nothing outside ``lab/`` names either library, and
``lab/`` imports them only inside the functions that draw.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

import pytest
from packaging.requirements import Requirement

from llm_backoff_shim.serve.serving import ServerThread
from llm_backoff_shim.sim.server import SimConfig, create_sim_app

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "llm_backoff_shim"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
EXTRA_ONLY = ("matplotlib", "numpy")
INSTALL_HINT = "pip install 'llm-backoff-shim[lab]'"

BLOCK = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = ("matplotlib", "numpy")


    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], "imported before the block"
    sys.meta_path.insert(0, Block())


    def loaded_extra():
        return sorted({m.split(".")[0] for m in sys.modules} & set(BLOCKED))
    """
)


def run_blocked(code: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    script = BLOCK + "\n" + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout
    )


def requirement_names(requirements: list[str]) -> set[str]:
    return {Requirement(text).name for text in requirements}


def test_the_distribution_declares_the_plotting_library_only_in_its_lab_extra() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    runtime = requirement_names(project["dependencies"])
    assert "starlette" in runtime  # the names were read
    assert runtime.isdisjoint(EXTRA_ONLY), runtime & set(EXTRA_ONLY)
    assert requirement_names(project["optional-dependencies"]["lab"]) == {"matplotlib"}


def test_the_block_works() -> None:
    # Without this the other runs could pass with the libraries quietly imported.
    done = run_blocked("import matplotlib")
    assert done.returncode == 1
    assert "ModuleNotFoundError: No module named 'matplotlib'" in done.stderr


def test_every_module_of_the_package_imports_without_the_extra() -> None:
    done = run_blocked(
        """
        import importlib
        import pkgutil

        import llm_backoff_shim

        names = [m.name for m in pkgutil.walk_packages(llm_backoff_shim.__path__, "llm_backoff_shim.")]
        for name in names:
            importlib.import_module(name)
        print(len(names), loaded_extra())
        """
    )
    assert done.returncode == 0, done.stderr
    count, loaded = done.stdout.split(maxsplit=1)
    assert int(count) > 40
    assert loaded.strip() == "[]"


def test_the_proxy_serves_without_the_extra() -> None:
    done = run_blocked(
        """
        import json

        import httpx
        from pydantic import AnyHttpUrl

        import llm_backoff_shim.serve.command
        from llm_backoff_shim.serve.app import create_app
        from llm_backoff_shim.serve.config.settings import ShimSettings
        from llm_backoff_shim.serve.serving import ServerThread, shim_server
        from llm_backoff_shim.sim.server import SimConfig, create_sim_app

        with ServerThread(create_sim_app(SimConfig(ttft=0.01, itl=0.001, output_tokens=4))) as sim:
            app = create_app(ShimSettings(upstream=AnyHttpUrl(sim.url), max_concurrency=2))
            with shim_server(app) as shim:
                reply = httpx.post(
                    shim.url + "/v1/chat/completions",
                    json={"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                    timeout=30,
                )
        print(json.dumps({"status": reply.status_code, "body": reply.json(), "loaded": loaded_extra()}))
        """
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["status"] == 200
    assert result["body"]["choices"][0]["message"]["content"] == "token0 token1 token2 token3"
    assert result["loaded"] == []


def test_the_demo_without_the_extra_says_which_extra_in_one_line(tmp_path: Path) -> None:
    done = run_blocked(
        """
        import sys

        from llm_backoff_shim import cli

        sys.exit(cli.main(["demo", "--quick", "--out", sys.argv[1]]))
        """,
        str(tmp_path),
    )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("llm-backoff-shim demo: ")
    assert INSTALL_HINT in lines[0]
    assert "matplotlib" in lines[0]
    assert list(tmp_path.iterdir()) == []  # stopped before starting anything


def test_the_demo_help_needs_no_extra() -> None:
    done = run_blocked("from llm_backoff_shim import cli\ncli.main(['demo', '--help'])")
    assert done.returncode == 0, done.stderr
    assert "usage: llm-backoff-shim demo" in done.stdout


def test_calibrate_without_the_extra_measures_and_skips_only_the_png(tmp_path: Path) -> None:
    sim = ServerThread(
        create_sim_app(SimConfig(max_num_seqs=4, ttft=0.02, itl=0.002, output_tokens=8, seed=1))
    )
    with sim:
        done = run_blocked(
            """
            import sys

            from llm_backoff_shim import cli

            sys.exit(cli.main(["calibrate", "--upstream", sys.argv[1], "--steps", "1,2", "--step-seconds",
                               "0.5", "--repeats", "1", "--out", sys.argv[2], "--json"]))
            """,
            sim.url,
            str(tmp_path),
        )
    assert done.returncode in (0, 1), done.stderr  # 1 only when no level met the SLO
    assert "Traceback" not in done.stderr
    result = json.loads(done.stdout)
    assert [step["concurrency"] for step in result["steps"]] == [1, 2]
    assert result["png"] is None
    notes = [line for line in done.stderr.splitlines() if "not written" in line]
    assert notes == [
        f"llm-backoff-shim calibrate: calibrate.png not written: the plot calibrate.png "
        f"needs matplotlib, from the lab extra: {INSTALL_HINT}"
    ]
    assert not (tmp_path / "calibrate.png").exists()


# -- the source: where the extra's libraries may be imported ------------------------------------


def extra_imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node, name) for name in names if name.split(".")[0] in EXTRA_ONLY]
    return found


def module_level(tree: ast.Module) -> set[ast.AST]:
    """Import statements that run when the module is imported (outside every function)."""
    top: set[ast.AST] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                top.add(child)
            visit(child)

    visit(tree)
    return top


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_only_lab_names_the_extra_and_only_inside_functions(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = extra_imports(tree)
    where = path.relative_to(PACKAGE).as_posix()
    if not where.startswith("lab/"):
        assert found == [], f"{where} imports {[name for _, name in found]}: only lab/ may (the lab extra)"
        return
    top = module_level(tree)
    eager = [f"{name} (line {node.lineno})" for node, name in found if node in top]
    assert eager == [], f"{where} imports {eager} at import time: import it inside the function that draws"


def test_the_source_check_sees_imports() -> None:
    tree = ast.parse("import numpy as np\ndef f():\n    from matplotlib.figure import Figure\n")
    found = extra_imports(tree)
    assert [name for _, name in found] == ["numpy", "matplotlib.figure"]
    assert [name for node, name in found if node in module_level(tree)] == ["numpy"]
