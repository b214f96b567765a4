"""The asyncio edge: the ASGI app and its composition root, with one subpackage per concern.

``request_path/`` (one request's way: proxy, intake, admission gate, waiting, relay,
upstream), ``policy/`` (the filters: hooks, tenant quotas, the engine watch), ``observe/``
(metrics, access log), ``api/`` (what clients see: routes, API keys, refusals) and
``config/`` (the settings); the app and its serving stand here. Builds on
the pure decisions in ``llm_backoff_shim.decide`` and the HTTP layer in
``llm_backoff_shim.http``; never imports the simulator or the lab.
"""
