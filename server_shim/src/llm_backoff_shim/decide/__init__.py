"""Pure decisions: admission, serve order, shares, the drain and Retry-After estimate, SLO states, limits.

Nothing here does I/O or imports asyncio; every piece takes a clock (and, where it needs one, a
random source) so it is tested without sleeping. The edge (``llm_backoff_shim.serve``) calls in;
nothing here imports from the edge, the simulator or the lab.
"""
