"""A real vLLM (CPU build) for the benchmarks: set-up, the server process, and what is measured on it.

``setup.sh`` builds the venv and the model (``build_model.py``); :mod:`.engine` starts
``vllm serve`` pinned to a CPU; :mod:`.mix` draws the scoreboard's traces and plays its oracle;
:mod:`.capacity` measures the engine with every slot busy; :mod:`.measures` has the figures of a
load run that the shared report does not have (idle slot-time, wasted tokens).
"""
