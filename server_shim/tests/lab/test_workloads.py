"""``lab/workloads.py``: the named workloads' distributions, the registry, calibrate's ``--workload``."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from llm_backoff_shim.lab import calibrate
from llm_backoff_shim.lab.workload import LengthDist
from llm_backoff_shim.lab.workloads import WORKLOADS, ClassLengths, NamedWorkload, Phase, named_workload

N = 40_000


def _lognormal_moments_tolerance(mean: float, sd: float) -> tuple[float, float]:
    """Four standard errors of the sample mean and of the sample sd of ``N`` lognormal draws of
    that mean and sd (the sd's from the law's kurtosis)."""
    s2 = math.log(1 + (sd / mean) ** 2)
    kurtosis = math.exp(4 * s2) + 2 * math.exp(3 * s2) + 3 * math.exp(2 * s2) - 3
    return 4 * sd / math.sqrt(N), 4 * sd * math.sqrt((kurtosis - 1) / (4 * N))


@pytest.mark.parametrize(("mean", "sd"), [(150, 60), (200, 80), (500, 400)])
def test_a_lognormal_given_by_mean_and_sd_draws_that_mean_and_sd(mean: float, sd: float) -> None:
    dist = LengthDist.lognormal_mean_sd(mean, sd, 1, 100_000)
    rng = random.Random(5)
    draws = [dist.draw(rng) for _ in range(N)]
    mean_tol, sd_tol = _lognormal_moments_tolerance(mean, sd)
    # Rounding to whole tokens adds at most 1/sqrt(12) to the sd, half a token to the mean.
    assert statistics.fmean(draws) == pytest.approx(mean, abs=mean_tol + 0.5)
    assert statistics.stdev(draws) == pytest.approx(sd, abs=sd_tol + 0.3)


def test_mean_and_sd_convert_to_the_median_and_sigma_of_the_underlying_normal() -> None:
    dist = LengthDist.lognormal_mean_sd(150, 60)
    sigma2 = math.log(1 + 0.16)
    assert dist.sigma == pytest.approx(math.sqrt(sigma2))
    assert dist.median == pytest.approx(math.exp(math.log(150) - sigma2 / 2))
    with pytest.raises(ValueError, match="mean >= 1 and sd >= 0"):
        LengthDist.lognormal_mean_sd(150, -1)


def test_the_batch_gateways_batch_answers_are_clamped_at_2048() -> None:
    answers = named_workload("batch-gateway").batch.answer_tokens
    rng = random.Random(1)
    draws = [answers.draw(rng) for _ in range(N)]
    assert max(draws) == 2048  # sd 400 on a mean of 500: the tail reaches the clamp
    assert min(draws) >= 1


def test_scaling_a_length_moves_fixed_uniform_and_lognormal_alike() -> None:
    assert LengthDist.fixed(145).scaled(1 / 1.45, 10) == LengthDist.fixed(110)
    assert LengthDist.uniform(100, 200).scaled(0.5) == LengthDist.uniform(50, 100)
    moved = LengthDist.lognormal(200, 0.4, 10, 2000).scaled(1.0, 100)
    assert (moved.median, moved.low, moved.high) == (300, 110, 2100)
    assert moved.sigma == pytest.approx(0.4 * 200 / 300)


def test_the_registry_names_the_peers_workloads_and_an_unknown_name_lists_them() -> None:
    assert list(WORKLOADS) == ["shared-prefix", "bimodal", "batch-gateway"]
    assert named_workload("bimodal") is WORKLOADS["bimodal"]
    with pytest.raises(
        ValueError, match="unknown workload 'chat': expected one of shared-prefix, bimodal, batch-gateway"
    ):
        named_workload("chat")


def test_the_bimodal_workload_is_inference_perfs_two_modes() -> None:
    w = named_workload("bimodal")
    assert w.batch_share == 0.3
    assert (
        w.interactive.prefix_tokens + w.interactive.prompt_tokens.median,
        w.interactive.answer_tokens.median,
    ) == (150, 50)
    assert (w.batch.prefix_tokens + w.batch.prompt_tokens.median, w.batch.answer_tokens.median) == (1124, 512)
    assert w.calibrate_flags(tokens_per_word=2.0) == [
        "--prompt-words", "75", "--output-tokens", "50", "--long-share", "0.3", "--long-prompt-words", "562",
    ]  # fmt: skip


def test_phases_must_cover_the_run_and_keep_the_mean_rate() -> None:
    lengths = ClassLengths(LengthDist.fixed(10), LengthDist.fixed(10))
    with pytest.raises(ValueError, match="phases"):
        NamedWorkload("x", "", "", lengths, lengths, 0.3, (Phase(0.5, 15.0), Phase(0.5, 1.0)))
    with pytest.raises(ValueError, match="shared prefix"):
        ClassLengths(LengthDist.fixed(10), LengthDist.fixed(10), prefix_tokens=100)
    gateway = named_workload("batch-gateway").phases
    assert gateway[0].rate / gateway[1].rate == pytest.approx(15.0)


def test_calibrate_sizes_its_lengths_from_a_named_workload_and_a_flag_given_wins() -> None:
    args = calibrate.build_parser().parse_args(["--upstream", "http://h:1", "--workload", "bimodal"])
    config = calibrate.config_from_args(args)
    assert config.prompt_words == LengthDist.fixed(150)
    assert config.output_tokens == LengthDist.fixed(50)
    assert config.long_share == 0.3
    assert config.long_prompt_words == LengthDist.fixed(1124)
    args = calibrate.build_parser().parse_args(
        ["--upstream", "http://h:1", "--workload", "shared-prefix", "--output-tokens", "20"]
    )
    config = calibrate.config_from_args(args)
    assert config.output_tokens == LengthDist.fixed(20)
    # The flag's text form of the prompt's whole length (the prefix's 100 tokens and the question).
    assert str(config.prompt_words) == str(named_workload("shared-prefix").interactive.prompt_words(1.0))
    assert config.prompt_words.low == 110
    assert config.long_share == 0.0  # both classes have the same lengths: no long prompts


def test_calibrate_refuses_an_unknown_workload_with_the_names() -> None:
    args = calibrate.build_parser().parse_args(["--upstream", "http://h:1", "--workload", "sharegpt"])
    with pytest.raises(ValueError, match="unknown workload 'sharegpt': expected one of shared-prefix"):
        calibrate.config_from_args(args)
