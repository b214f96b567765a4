"""The ``--config`` TOML file: read it into settings values, and write one.

Layout: one table per group of ``--help-all`` (:data:`~.flags.GROUPS`), named in
:data:`~.flags.SECTIONS`, whose keys are :class:`ShimSettings` field names
(``[queue]`` then ``max_queue = 20``); per-class values live in one ``[classes.NAME]``
table per class, under the keys of :data:`PER_CLASS_KEYS` (``max_queue``,
``max_queue_wait``, ``reserved_share``, ``min_share``, ``ttft_slo``). The class tables'
order is the classes' order, highest priority first, so ``[classes.*]`` also sets
``classes``. A file with settings as top-level keys (``max_queue = 20``, no group
tables) is read as well; a file may mix both, but sets a setting once. Relative paths
(``tenants_file``, ``api_keys_file``) are taken from the file's own directory.

Reading checks the file's shape (valid TOML, known keys, each in its table, tables where
tables go) and raises :class:`ConfigError` naming the key's path; types and ranges are
checked by the model, and :mod:`.sources` names the path of a value it refuses from
:attr:`FileValues.where`.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_backoff_shim.serve.config.flags import GROUPS, SECTIONS
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.values import PER_CLASS_KEYS, ConfigError, env_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Fields that are not keys of the file: the per-class maps (in ``[classes.NAME]``).
NOT_TOP_LEVEL = frozenset(PER_CLASS_KEYS.values()) | {"classes"}

#: The table of every setting that is not per class: field -> table (``max_queue`` -> ``queue``).
SECTION_OF: dict[str, str] = {
    name: SECTIONS[title] for title, names in GROUPS.items() for name in names if name not in NOT_TOP_LEVEL
}

#: The per-class settings: field -> key in a ``[classes.NAME]`` table.
_CLASS_KEY = {target: key for key, target in PER_CLASS_KEYS.items()}

#: Fields holding a path, resolved against the file's directory when relative.
_PATH_FIELDS = ("tenants_file", "api_keys_file")


def file_key(name: str) -> str:
    """Where setting ``name`` goes in the file: ``[queue] max_queue``, ``[classes.NAME] max_queue``."""
    if name == "classes":
        return "[classes.NAME]"
    if name in _CLASS_KEY:
        return f"[classes.NAME] {_CLASS_KEY[name]}"
    return f"[{SECTION_OF[name]}] {name}"


@dataclass
class FileValues:
    """What a file sets: field -> value, and (field, class or None) -> its key path."""

    path: str
    values: dict[str, Any] = field(default_factory=dict)
    where: dict[tuple[str, str | None], str] = field(default_factory=dict)


def _fail(path: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {message}")


#: An unknown key without a close match is told the known keys when there are at most this many.
_LISTED = 10


def _unknown(
    path: str, key: str, known: Iterable[str], what: str, *, section: str | None = None
) -> ConfigError:
    """An unknown key, with a hint: where a per-class value goes, or the closest known key.

    ``key`` is the key's dotted path; the suggestion compares its last part
    (``classes.batch.max_queu`` -> ``max_queue``) and, for a key of a group's table
    (``section``), names the closest key's table when it is another. Without a close
    match, a short list of known keys (the per-class ones) is given whole.
    """
    name = key.rpartition(".")[2]
    hint = ""
    # ``batch_max_queue``: one class's value, which goes in that class's table.
    longest_first = sorted(PER_CLASS_KEYS, key=len, reverse=True)
    per_class = next((k for k in longest_first if name.endswith("_" + k)), None)
    a_setting = what == "setting"
    if a_setting and name in _CLASS_KEY:
        hint = f" (set it per class: [classes.NAME] {_CLASS_KEY[name]} = ...)"
    elif a_setting and per_class is not None:
        cls = name.removesuffix("_" + per_class)
        hint = f" (per-class values go in the class's table: [classes.{cls}] {per_class} = ...)"
    else:
        names = list(known)
        close = difflib.get_close_matches(name, names, n=1)
        if close and section is not None and SECTION_OF.get(close[0], section) != section:
            hint = f" (did you mean {close[0]!r}, in [{SECTION_OF[close[0]]}]?)"
        elif close:
            hint = f" (did you mean {close[0]!r}?)"
        elif len(names) <= _LISTED or what == "table":
            hint = f" (one of: {', '.join(names)})"
    return ConfigError(f"{path}: {key}: unknown {what}{hint}")


def read_config_file(path: str | Path) -> FileValues:
    """The values a TOML settings file sets; :class:`ConfigError` if it cannot be one."""
    label = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read the file: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label}: not valid TOML: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: not valid TOML: {exc}{_both_hint(text)}") from None
    out = FileValues(label)
    directory = Path(path).parent
    top_level = [name for name in ShimSettings.model_fields if name not in NOT_TOP_LEVEL]
    tables = list(dict.fromkeys(SECTIONS.values()))
    for key, value in data.items():
        if key == "classes":
            _read_classes(out, value)
        elif key in tables and isinstance(value, dict):
            # A group's table. ``upstream`` is a table and a setting: a table's value is a dict.
            for name, item in value.items():
                where = f"{key}.{name}"
                if name not in SECTION_OF:
                    raise _unknown(label, where, top_level, "setting", section=key)
                if SECTION_OF[name] != key:
                    raise _fail(label, where, f"{name} belongs in [{SECTION_OF[name]}]")
                _set(out, directory, name, item, where)
        elif key in SECTION_OF:
            _set(out, directory, key, value, key)
        elif key in tables:
            raise _fail(label, key, f"expected a table ([{key}] with key = value lines)")
        elif isinstance(value, dict):
            raise _unknown(label, key, [*tables, "classes"], "table")
        else:
            raise _unknown(label, key, [*top_level, "classes"], "setting")
    return out


#: Names that are a setting and a group's table (``upstream``): TOML refuses a file with both.
_BOTH = sorted(set(SECTIONS.values()) & set(SECTION_OF))


def _both_hint(text: str) -> str:
    """Why TOML refused ``upstream = ...`` at the top level next to an ``[upstream]`` table."""
    head = re.split(r"^\s*\[", text, maxsplit=1, flags=re.M)[0]
    for name in _BOTH:
        if re.search(rf"^\s*{name}\s*=", head, re.M) and re.search(rf"^\s*\[\s*{name}\s*\]", text, re.M):
            return f" ({name} is set at the top level and [{name}] is a table: move {name} = ... into it)"
    return ""


def _placed(where: str) -> str:
    table = where.rpartition(".")[0]
    return f"in [{table}]" if table else "at the top level"


def _set(out: FileValues, directory: Path, name: str, value: Any, where: str) -> None:
    """Record setting ``name`` read at key path ``where``; a second time is an error."""
    if (name, None) in out.where:
        first = out.where[(name, None)]
        raise _fail(out.path, where, f"{name} is set twice ({_placed(first)} and {_placed(where)}): keep one")
    if name in _PATH_FIELDS and isinstance(value, str) and not Path(value).is_absolute():
        value = str(directory / value)
    out.values[name] = value
    out.where[(name, None)] = where


def _read_classes(out: FileValues, tables: Any) -> None:
    if not isinstance(tables, dict):
        raise _fail(out.path, "classes", "expected one [classes.NAME] table per class")
    out.values["classes"] = tuple(tables)
    out.where[("classes", None)] = "classes"
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise _fail(
                out.path, f"classes.{name}", "expected a table ([classes.NAME] with key = value lines)"
            )
        for key, value in table.items():
            where = f"classes.{name}.{key}"
            if key not in PER_CLASS_KEYS and key in SECTION_OF:
                raise _fail(out.path, where, f"not a per-class setting: {key} belongs in [{SECTION_OF[key]}]")
            if key not in PER_CLASS_KEYS:
                raise _unknown(out.path, where, PER_CLASS_KEYS, "per-class setting")
            target = PER_CLASS_KEYS[key]
            out.values.setdefault(target, {})[name] = value
            out.where[(target, name)] = where


# --------------------------------------------------------------------------- writing

#: Values shown, commented out, for settings whose default is "none" or empty.
EXAMPLES: dict[str, Any] = {
    "metrics_port": 9090,
    "max_queue": 64,
    "tenants_file": "tenants.toml",
    "tenant_header": "x-tenant-id",
    "tenant_requests_per_minute": 600,
    "tenant_tokens_per_minute": 200000,
    "redis_url": "redis://127.0.0.1:6379/0",
    "api_keys_file": "/etc/llm-backoff-shim/keys",
    "trusted_proxies": ["10.0.0.0/8"],
    "allow_operator_route": ["/sleep", "/wake_up"],
}

#: Per-class examples, by class position (0: the first class), for maps empty by default.
_CLASS_EXAMPLES: dict[str, tuple[Any, ...]] = {"ttft_slo": (2.0, 60.0)}


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (strings in JSON's escapes, which TOML's basic strings share)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def _comment(text: str, width: int = 88) -> list[str]:
    lines: list[str] = []
    line = "#"
    for word in text.split():
        if len(line) + 1 + len(word) > width and line != "#":
            lines.append(line)
            line = "#"
        line += " " + word
    return [*lines, line]


def _entry(name: str, text: str, value: Any, active: bool) -> list[str]:
    lines = _comment(text)
    if value is None:
        lines.append(f"# {name} =")
    else:
        lines.append(f"{'' if active else '# '}{name} = {toml_value(value)}")
    return lines


def render_config(active: Mapping[str, Any], *, header: Iterable[str] = ()) -> str:
    """A settings file listing every setting: those in ``active`` set, the rest commented out.

    ``active`` maps field names to values; each setting is written in its group's table
    (:data:`SECTION_OF`), per-class maps (``class_max_queue`` ...) in the
    ``[classes.NAME]`` tables, one per class of ``active["classes"]`` (default: the
    default classes). A commented-out line shows the default, or an example value where
    the default is none.
    """
    fields = ShimSettings.model_fields
    lines = [part for line in header for part in (_comment(line, 100) if line else ["#"])]
    for title, names in GROUPS.items():
        top_level = [name for name in names if name not in NOT_TOP_LEVEL]
        if top_level:
            lines += ["", f"# ---- {title} ".ljust(88, "-"), f"[{SECTIONS[title]}]"]
        for name in top_level:
            info = fields[name]
            text = f"{info.description} [flag --{name.replace('_', '-')}; env {env_name(name)}]"
            if name in active:
                lines += ["", *_entry(name, text, active[name], True)]
            elif name == "api_key":
                lines += [
                    "",
                    *_comment(text + " -- keep the key out of files: use the variable"),
                    "# api_key =",
                ]
            else:
                default = info.default
                shown = EXAMPLES.get(name) if default is None or default == () else default
                lines += ["", *_entry(name, text, shown, False)]
    classes = tuple(active.get("classes", fields["classes"].default))
    lines += [
        "",
        "# ---- per class ".ljust(88, "-"),
        "",
        *_comment(
            "One table per traffic class, highest priority first (their order is --classes). "
            "A per-class value given for some class replaces that setting's default for every "
            "class; a class without a queue bound or wait uses max_queue / max_queue_wait."
        ),
    ]
    for position, cls in enumerate(classes):
        lines += ["", f"[classes.{cls}]"]
        for key, target in PER_CLASS_KEYS.items():
            text = f"{fields[target].description} [flag --{target.replace('_', '-')} {cls}=...]"
            given = active.get(target)
            class_default: dict[str, Any] = fields[target].default
            if given is not None and cls in given:
                lines += _entry(key, text, given[cls], True)
            elif given is None and cls in class_default:
                lines += _entry(key, text, class_default[cls], False)
            else:
                lines += _entry(key, text, _class_example(key, target, cls, position), False)
    return "\n".join(lines).lstrip("\n") + "\n"


def _class_example(key: str, target: str, cls: str, position: int) -> Any:
    fields = ShimSettings.model_fields
    if key in ("max_queue", "max_queue_wait"):
        default = fields[key].default
        return EXAMPLES[key] if default is None else default
    if target in _CLASS_EXAMPLES:
        examples = _CLASS_EXAMPLES[target]
        return examples[min(position, len(examples) - 1)]
    return 0.0


def write_config(path: str | Path, active: Mapping[str, Any], *, header: Iterable[str] = ()) -> None:
    """Write :func:`render_config` to ``path`` (UTF-8)."""
    Path(path).write_text(render_config(active, header=header), encoding="utf-8")


#: The settings :func:`example_config` writes set (at their defaults); the rest are commented out.
EXAMPLE_ACTIVE = (
    "upstream",
    "host",
    "port",
    "max_concurrency",
    "max_queue_wait",
    "reject_status",
    "classes",
    "reserved_share",
    "min_share",
)


def example_config() -> str:
    """``server_shim/deploy/shim.toml``: every setting, the common ones set to their defaults."""
    fields = ShimSettings.model_fields
    active = {name: fields[name].default for name in EXAMPLE_ACTIVE}
    active["upstream"] = str(active["upstream"]).rstrip("/")
    return render_config(
        active,
        header=(
            "llm-backoff-shim serve --config shim.toml",
            "",
            "Every setting of the shim, at its default. Lines starting with '# key =' are settings",
            "left at their default (or an example where the default is none): uncomment to set.",
            "Each setting sits in its group's table ([upstream], [queue], ...), per-class values in",
            "[classes.NAME]; a file of top-level keys only (max_queue = 20) is read too.",
            "Flags and LLM_BACKOFF_SHIM_* variables win over this file (flag > env > file > default).",
            "Regenerate: python -m llm_backoff_shim.serve.config.file > server_shim/deploy/shim.toml",
        ),
    )


if __name__ == "__main__":
    sys.stdout.write(example_config())
