"""Price a request in LLM tokens before sending, and read what it really cost after.

No tokenizer: downloading one (tiktoken's BPE files, a Hugging Face tokenizer)
needs the network and is model-specific, while a limiter only needs a
conservative figure that the response's ``usage`` then corrects. The heuristic:

- prompt: ``ceil(characters / 4)`` over every string in the request JSON that is
  sent to the model (message contents, ``prompt``, ``input``, ``instructions``,
  tool/function definitions, response schemas...), ``4`` tokens of framing per chat
  message plus ``3`` for the reply (OpenAI's cookbook figures), each token id of a
  pre-tokenised prompt as one token, and a flat :data:`MEDIA_TOKENS` per image or
  audio part (data URLs are never counted by length: a base64 image is not text);
- completion: ``max_completion_tokens``, else ``max_tokens``, else
  ``max_output_tokens`` (Responses API), else the limiter's ``default_max_tokens``,
  times ``n``. Embeddings requests generate nothing.

English text runs about 4 characters per token for GPT-style BPE vocabularies;
code and non-Latin scripts run denser, which the completion allowance (usually the
larger part) and the after-the-fact correction absorb.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4
REPLY_PRIMING_TOKENS = 3
MEDIA_TOKENS = 765
DEFAULT_MAX_TOKENS = 1024

# Request fields that configure the call but are not fed to the model as text.
_NOT_PROMPT = frozenset(
    {
        "model",
        "user",
        "metadata",
        "service_tier",
        "encoding_format",
        "stream_options",
        "store",
        "seed",
        "logit_bias",
        "prompt_cache_key",
        "safety_identifier",
        "reasoning_effort",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "n",
        "stream",
        "temperature",
        "top_p",
    }
)
_MEDIA_PART_TYPES = frozenset({"image_url", "input_image", "input_audio", "image", "audio", "input_file"})
_TOKEN_ID_FIELDS = frozenset({"prompt", "input"})


def _walk(value: Any, key: str | None, acc: list[int]) -> None:
    """Accumulate ``[characters, extra_tokens]`` for a JSON value into ``acc``."""
    if isinstance(value, str):
        if value.startswith("data:"):
            acc[1] += MEDIA_TOKENS
        else:
            acc[0] += len(value)
    elif isinstance(value, dict):
        if value.get("type") in _MEDIA_PART_TYPES:
            acc[1] += MEDIA_TOKENS
            return
        for k, v in value.items():
            if k not in _NOT_PROMPT:
                _walk(v, k, acc)
    elif isinstance(value, list):
        if key in _TOKEN_ID_FIELDS and value and all(type(v) is int for v in value):
            acc[1] += len(value)
            return
        for v in value:
            _walk(v, key, acc)


def _positive_int(value: Any) -> int | None:
    if type(value) is int and value > 0:
        return value
    return None


def estimate_tokens(body: bytes, *, default_max_tokens: int = DEFAULT_MAX_TOKENS, path: str = "") -> int:
    """Tokens a request will cost at most (roughly): prompt estimate + completion allowance.

    ``body`` is the raw request body; anything that is not a JSON object (a GET, a
    multipart upload) is priced at 0 and left to the usage correction. ``path`` is
    the URL path when known: ``.../embeddings`` generates no completion tokens.
    """
    if not body:
        return 0
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return 0
    if not isinstance(data, dict):
        return 0
    return estimate_request_tokens(data, default_max_tokens=default_max_tokens, path=path)


def estimate_request_tokens(
    data: Mapping[str, Any], *, default_max_tokens: int = DEFAULT_MAX_TOKENS, path: str = ""
) -> int:
    """:func:`estimate_tokens` of a request body already parsed (a server that parsed it once)."""
    acc = [0, 0]
    for k, v in data.items():
        if k not in _NOT_PROMPT:
            _walk(v, k, acc)
    prompt = math.ceil(acc[0] / CHARS_PER_TOKEN) + acc[1]
    messages = data.get("messages")
    if isinstance(messages, list):
        prompt += MESSAGE_OVERHEAD_TOKENS * len(messages) + REPLY_PRIMING_TOKENS
    if path.rstrip("/").endswith("embeddings"):
        return prompt
    completion = (
        _positive_int(data.get("max_completion_tokens"))
        or _positive_int(data.get("max_tokens"))
        or _positive_int(data.get("max_output_tokens"))
        or default_max_tokens
    )
    n = _positive_int(data.get("n")) or 1
    return prompt + completion * n


def _usage_total(obj: Any) -> int | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        # Responses API streams put usage in the final event's ``response`` object.
        response = obj.get("response")
        return _usage_total(response) if isinstance(response, dict) else None
    total = usage.get("total_tokens")
    if type(total) is int and total >= 0:
        return total
    parts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")]
    ints = [p for p in parts if type(p) is int and p >= 0]
    return sum(ints) if ints else None


def usage_tokens(body: bytes | None) -> int | None:
    """Total tokens the server reported in ``usage``, or None when it reported none.

    ``body`` is a whole JSON response, or the tail of a server-sent-event stream:
    then the last ``data:`` event carrying a non-null ``usage`` counts (OpenAI sends
    it in the final chunk when ``stream_options.include_usage`` is set; vLLM too).
    The tail may begin mid-line; unparsable lines are skipped. Truncated or
    malformed bodies give None, never an exception.
    """
    if not body:
        return None
    stripped = body.lstrip()
    if stripped.startswith(b"{"):
        try:
            return _usage_total(json.loads(stripped))
        except (ValueError, UnicodeDecodeError):
            pass
    if b'"usage"' not in body:
        return None
    for line in reversed(body.splitlines()):
        line = line.strip()
        if not line.startswith(b"data:") or b'"usage"' not in line:
            continue
        try:
            total = _usage_total(json.loads(line[5:]))
        except (ValueError, UnicodeDecodeError):
            continue
        if total is not None:
            return total
    return None
