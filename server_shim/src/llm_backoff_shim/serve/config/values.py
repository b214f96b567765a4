"""The names and value syntax of the shim's settings, shared by the model and its sources.

A setting ``max_queue`` is the flag ``--max-queue``, the variable
``LLM_BACKOFF_SHIM_MAX_QUEUE`` and the key ``max_queue`` of the file (in its group's
table, ``[queue]``). Per-class settings are maps from class name to value:
``NAME=value,...`` (or a JSON object) on the command line and in the environment, one
``[classes.NAME]`` table per class in the file, under the keys of :data:`PER_CLASS_KEYS`.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator

ENV_PREFIX = "LLM_BACKOFF_SHIM_"

#: The traffic classes the shim knows, highest priority first.
DEFAULT_CLASSES: tuple[str, ...] = ("interactive", "batch")

#: The per-class settings: key in a ``[classes.NAME]`` table -> the map field holding it.
PER_CLASS_KEYS: dict[str, str] = {
    "max_queue": "class_max_queue",
    "max_queue_wait": "class_max_queue_wait",
    "reserved_share": "reserved_share",
    "min_share": "min_share",
    "ttft_slo": "ttft_slo",
}


class ConfigError(ValueError):
    """Settings that cannot start a shim; ``str()`` is a one-line, user-facing message."""


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _share(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError("a share is a fraction between 0 and 1")
    return value


def _budget(value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError("a budget is a positive number of seconds")
    return value


def not_bool(value: Any) -> Any:
    """Refuse a boolean where a number is expected.

    pydantic's lax mode reads ``true`` as 1, so ``max_concurrency = true`` in a file would
    start a shim with one slot; a boolean there is a mistake, and the user is told so.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


def only_bool(value: Any) -> Any:
    """Refuse a number where a boolean is expected (lax mode reads 1 and 0 as true and false).

    Strings pass: flags and variables say ``true``, ``false``, ``1``, ``0``, ``yes``, ``no``.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(f"expected true or false, got the number {value!r}")
    return value


#: A number that is not a boolean (for the values of per-class maps).
NotBool = BeforeValidator(not_bool)

#: One class's share of the slots (checked per entry, so an error names the class).
Share = Annotated[float, NotBool, AfterValidator(_share)]
#: One class's time budget in seconds.
Budget = Annotated[float, NotBool, AfterValidator(_budget)]


def scalar_kind(annotation: Any) -> Literal["number", "boolean"] | None:
    """``"number"`` for an int or float field (optional or not), ``"boolean"`` for a bool field."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    kinds = {arg for arg in args if arg is not type(None)}
    if kinds == {bool}:
        return "boolean"
    if kinds and kinds <= {int, float}:
        return "number"
    return None


_CLASS_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


def split_list(value: Any, *, lower: bool = False) -> Any:
    """``"a, b"`` -> ``["a", "b"]``; anything but a string is returned as it is."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
        if lower:
            value = [part.lower() for part in value]
    return value


def check_class_names(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise ValueError("at least one class is needed")
    for name in value:
        if not _CLASS_NAME.fullmatch(name):
            raise ValueError(f"class name {name!r}: use lowercase letters, digits, '-' and '_'")
    if len(set(value)) != len(value):
        raise ValueError("class names must be unique")
    return value


def check_networks(value: tuple[str, ...]) -> tuple[str, ...]:
    for item in value:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ValueError(f"{item!r} is not an IP address or network") from None
    return value


def parse_class_map(text: str) -> dict[str, str]:
    """``"interactive=2, batch=60"`` -> ``{"interactive": "2", "batch": "60"}`` (pydantic converts values).

    A JSON object is accepted too (convenient in environment files).
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not a JSON object: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        return {str(k).strip().lower(): v for k, v in data.items()}
    result: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{item!r}: expected class=value pairs separated by commas")
        result[name.strip().lower()] = value.strip()
    return result


@dataclass(frozen=True)
class ClassLimits:
    """One class's queue bound (None: what the engine drains within the wait) and queue wait (seconds)."""

    max_queue: int | None
    max_queue_wait: float
