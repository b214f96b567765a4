"""What a generation request may cost the engine, in KV-cache tokens, from its body alone.

A request's cost is its prompt tokens plus the most output tokens it asks for
(``max_completion_tokens``, else ``max_tokens``): the KV-cache tokens it may hold by its end.
A body that names no limit counts ``default_max_tokens`` (the shim's ``--default-max-tokens``)
for its answer: the engine's own default (the rest of the model's context) is no estimate
of what an answer holds, and a chat client that sends no limit usually gets an answer of a
few hundred tokens.

Prompt tokens are estimated without a tokenizer, cheaply enough to run on every request:
UTF-8 bytes of the text divided by :data:`BYTES_PER_TOKEN` (4), rounded up, plus
:data:`MESSAGE_OVERHEAD` (4) per chat message for its role and the template's separators.
BPE tokenizers of today's models average 3.5 to 4.5 bytes per token on English text and
fewer on code, digits and most other languages (more tokens than estimated). Token-id
prompts count exactly. Text is read from a chat message's ``content`` (a string, or the
``text`` of its parts), a completion's ``prompt`` and an embedding's or a Responses call's
``input`` (a string, token ids, or a list of either, or of messages), and the Anthropic
``system`` and Responses ``instructions``; images, audio and tool definitions are not
counted. A body this cannot read (the engine will refuse it) costs what it asked for in
output alone. The answer's limit is ``max_completion_tokens``, ``max_tokens`` or
``max_output_tokens`` (Responses), whichever comes first; a body without one (an
embedding's too) counts the default.

Pure: no I/O, no clock. The shim's intake computes it once per request from the body it
already parsed; calibrate and the benchmarks import it to price their own mixes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

#: UTF-8 bytes per prompt token of the estimate (module docstring).
BYTES_PER_TOKEN = 4
#: Tokens a chat message adds for its role and the chat template's separators.
MESSAGE_OVERHEAD = 4


@dataclass(frozen=True, slots=True)
class RequestCost:
    """A request's estimated prompt tokens and the output tokens it may generate."""

    prompt_tokens: int
    max_tokens: int

    @property
    def tokens(self) -> int:
        """KV-cache tokens the request may hold by its end: prompt plus answer."""
        return self.prompt_tokens + self.max_tokens


def text_tokens(text: str) -> int:
    """Estimated tokens of ``text``: its UTF-8 bytes / :data:`BYTES_PER_TOKEN`, rounded up."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-size // BYTES_PER_TOKEN)


def _is_token_ids(value: list[object]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_tokens(prompt: object) -> int:
    """A completion's ``prompt``: text, token ids, or a list of either (a batch)."""
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if not isinstance(prompt, list):
        return 0
    if _is_token_ids(prompt):
        return len(prompt)
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += text_tokens(item)
        elif isinstance(item, list) and _is_token_ids(item):
            total += len(item)
    return total


def _content_tokens(content: object) -> int:
    if isinstance(content, str):
        return text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    total += text_tokens(text)
        return total
    return 0


def _messages_tokens(messages: list[object]) -> int:
    """Chat messages (or Responses input items): their text, and the template's overhead each."""
    total = 0
    for message in messages:
        if isinstance(message, Mapping):
            total += _content_tokens(message.get("content")) + MESSAGE_OVERHEAD
        elif isinstance(message, str):
            total += text_tokens(message)
        elif isinstance(message, list) and _is_token_ids(message):
            total += len(message)
    return total


def estimate_prompt_tokens(body: Mapping[str, object]) -> int:
    """Estimated prompt tokens of a generation body: chat or Anthropic ``messages`` (and
    ``system``), a completion's ``prompt``, an embedding's or Responses call's ``input`` (and
    ``instructions``), module docstring; 0 for a body with none of them."""
    total = _content_tokens(body.get("system")) + _content_tokens(body.get("instructions"))
    messages = body.get("messages")
    if isinstance(messages, list):
        total += _messages_tokens(messages)
    total += _prompt_tokens(body.get("prompt"))
    given = body.get("input")
    if isinstance(given, list) and not _is_token_ids(given):
        total += _messages_tokens(given)
    else:
        total += _prompt_tokens(given)
    return total


def requested_max_tokens(body: Mapping[str, object]) -> int | None:
    """The most output tokens a body asks for (``max_completion_tokens``, else ``max_tokens``),
    or None when it names no positive whole number. The engine validates the body; this only
    reads what admission may use."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def request_cost(body: Mapping[str, object], default_max_tokens: int) -> RequestCost:
    """The cost of a generation request's body: estimated prompt tokens, and its
    ``max_completion_tokens``/``max_tokens``/``max_output_tokens`` or else
    ``default_max_tokens`` (module docstring)."""
    if default_max_tokens < 0 or not math.isfinite(default_max_tokens):
        raise ValueError("default_max_tokens must be >= 0")
    most = requested_max_tokens(body)
    if most is None:
        value = body.get("max_output_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            most = value
    return RequestCost(estimate_prompt_tokens(body), default_max_tokens if most is None else most)
