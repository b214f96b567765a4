"""Settings from their three sources: flag > environment > ``--config`` file > default.

A setting takes the value of the highest source that gives it. A per-class setting
(:data:`PER_CLASS_KEYS`) is merged class by class: ``--class-max-queue batch=64`` over
a file's ``[classes.interactive] max_queue = 8`` keeps both entries. The built-in
default of a per-class setting applies only when no source names any class for it.

All values reach the model together, so cross-field checks see the final values, and a
refused value is reported with where it came from: ``--max-queue=-1: ...``,
``LLM_BACKOFF_SHIM_MAX_QUEUE=lots: ...`` or ``shim.toml: classes.batch.max_queue: ...``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import ValidationError

from llm_backoff_shim.serve.config.file import FileValues, read_config_file
from llm_backoff_shim.serve.config.flags import PROG, REPEATABLE, build_parser
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.values import (
    ENV_PREFIX,
    PER_CLASS_KEYS,
    ConfigError,
    env_name,
    flag_name,
    parse_class_map,
)

Kind = Literal["flag", "env", "file"]
#: (field, class or None) -> (source kind, how to name it in a message).
Origins = dict[tuple[str, str | None], tuple[Kind, str]]

_MAPS = frozenset(PER_CLASS_KEYS.values())


def load_settings(argv: Sequence[str], *, prog: str = PROG) -> ShimSettings:
    """Parse flags, read the environment and the ``--config`` file, merge, validate.

    Raises :class:`ConfigError` with a one-line message on a bad value or file;
    argparse itself exits (status 2) on unknown flags and prints ``--help``.
    """
    given = vars(build_parser(prog).parse_args(list(argv)))
    path = given.pop("config", None)
    if path is None:
        path = environment_file(os.environ)
    flags = {key: value for key, value in given.items() if value is not None}
    for name in REPEATABLE.intersection(flags):
        flags[name] = ",".join(flags[name])
    try:
        file = read_config_file(path) if path is not None else FileValues("")
        return settings_from(flags, environment_values(os.environ), file)
    except ConfigError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None


#: The variable naming the settings file when ``--config`` is not given.
CONFIG_ENV = ENV_PREFIX + "CONFIG"


def environment_file(environ: Mapping[str, str]) -> str | None:
    """``LLM_BACKOFF_SHIM_CONFIG`` (any case), or None; an empty value means no file."""
    for key, value in environ.items():
        if key.upper() == CONFIG_ENV:
            return value or None
    return None


def environment_values(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``LLM_BACKOFF_SHIM_*`` variables naming a setting (case-insensitive, as pydantic-settings)."""
    by_name = {key.upper(): value for key, value in environ.items() if key.upper().startswith(ENV_PREFIX)}
    return {name: by_name[env_name(name)] for name in ShimSettings.model_fields if env_name(name) in by_name}


def settings_from(flags: Mapping[str, str], env: Mapping[str, str], file: FileValues) -> ShimSettings:
    """Validated settings from the three sources' values (strings from flags and environment)."""
    merged: dict[str, Any] = {}
    origins: Origins = {}
    file_origins: Origins = {key: ("file", f"{file.path}: {where}") for key, where in file.where.items()}
    _layer(merged, origins, file.values, file_origins)
    _layer(merged, origins, *_strings(env, "env"))
    _layer(merged, origins, *_strings(flags, "flag"))
    _check_file_classes(merged, origins, file)
    _default_entries_of_the_classes(merged)
    try:
        return ShimSettings(**merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, origins)) from None


def _strings(values: Mapping[str, str], kind: Kind) -> tuple[dict[str, Any], Origins]:
    """Flag or variable strings as layer values, the per-class maps parsed."""
    out: dict[str, Any] = {}
    origins: Origins = {}

    def label(name: str) -> str:
        return flag_name(name) if kind == "flag" else env_name(name)

    for name, text in values.items():
        if name in _MAPS:
            try:
                entries = parse_class_map(text)
            except ValueError as exc:
                raise ConfigError(f"{label(name)}={text}: {exc}") from None
            out[name] = {**out.get(name, {}), **entries}
            origins[(name, None)] = (kind, label(name))
            origins.update({(name, cls): (kind, f"{label(name)} {cls}") for cls in entries})
        else:
            out[name] = text
            origins[(name, None)] = (kind, label(name))
    return out, origins


def _layer(merged: dict[str, Any], origins: Origins, values: Mapping[str, Any], where: Origins) -> None:
    for name, value in values.items():
        if name in _MAPS:
            merged[name] = {**merged.get(name, {}), **value}
            entries = [where[(name, cls)] for cls in value if (name, cls) in where]
            origins.update({(name, cls): where[(name, cls)] for cls in value if (name, cls) in where})
            origins[(name, None)] = where.get((name, None)) or entries[0]
        else:
            merged[name] = value
            origins[(name, None)] = where[(name, None)]


def _class_names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [part.strip().lower() for part in value.split(",") if part.strip()]
    return [str(name) for name in value]


def _default_entries_of_the_classes(merged: dict[str, Any]) -> None:
    """A per-class default no source replaced keeps only the entries of classes that exist.

    ``reserved_share``'s default names ``interactive``: with other classes it has no
    meaning, and an error about a value nobody wrote would not help.
    """
    if "classes" not in merged:
        return
    names = set(_class_names(merged["classes"]))
    for name in _MAPS.difference(merged):
        default: dict[str, Any] = ShimSettings.model_fields[name].default
        if not names.issuperset(default):
            merged[name] = {cls: value for cls, value in default.items() if cls in names}


def _check_file_classes(merged: dict[str, Any], origins: Origins, file: FileValues) -> None:
    """A file's ``[classes.NAME]`` must be a class when a flag or variable sets the classes."""
    if "classes" not in file.values or origins[("classes", None)][0] == "file":
        return
    names = _class_names(merged["classes"])
    for cls in file.values["classes"]:
        if cls not in names:
            raise ConfigError(
                f"{file.path}: classes.{cls}: not one of the classes {names} "
                f"(set by {origins[('classes', None)][1]})"
            )


def _describe(exc: ValidationError, origins: Origins) -> str:
    problems = []
    for error in exc.errors(include_url=False):
        loc = [str(part) for part in error["loc"]]
        message = str(error["msg"]).removeprefix("Value error, ")
        if not loc or loc[0] not in ShimSettings.model_fields:
            problems.append(message)
            continue
        name = loc[0]
        cls = loc[1] if name in _MAPS and len(loc) > 1 else None
        kind, label = origins.get((name, cls)) or origins.get((name, None)) or ("env", env_name(name))
        if kind == "file":
            problems.append(f"{label}: {message}")
        else:
            problems.append(f"{label}={error.get('input')!s}: {message}")
    return "; ".join(problems)
