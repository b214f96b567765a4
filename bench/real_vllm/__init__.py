"""A real vLLM (CPU build) for the benchmarks: ``setup.sh`` (venv and model, ``build_model.py``),
:mod:`.engine` (``vllm serve`` pinned to a CPU), :mod:`.mix` (the scoreboard's traces and oracle),
:mod:`.capacity` (the engine with every slot busy), :mod:`.measures` (figures of a load run)."""
