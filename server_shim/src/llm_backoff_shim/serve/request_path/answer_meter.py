"""How many tokens an answer the relay passed on had: what the cost budget learns answers from.

The cost budget prices an answer at what this engine's recent answers were
(:mod:`llm_backoff_shim.decide.answer_length`), so the relay counts each answer it relays in
full, without parsing it:

- the answer's own ``usage`` when it has one: ``completion_tokens`` (OpenAI's chat and
  completions, in a whole body, or in a stream's last chunk when the client asked for
  ``stream_options.include_usage``) or ``output_tokens`` (Responses, Anthropic's messages),
  the last one found in the answer's final :data:`TAIL_BYTES`;
- else, for an event stream, its ``data:`` events less two (the role chunk that opens a
  chat stream and the closing ``[DONE]``): vLLM sends one event per token by default; with
  its ``--stream-interval`` above 1 an event carries several, and this counts fewer tokens
  than the engine held (ask for usage to count them exactly);
- else nothing: an answer that cannot be counted teaches nothing.

Per chunk: one ``bytes.count`` and a slice of the tail; the answer itself is never decoded.
"""

from __future__ import annotations

import re

#: How much of an answer's end is kept to find its usage (a usage chunk is about 300 bytes).
TAIL_BYTES = 2048

_USAGE = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')


class AnswerMeter:
    """Counts one answer's tokens as its chunks pass (module docstring)."""

    __slots__ = ("events", "tail")

    def __init__(self) -> None:
        self.events = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        """One chunk of the answer's body, as relayed."""
        self.events += chunk.count(b"data:")
        tail = self.tail + chunk if self.tail else chunk
        self.tail = tail[-TAIL_BYTES:] if len(tail) > TAIL_BYTES else tail

    def tokens(self, event_stream: bool, ended: bool = True) -> int | None:
        """The answer's completion tokens, or None when they cannot be told (module docstring);
        ``ended=False``: a stream the client closed before its end (no closing event counted)."""
        found = _USAGE.findall(self.tail)
        if found:
            return int(found[-1])
        if event_stream and self.events:
            return max(0, self.events - (2 if ended else 1))
        return None
