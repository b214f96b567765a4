"""The asyncio edge: the ASGI app, the proxy, intake checks, waiting, refusals, filters, metrics, logs.

Builds on the pure decisions in ``llm_backoff_shim.decide`` and the HTTP layer in
``llm_backoff_shim.http``; never imports the simulator or the lab.
"""
