"""Lab tools: load generator, calibrate, demo, soak, fleet, reports, plots.

Drives the shim (``llm_backoff_shim.serve``) and the simulator (``llm_backoff_shim.sim``) from
the outside; nothing in the shim or the simulator imports from here. The plots need the
``lab`` extra (``pip install 'llm-backoff-shim[lab]'``, :mod:`llm_backoff_shim.lab.extra`);
everything else here runs on the shim's own dependencies.
"""
