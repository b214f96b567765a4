"""The lab's optional dependencies: the ``lab`` extra, and one line for users who lack it.

``pip install llm-backoff-shim`` is the proxy alone; the plots of the lab commands need
matplotlib, which only ``pip install 'llm-backoff-shim[lab]'`` brings. Every lab module
imports it inside the function that draws, after :func:`require_plotting`, so the rest of
the package (and a lab command that draws nothing) imports without it.
"""

from __future__ import annotations

import importlib

INSTALL = "pip install 'llm-backoff-shim[lab]'"


class MissingLabExtraError(RuntimeError):
    """A lab feature needs a package of the ``lab`` extra; ``str()`` is one line for users."""


def require_plotting(what: str) -> None:
    """Raise :class:`MissingLabExtraError` naming ``what`` unless matplotlib can be imported."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise MissingLabExtraError(f"{what} needs matplotlib, from the lab extra: {INSTALL}") from exc
