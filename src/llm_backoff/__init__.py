"""llm-backoff: resilient calls to self-hosted LLM endpoints."""

__version__ = "0.1.0"
