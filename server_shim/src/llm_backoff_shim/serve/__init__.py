"""The asyncio edge: the ASGI app and its composition root, with one subpackage per concern.

``request_path/`` (one request's way: proxy, intake, waiting, refusals, relay, upstream),
``policy/`` (the filters: hooks, tenant quotas, engine saturation), ``observe/`` (metrics,
access log); the app, the route table and the configuration modules stand here. Builds on
the pure decisions in ``llm_backoff_shim.decide`` and the HTTP layer in
``llm_backoff_shim.http``; never imports the simulator or the lab.
"""
