"""``llm-backoff-shim``: a thin dispatcher to one module per subcommand.

Each subcommand module exposes ``main(argv: list[str]) -> int`` and is imported only
when asked for, so ``llm-backoff-shim sim`` does not pay for the proxy's imports and a
missing optional module breaks only its own subcommand.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Sequence

#: The distribution whose version ``--version`` prints.
DISTRIBUTION = "llm-backoff-shim"

#: subcommand -> (module, one-line summary)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("llm_backoff_shim.serve.command", "run the admission-controlled proxy in front of vLLM"),
    "sim": ("llm_backoff_shim.sim.server", "run the vLLM-like simulator (tests, demo, rehearsals)"),
    "demo": ("llm_backoff_shim.lab.demo", "run the overload demo on the simulator"),
    "calibrate": ("llm_backoff_shim.lab.calibrate", "measure an upstream and suggest shim settings"),
    "fleet": ("llm_backoff_shim.lab.fleet", "run shims behind a real nginx or HAProxy on loopback"),
}


def usage() -> str:
    lines = [
        "usage: llm-backoff-shim {" + ",".join(SUBCOMMANDS) + "} [options]",
        "       llm-backoff-shim --version",
        "",
        "subcommands:",
    ]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "`llm-backoff-shim <subcommand> --help` explains each subcommand's flags."]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version (``llm-backoff-shim --version``)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"{DISTRIBUTION} {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"llm-backoff-shim: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"llm-backoff-shim: subcommand {name!r} is not available in this version", file=sys.stderr)
        return 2
    entry: Callable[[list[str]], int] = module.main
    return entry(rest)


if __name__ == "__main__":
    sys.exit(main())
