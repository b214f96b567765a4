"""llm-backoff-shim: an admission-controlled OpenAI-compatible proxy for vLLM."""

__version__ = "0.1.0"
