"""Realistic request lengths: seeded length distributions, prompt text, and a workload of both (pure).

A :class:`Workload` says how long the prompts (in words) and the answers (``max_tokens``)
of a load are. The load generator (:mod:`llm_backoff_shim.lab.loadgen`), ``demo``,
``calibrate`` and the benchmarks draw every request's lengths from one, with a
``random.Random`` the caller seeds, so every configuration of one run sends the very same
requests.

Lengths follow a :class:`LengthDist`: fixed, uniform, or lognormal (the default shape:
answer lengths of chat traffic are heavy-tailed, most short, a few long), clamped to
``[low, high]``. Text form, for flags: ``64`` (fixed), ``16-256`` (uniform, inclusive),
``lognormal:64:0.8`` (median 64, sigma 0.8 of the underlying normal, clamped to
``1..8*median``) or ``lognormal:64:0.8:1-512`` (clamped to ``1..512``).

Prompt words are drawn from a list of short common English words in random order, so no
two prompts share a prefix an engine could cache. A word of these is about one token
with the usual BPE tokenizers; a small tokenizer trained on little text splits them
more (vLLM counted about 290 tokens for 200 of them with one), so read an upstream's
``usage.prompt_tokens`` for the true count.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

DistKind = Literal["fixed", "uniform", "lognormal"]

#: Short common English words (see the module doc).
_WORDS_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give our "
    "under name very through just form great think say help low line differ turn cause much mean"
)
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())

#: Upper clamp of a lognormal given without bounds, as a multiple of its median.
DEFAULT_TAIL = 8


@dataclass(frozen=True)
class LengthDist:
    """A positive integer length: ``fixed`` (``median``), ``uniform`` on ``low..high``, or
    ``lognormal`` (median ``median``, log-space spread ``sigma``) clamped to ``low..high``."""

    kind: DistKind
    median: float
    sigma: float = 0.0
    low: int = 1
    high: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median >= 1):
            raise ValueError(f"median must be a number >= 1, got {self.median!r}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma must be a number >= 0, got {self.sigma!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"expected 1 <= low <= high, got {self.low}..{self.high}")

    @classmethod
    def fixed(cls, value: int) -> LengthDist:
        return cls("fixed", float(value), 0.0, value, value)

    @classmethod
    def uniform(cls, low: int, high: int) -> LengthDist:
        return cls("uniform", (low + high) / 2, 0.0, low, high)

    @classmethod
    def lognormal(cls, median: float, sigma: float, low: int = 1, high: int | None = None) -> LengthDist:
        top = high if high is not None else max(low, math.ceil(median * DEFAULT_TAIL))
        return cls("lognormal", float(median), float(sigma), low, top)

    @classmethod
    def lognormal_mean_sd(cls, mean: float, sd: float, low: int = 1, high: int | None = None) -> LengthDist:
        """The lognormal whose (unclamped) mean and standard deviation are ``mean`` and ``sd``, as
        benchmark tools give it: ``sigma^2 = ln(1 + sd^2 / mean^2)``, median ``mean / sqrt(1 +
        sd^2 / mean^2)`` (that is ``exp(mu)`` with ``mu = ln(mean) - sigma^2 / 2``)."""
        if not (math.isfinite(mean) and mean >= 1 and math.isfinite(sd) and sd >= 0):
            raise ValueError(f"expected mean >= 1 and sd >= 0, got mean {mean!r}, sd {sd!r}")
        spread = 1 + (sd / mean) ** 2
        return cls.lognormal(mean / math.sqrt(spread), math.sqrt(math.log(spread)), low, high)

    def scaled(self, factor: float, offset: int = 0) -> LengthDist:
        """``offset + factor * length``, rounded (prompt tokens to words, a shared prefix added).
        A lognormal keeps its spread in absolute terms around its moved median (its sigma scaled
        by ``old median / new median``): close enough to size a load, not the exact law."""
        if not (math.isfinite(factor) and factor > 0 and offset >= 0):
            raise ValueError(f"expected factor > 0 and offset >= 0, got {factor!r}, {offset!r}")

        def move(n: float) -> int:
            return max(1, round(offset + factor * n))

        if self.kind == "fixed":
            return LengthDist.fixed(move(self.median))
        if self.kind == "uniform":
            return LengthDist.uniform(move(self.low), move(self.high))
        median = offset + factor * self.median
        return LengthDist.lognormal(
            median, self.sigma * factor * self.median / median, move(self.low), move(self.high)
        )

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """The text form of the module doc; raises ``ValueError`` with a readable message."""
        spec = text.strip()
        try:
            if spec.startswith("lognormal:"):
                parts = spec.split(":")[1:]
                if len(parts) not in (2, 3):
                    raise ValueError
                median, sigma = float(parts[0]), float(parts[1])
                if len(parts) == 3:
                    low, high = _range(parts[2])
                    return cls.lognormal(median, sigma, low, high)
                return cls.lognormal(median, sigma)
            if "-" in spec:
                low, high = _range(spec)
                return cls.uniform(low, high)
            return cls.fixed(int(spec))
        except ValueError as exc:
            detail = f" ({exc})" if str(exc) else ""
            raise ValueError(
                f"expected N, LOW-HIGH or lognormal:MEDIAN:SIGMA[:LOW-HIGH], got {text!r}{detail}"
            ) from None

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.median)
        if self.low == self.high:
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        value = rng.lognormvariate(math.log(self.median), self.sigma) if self.sigma > 0 else self.median
        return min(self.high, max(self.low, round(value)))

    def mean(self, samples: int = 20_000, seed: int = 0) -> float:
        """The mean length (estimated from ``samples`` seeded draws for a clamped lognormal)."""
        if self.kind == "fixed":
            return self.median
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        rng = random.Random(seed)
        return sum(self.draw(rng) for _ in range(samples)) / samples

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.median))
        if self.kind == "uniform":
            return f"{self.low}-{self.high}"
        return f"lognormal:{self.median:g}:{self.sigma:g}:{self.low}-{self.high}"


def _range(text: str) -> tuple[int, int]:
    parts = text.split("-")
    if len(parts) != 2:
        raise ValueError
    low, high = int(parts[0]), int(parts[1])
    if not 1 <= low <= high:
        raise ValueError("LOW must be >= 1 and <= HIGH")
    return low, high


def prompt_text(words: int, rng: random.Random) -> str:
    """``words`` words of :data:`WORDS` in random order."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


#: The default lengths (see :class:`Workload`).
DEFAULT_PROMPT_WORDS = LengthDist.lognormal(40, 0.9, 5, 200)
DEFAULT_OUTPUT_TOKENS = LengthDist.lognormal(64, 0.8, 1, 512)


@dataclass(frozen=True)
class Workload:
    """How long each request's prompt (words) and answer (``max_tokens``) are.

    Defaults: prompts of 5-200 words (lognormal, median 40), answers lognormal with median
    64 tokens, sigma 0.8, at most 512. ``ignore_eos`` sends vLLM's extra parameter of that
    name, so the engine generates exactly ``max_tokens`` (the simulator honours it too);
    without it an engine may stop earlier, at its natural end.
    """

    prompt_words: LengthDist = DEFAULT_PROMPT_WORDS
    output_tokens: LengthDist = DEFAULT_OUTPUT_TOKENS
    ignore_eos: bool = True

    def draw(self, rng: random.Random) -> tuple[str, int]:
        """One request's prompt text and ``max_tokens``."""
        words = self.prompt_words.draw(rng)
        max_tokens = self.output_tokens.draw(rng)
        return prompt_text(words, rng), max_tokens

    def describe(self) -> str:
        eos = ", ignore_eos" if self.ignore_eos else ""
        return f"prompt {self.prompt_words} words, max_tokens {self.output_tokens}{eos}"
