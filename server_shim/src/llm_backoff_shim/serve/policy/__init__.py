"""The per-request and per-engine policies that plug into admission: classes and tenants,
tenant quotas (``quota.py``), the hooks the proxy asks (``request_hooks.py``), the engine's
saturation (``engine_watch.py``) and the filters' lifecycle (``traffic_policy.py``)."""
