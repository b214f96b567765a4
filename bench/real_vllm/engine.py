"""``vllm serve`` as a child process, pinned to one CPU, set up first when it is missing.

On 2 cores: the engine (API server and engine core inherit the pinning) on one core with one
OpenMP thread, everything else on the other. ``--kv-cache-memory-bytes`` is explicit: the CPU
backend otherwise reserves a share of the node's memory and refuses to start when others hold more.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from _harness import pin_prefix
from llm_backoff_shim.lab.procs import ChildServer

HERE = Path(__file__).resolve().parent
SETUP = HERE / "setup.sh"
DEFAULT_ENV = Path(os.environ.get("LLM_BACKOFF_VLLM_ENV", "/work/vllm-env"))
DEFAULT_MODEL = Path(os.environ.get("LLM_BACKOFF_VLLM_MODEL", "/work/vllm-model"))
KV_CACHE_BYTES = 512 * 1024 * 1024  # 4 KiB per token for this model: ~130k tokens, far more than 8 slots use
START_TIMEOUT = 240.0  # ~25 s on an idle machine; a loaded one is slower

#: Flags for the engine of the benchmark; ``extra`` in :func:`vllm_server` adds to them.
BASE_FLAGS = (
    "--distributed-executor-backend",
    "uni",
    "--enforce-eager",
    "--dtype",
    "bfloat16",
    "--kv-cache-memory-bytes",
    str(KV_CACHE_BYTES),
    "--disable-uvicorn-access-log",
)


def ready(env: Path, model: Path) -> bool:
    return (
        (env / "bin" / "vllm").exists()
        and (model / "config.json").exists()
        and (model / "tokenizer.json").exists()
    )


def ensure_setup(env: Path = DEFAULT_ENV, model: Path = DEFAULT_MODEL) -> None:
    """Run ``setup.sh`` unless the venv and the model are both there (it is idempotent anyway)."""
    if ready(env, model):
        return
    print(f"setting up vLLM in {env} and the model in {model} (a few minutes, once)", flush=True)
    subprocess.run(["bash", str(SETUP), str(env), str(model)], check=True)


def vllm_server(*, slots: int, cpu: int | None, extra: Sequence[str] = ()) -> ChildServer:
    """A ``vllm serve`` child (start it with ``with``) pinned to ``cpu``: ``slots`` is ``--max-num-seqs``."""
    vllm = str(DEFAULT_ENV / "bin" / "vllm")

    def command(port: int) -> list[str]:
        serve = [vllm, "serve", str(DEFAULT_MODEL), "--host", "127.0.0.1", "--port", str(port)]
        return [*pin_prefix(cpu), *serve, "--max-num-seqs", str(slots), *BASE_FLAGS, *extra]

    return ChildServer(
        "vllm",
        command,
        start_timeout=START_TIMEOUT,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"},
    )
