"""Lab tools: load generator, calibration and its knee, demo, soak, overload model, reports, plots.

Drives the shim (``llm_backoff_shim.serve``) and the simulator (``llm_backoff_shim.sim``) from
the outside; nothing in the shim or the simulator imports from here.
"""
