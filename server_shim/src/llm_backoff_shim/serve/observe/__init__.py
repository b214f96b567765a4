"""What the shim tells its operator: Prometheus metrics (``metrics.py``, with the per-request
counters of ``event_counts.py``) and the access log (``access_log.py``)."""
