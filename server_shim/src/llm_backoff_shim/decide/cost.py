"""What a generation request's body says of its cost to the engine: its prompt tokens and the
most answer tokens it allows.

What the cost budget counts for a request (its prompt plus the answer it is expected to hold,
not its ``max_tokens``) is :mod:`llm_backoff_shim.decide.pricing`; this module only reads bodies.

Prompt tokens are estimated without a tokenizer, cheaply enough to run on every request:
UTF-8 bytes of the text divided by a bytes-per-token ratio, rounded up, plus
:data:`MESSAGE_OVERHEAD` (4) per chat message for its role and the template's separators.
The ratio is the engine's own, learned once from its ``/tokenize`` endpoint
(:func:`bytes_per_token`), so an estimate is in the engine's tokens whatever its tokenizer;
:data:`BYTES_PER_TOKEN` (4) when the engine has no such endpoint. BPE tokenizers of today's
models average 3.5 to 4.5 bytes per token on English text, small-vocabulary ones fewer
(2 to 3), and all of them fewer on code, digits and most other languages. Token-id prompts
count exactly. Text is read from a chat message's ``content`` (a string, or the
``text`` of its parts), a completion's ``prompt`` and an embedding's or a Responses call's
``input`` (a string, token ids, or a list of either, or of messages), and the Anthropic
``system`` and Responses ``instructions``; images, audio and tool definitions are not
counted. A body this cannot read (the engine will refuse it) has a prompt of 0. The
answer's limit is ``max_completion_tokens``, ``max_tokens`` or ``max_output_tokens``
(Responses), whichever comes first (:func:`answer_limit`).

Pure: no I/O, no clock. The shim's intake reads it once per request from the body it
already parsed; the benchmarks import it to price their own mixes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: UTF-8 bytes per prompt token when the engine's own ratio is not known (module docstring).
BYTES_PER_TOKEN = 4.0
#: Tokens a chat message adds for its role and the chat template's separators.
MESSAGE_OVERHEAD = 4
#: The ratios :func:`bytes_per_token` accepts: a tokenizer counting more than a token per byte
#: or fewer than one per 16 bytes of English text is not counting that text.
RATIO_RANGE = (1.0, 16.0)

#: English prose the engine's tokenizer is asked to count (:func:`bytes_per_token`): prompts
#: are mostly prose, and a paragraph of common words averages out single words' quirks.
SAMPLE_TEXT = (
    "The quarterly report shows that revenue grew by a modest margin, while costs for cloud "
    "services and support rose faster than expected. Please summarise the main points for the "
    "team, list the three largest risks, and suggest what we should ask the vendor before the "
    "contract is renewed next month. Keep the answer short and use plain language; the readers "
    "are engineers and managers who have not seen the original document."
)


def bytes_per_token(text: str, tokens: int) -> float | None:
    """UTF-8 bytes per token of ``text`` that the engine's tokenizer counted as ``tokens``;
    None when the count is not a plausible one (:data:`RATIO_RANGE`), so the caller keeps
    :data:`BYTES_PER_TOKEN`."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        return None
    ratio = len(text.encode("utf-8")) / tokens
    low, high = RATIO_RANGE
    return ratio if low <= ratio <= high else None


def text_tokens(text: str, ratio: float = BYTES_PER_TOKEN) -> int:
    """Estimated tokens of ``text``: its UTF-8 bytes / ``ratio`` (bytes per token), rounded up."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return math.ceil(size / ratio)


def _is_token_ids(value: list[object]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_tokens(prompt: object, ratio: float) -> int:
    """A completion's ``prompt``: text, token ids, or a list of either (a batch)."""
    if isinstance(prompt, str):
        return text_tokens(prompt, ratio)
    if not isinstance(prompt, list):
        return 0
    if _is_token_ids(prompt):
        return len(prompt)
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += text_tokens(item, ratio)
        elif isinstance(item, list) and _is_token_ids(item):
            total += len(item)
    return total


def _content_tokens(content: object, ratio: float) -> int:
    if isinstance(content, str):
        return text_tokens(content, ratio)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    total += text_tokens(text, ratio)
        return total
    return 0


def _messages_tokens(messages: list[object], ratio: float) -> int:
    """Chat messages (or Responses input items): their text, and the template's overhead each."""
    total = 0
    for message in messages:
        if isinstance(message, Mapping):
            total += _content_tokens(message.get("content"), ratio) + MESSAGE_OVERHEAD
        elif isinstance(message, str):
            total += text_tokens(message, ratio)
        elif isinstance(message, list) and _is_token_ids(message):
            total += len(message)
    return total


def estimate_prompt_tokens(body: Mapping[str, object], ratio: float = BYTES_PER_TOKEN) -> int:
    """Estimated prompt tokens of a generation body at ``ratio`` bytes per token: chat or
    Anthropic ``messages`` (and ``system``), a completion's ``prompt``, an embedding's or
    Responses call's ``input`` (and ``instructions``), module docstring; 0 for a body with none
    of them."""
    total = _content_tokens(body.get("system"), ratio) + _content_tokens(body.get("instructions"), ratio)
    messages = body.get("messages")
    if isinstance(messages, list):
        total += _messages_tokens(messages, ratio)
    total += _prompt_tokens(body.get("prompt"), ratio)
    given = body.get("input")
    if isinstance(given, list) and not _is_token_ids(given):
        total += _messages_tokens(given, ratio)
    else:
        total += _prompt_tokens(given, ratio)
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


def answer_limit(body: Mapping[str, object]) -> int | None:
    """The most answer tokens a body allows: ``max_completion_tokens``, ``max_tokens`` or
    ``max_output_tokens`` (Responses), the first that is a positive whole number; None when it
    names none (the engine's own limit is then the rest of the model's context)."""
    most = requested_max_tokens(body)
    if most is None:
        value = body.get("max_output_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            most = value
    return most
