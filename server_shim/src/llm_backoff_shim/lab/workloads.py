"""Named workloads: the traffic the peers' own benchmark tools send, by the names those tools use (pure).

Each :class:`NamedWorkload` gives, per class (interactive, batch), the prompt's length in the
engine's tokens (a shared system prompt, when the tool sends one, and the request's own part)
and the answer's length, the batch share of the calls, and the shape of the interactive
arrivals over the run. ``calibrate --workload NAME`` and the scoreboard's scenarios of the same
names read them from :data:`WORKLOADS`; :func:`named_workload` turns an unknown name into an
error listing the names.

- ``shared-prefix``: inference-perf's ``shared_prefix`` data (its example
  ``examples/vllm/config-shared-prefix-distributions.yml``): 10 system prompts of 100 tokens,
  each request one of them and its own question (skew-normal, mean 200, sd 80, 10-2,000
  tokens there; a lognormal of that mean and sd here), answers lognormal with mean 150 and sd
  60 (1-4,096).
- ``bimodal``: inference-perf's ``bimodal`` data (``examples/vllm/config-bimodal.yml``): 70 %
  mode A (100-token system prompt and a 50-token question, 50-token answers), 30 % mode B (the
  same system prompt and a 1,024-token question, 512-token answers); mode A is interactive,
  mode B batch.
- ``batch-gateway``: the llm-d batch gateway's benchmark (``benchmarks/README.md`` of
  llm-d-incubation/batch-gateway: interactive bursts at 15 requests/s for 90 s, then 1/s for
  90 s, beside batch jobs of 256-token prompts; the lengths as quoted from its benchmark spec,
  llm-d/llm-d-batch-gateway#491): interactive calls of 512 prompt tokens and 128-token answers,
  batch answers lognormal with mean 500 and sd 400, at most 2,048. The rates are kept as a
  shape (:class:`Phase`: 15 to 1, half the run each), scaled by whoever plays it to its
  engine's capacity.

Prompts are the load generator's words (:mod:`llm_backoff_shim.lab.workload`), as many as
the tokens asked for at the engine's tokens per word; a shared prefix is the same words for
every request of its group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llm_backoff_shim.lab.workload import LengthDist

Kind = Literal["interactive", "batch"]


@dataclass(frozen=True)
class ClassLengths:
    """One class's lengths in the engine's tokens: ``prompt_tokens`` the request's own part,
    after a shared prefix of ``prefix_tokens`` chosen among ``prefix_groups`` (0: none)."""

    prompt_tokens: LengthDist
    answer_tokens: LengthDist
    prefix_tokens: int = 0
    prefix_groups: int = 0

    def __post_init__(self) -> None:
        if (self.prefix_tokens > 0) != (self.prefix_groups > 0) or min(
            self.prefix_tokens, self.prefix_groups
        ) < 0:
            raise ValueError("a shared prefix needs both prefix_tokens and prefix_groups > 0")

    def prompt_words(self, tokens_per_word: float) -> LengthDist:
        """The whole prompt (prefix included) in the load generator's words."""
        return self.prompt_tokens.scaled(1 / tokens_per_word, round(self.prefix_tokens / tokens_per_word))


@dataclass(frozen=True)
class Phase:
    """A part of the run: ``share`` of its duration, interactive calls arriving at ``rate`` times
    their mean rate (the phases' rates, weighted by their shares, average 1)."""

    share: float
    rate: float


STEADY = (Phase(1.0, 1.0),)


@dataclass(frozen=True)
class NamedWorkload:
    name: str
    summary: str
    source: str
    interactive: ClassLengths
    batch: ClassLengths
    batch_share: float
    phases: tuple[Phase, ...] = STEADY

    def __post_init__(self) -> None:
        if not 0 <= self.batch_share <= 1:
            raise ValueError(f"batch_share must be in [0, 1], got {self.batch_share!r}")
        total = sum(p.share for p in self.phases)
        mean = sum(p.share * p.rate for p in self.phases)
        if (
            abs(total - 1) > 1e-9
            or abs(mean - 1) > 1e-9
            or any(p.share <= 0 or p.rate < 0 for p in self.phases)
        ):
            raise ValueError("phases' shares must be > 0 and sum to 1, their weighted rates average 1")

    def lengths(self, kind: Kind) -> ClassLengths:
        return self.interactive if kind == "interactive" else self.batch

    def calibrate_flags(self, tokens_per_word: float) -> list[str]:
        """``calibrate``'s length flags for this traffic: the interactive class's prompts and
        answers, the batch class as its long prompts (calibrate has one answer length; the
        interactive one is what its time-to-first-token budget is about)."""
        flags = [
            "--prompt-words",
            str(self.interactive.prompt_words(tokens_per_word)),
            "--output-tokens",
            str(self.interactive.answer_tokens),
        ]
        if self.batch_share > 0 and self.batch != self.interactive:
            flags += [
                "--long-share",
                f"{self.batch_share:g}",
                "--long-prompt-words",
                str(self.batch.prompt_words(tokens_per_word)),
            ]
        return flags


_SHARED_PREFIX = ClassLengths(
    prompt_tokens=LengthDist.lognormal_mean_sd(200, 80, 10, 2000),
    answer_tokens=LengthDist.lognormal_mean_sd(150, 60, 1, 4096),
    prefix_tokens=100,
    prefix_groups=10,
)

WORKLOADS: dict[str, NamedWorkload] = {
    w.name: w
    for w in (
        NamedWorkload(
            "shared-prefix",
            "10 shared 100-token system prompts, questions ~200 tokens, answers lognormal mean 150 sd 60",
            "inference-perf shared_prefix (examples/vllm/config-shared-prefix-distributions.yml)",
            _SHARED_PREFIX,
            _SHARED_PREFIX,
            batch_share=0.3,
        ),
        NamedWorkload(
            "bimodal",
            "70 % 150-token prompts with 50-token answers, 30 % 1,124-token prompts with 512-token answers",
            "inference-perf bimodal (examples/vllm/config-bimodal.yml)",
            ClassLengths(LengthDist.fixed(50), LengthDist.fixed(50), prefix_tokens=100, prefix_groups=2),
            ClassLengths(LengthDist.fixed(1024), LengthDist.fixed(512), prefix_tokens=100, prefix_groups=2),
            batch_share=0.3,
        ),
        NamedWorkload(
            "batch-gateway",
            "interactive 512 in / 128 out in bursts (15:1, half the run each) beside batch jobs "
            "(256-token prompts, answers lognormal mean 500 sd 400, at most 2,048)",
            "llm-d batch gateway benchmark (llm-d-incubation/batch-gateway benchmarks/README.md)",
            ClassLengths(LengthDist.fixed(512), LengthDist.fixed(128)),
            ClassLengths(LengthDist.fixed(256), LengthDist.lognormal_mean_sd(500, 400, 1, 2048)),
            batch_share=0.3,
            phases=(Phase(0.5, 15 / 8), Phase(0.5, 1 / 8)),
        ),
    )
}


def named_workload(name: str) -> NamedWorkload:
    """The workload called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}: expected one of {', '.join(WORKLOADS)}") from None
