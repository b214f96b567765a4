"""The per-request and per-engine policies that plug into admission: classes and tenants,
tenant quotas (``quota.py``), the hooks the request path asks (``request_hooks.py``), the
fleet's hints (``fleet_hints.py``) and its count of callers' attempts
(``fleet_attempts.py``), the engine watch (``engine_watch.py``, which feeds
``decide/saturation.py``) and the filters' lifecycle (``traffic_policy.py``)."""
