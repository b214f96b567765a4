"""The vLLM-like simulator: an OpenAI/Anthropic-compatible server whose work follows each request.

Stands apart: imports nothing else from the shim, so it can stand in for vLLM in tests, the demo
and rehearsals without the proxy's dependencies.
"""
