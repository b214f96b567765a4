"""A real vLLM (CPU build) for the benchmarks: set-up, the server process, and what is measured on it.

``setup.sh`` builds the venv and the model (``build_model.py``); :mod:`.engine` starts
``vllm serve`` pinned to a CPU; :mod:`.measures` turns a load run into the figures of
``bench/bench_vllm.py`` that the shared report does not have (idle slot-time, wasted tokens).
"""
