"""docs/reference.md shows the settings and the route table exactly as the code defines them.

The tables are rendered by ``scripts/docs_reference.py`` from ``ShimSettings``, the groups
of ``--help-all`` and the route table; after a change there, run that script.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_matches_the_code() -> None:
    renderer = _renderer()
    current = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    out_of_date = "docs/reference.md is out of date: run scripts/docs_reference.py"
    assert renderer.render(current) == current, out_of_date


def test_every_setting_is_in_the_reference() -> None:
    from llm_backoff_shim.serve.config.settings import ShimSettings
    from llm_backoff_shim.serve.config.values import flag_name

    text = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    missing = [name for name in ShimSettings.model_fields if f"| `{flag_name(name)}`" not in text]
    assert not missing
