"""Render the generated parts of docs/reference.md from the code, or check them.

Two tables are generated, each between its pair of HTML comment markers:

- ``settings``: every setting of ``llm-backoff-shim serve``, in the groups of
  ``--help-all`` (``serve/config/flags.py``), with its flag, variable, table and key in
  the ``--config`` file (``serve/config/file.py``), default and the
  description its field carries in ``ShimSettings`` (the one definition that ``--help``,
  ``--help-all`` and ``server_shim/deploy/shim.toml`` print too);
- ``routes``: the route table of ``serve/api/routes.py``.

    .venv/bin/python scripts/docs_reference.py           # rewrite docs/reference.md
    .venv/bin/python scripts/docs_reference.py --check   # exit 1 if it differs (the test does this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from llm_backoff_shim.serve.api.routes import render_markdown
from llm_backoff_shim.serve.config.file import file_key
from llm_backoff_shim.serve.config.flags import GROUPS, REPEATABLE, _shown_default
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.values import env_name, flag_name

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _file_key(name: str) -> str:
    """The setting's table and key in the file, as the file's reader and writer place it."""
    if name == "classes":
        return f"`{file_key(name)}` tables, in order"
    return f"`{file_key(name)}`"


def settings_markdown() -> str:
    """One table per group of ``--help-all``: flag, variable, file table and key, default, meaning."""
    parts: list[str] = []
    for title, names in GROUPS.items():
        parts.append(f"### {title[0].upper()}{title[1:]}\n")
        parts.append("| flag | variable | file key | default | meaning |")
        parts.append("| --- | --- | --- | --- | --- |")
        for name in names:
            field = ShimSettings.model_fields[name]
            flag = f"`{flag_name(name)}`" + (" (repeatable)" if name in REPEATABLE else "")
            # Booleans as the file and the variables spell them.
            value = field.default
            default = str(value).lower() if isinstance(value, bool) else _shown_default(value)
            parts.append(
                f"| {flag} | `{env_name(name)}` | {_file_key(name)} | `{_cell(default)}` "
                f"| {_cell(field.description or '')} |"
            )
        parts.append("")
    return "\n".join(parts).rstrip("\n") + "\n"


def routes_markdown() -> str:
    return render_markdown().rstrip("\n") + "\n"


GENERATED = {"settings": settings_markdown, "routes": routes_markdown}


def _region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{name}:begin[^>]*-->\n)(.*?)(<!-- generated:{name}:end -->)", re.S)


def render(text: str) -> str:
    """``text`` with every generated region replaced by what the code renders now."""
    for name, make in GENERATED.items():
        pattern = _region(name)
        if pattern.search(text) is None:
            raise SystemExit(f"{REFERENCE}: no '<!-- generated:{name}:begin' ... end marker pair")
        body = make()
        text = pattern.sub(lambda m, body=body: m.group(1) + "\n" + body + "\n" + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md is out of date")
    args = parser.parse_args(argv)
    current = REFERENCE.read_text(encoding="utf-8")
    wanted = render(current)
    if args.check:
        if wanted != current:
            print(f"{REFERENCE} is out of date: run scripts/docs_reference.py", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        REFERENCE.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
