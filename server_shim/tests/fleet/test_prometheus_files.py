"""The shipped Prometheus files, checked by Prometheus' own tool (promtool, Debian's ``prometheus``).

``promtool check config`` / ``check rules`` on the shipped files and on the configuration
:mod:`llm_backoff_shim.lab.prometheus` renders from them; ``promtool test rules`` on series made
up for the edge cases a live fleet does not show on demand: a replica with an empty queue and
no completions (time to drain 0, not NaN), one whose queue does not move (+Inf), and each alert
firing only after its ``for``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from llm_backoff_shim.lab.prometheus import SHIPPED_CONFIG, SHIPPED_RULES, duration, render_config


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(
                "promtool is not installed, and CI must run this test (scripts/test.sh installs prometheus)"
            )
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def run(*args: str) -> str:
    result = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_shipped_config_and_rules_pass_promtool() -> None:
    out = run("check", "config", str(SHIPPED_CONFIG))
    assert "SUCCESS: 1 rule files found" in out
    run("check", "rules", str(SHIPPED_RULES))


def test_rendered_config_passes_promtool_and_keeps_the_shipped_job(tmp_path: Path) -> None:
    rendered = render_config(
        ["127.0.0.1:18080", "127.0.0.1:18081"], scrape_interval=0.5, labels={"namespace": "llm-serving"}
    )
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(rendered))
    run("check", "config", str(path))
    (job,) = rendered["scrape_configs"]
    assert job["job_name"] == "llm-backoff-shim"
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [
        {"targets": ["127.0.0.1:18080", "127.0.0.1:18081"], "labels": {"namespace": "llm-serving"}}
    ]
    assert (job["scrape_interval"], job["scrape_timeout"]) == ("500ms", "500ms")
    assert rendered["rule_files"] == [str(SHIPPED_RULES)]


@pytest.mark.parametrize(("seconds", "text"), [(1, "1s"), (0.25, "250ms"), (15, "15s"), (1.5, "1500ms")])
def test_durations_in_prometheus_form(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def description(alert: str) -> str:
    (rule,) = [
        r
        for g in yaml.safe_load(SHIPPED_RULES.read_text())["groups"]
        for r in g["rules"]
        if r.get("alert") == alert
    ]
    text: str = rule["annotations"]["description"]
    return text


def shim(
    instance: str, queue: str, drain: str, counters: dict[str, str] | None = None, **more: str
) -> list[dict[str, str]]:
    """One shim's series; ``more``: ``requests_total`` by ``outcome__code``; ``counters``: other
    series by name and labels (``'attempts_total{outcome="admitted",code=""}'``)."""
    base = f'job="shims",instance="{instance}"'
    series = [
        {"series": f'llm_backoff_shim_queue_depth{{{base},class="interactive"}}', "values": queue},
        {"series": f'llm_backoff_shim_queue_depth{{{base},class="batch"}}', "values": "0x30"},
        {"series": f'llm_backoff_shim_drain_rate_per_second{{{base},class="interactive"}}', "values": drain},
        {"series": f'llm_backoff_shim_drain_rate_per_second{{{base},class="batch"}}', "values": "0x30"},
        {"series": f"llm_backoff_shim_concurrency_limit{{{base}}}", "values": "8x30"},
    ]
    for labels, values in more.items():
        outcome, _, code = labels.partition("__")
        series.append(
            {
                "series": f'llm_backoff_shim_requests_total{{{base},class="interactive",'
                f'outcome="{outcome}",code="{code}"}}',
                "values": values,
            }
        )
    for name, values in (counters or {}).items():
        metric, _, labels = name.partition("{")
        series.append(
            {"series": f'llm_backoff_shim_{metric}{{{base},class="interactive",{labels}', "values": values}
        )
    return series


def test_recording_rules_and_alerts_on_made_up_series(tmp_path: Path) -> None:
    # a: 4 queued, 2 completions/s -> 2 s. b: idle, nothing ever completed -> 0 (not NaN).
    # c: 2 queued, nothing completing -> +Inf (a stuck engine), and 503s since minute 10.
    # Callers' attempts: a's first tries, 10 admitted and 10 refused for capacity per second
    # (refused again at a later try: its tries count 20 refusals); b admits 5 of those refused
    # (rescues); c's 1 refusal per second for its engine is an attempt, not for capacity.
    # One step per minute; counters grow per minute (a per-second rate is that / 60).
    series = [
        *shim(
            "a",
            "4x30",
            "2x30",
            {
                'attempts_total{outcome="admitted",code=""}': "0+600x30",
                'attempts_total{outcome="rejected",code="queue_full"}': "0+600x30",
            },
            admitted__="0+600x30",
            rejected__queue_full="0+1200x30",
        ),
        *shim(
            "b",
            "0x30",
            "0x30",
            {'rescues_total{code="queue_full"}': "0+300x30"},
            admitted__="0+300x30",
            rejected__queue_full="0x30",
        ),
        *shim(
            "c",
            "2x30",
            "0x30",
            {'attempts_total{outcome="rejected",code="upstream_unavailable"}': "0x10 0+60x20"},
            rejected__upstream_unavailable="0x10 0+60x20",
        ),
    ]

    def record(name: str, value: float, **labels: str) -> dict[str, Any]:
        text = ",".join(f'{k}="{v}"' for k, v in sorted({"job": "shims", **labels}.items()))
        return {
            "expr": name,
            "eval_time": "20m",
            "exp_samples": [{"labels": f"{name}{{{text}}}", "value": value}],
        }

    instance_series = "instance:llm_backoff_shim_time_to_drain_seconds"
    tests = {
        "rule_files": [str(SHIPPED_RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    record("job:llm_backoff_shim_queue_depth:sum", 6),
                    record("job:llm_backoff_shim_replicas:count", 3),
                    record("job:llm_backoff_shim_queue_depth_per_replica:avg", 2),
                    {
                        "expr": instance_series,
                        "eval_time": "20m",
                        "exp_samples": [
                            {"labels": f'{instance_series}{{job="shims",instance="a"}}', "value": 2},
                            {"labels": f'{instance_series}{{job="shims",instance="b"}}', "value": 0},
                            {
                                "labels": f'{instance_series}{{job="shims",instance="c"}}',
                                "value": float("inf"),
                            },
                        ],
                    },
                    record("job:llm_backoff_shim_time_to_drain_seconds:max", float("inf")),
                    # 21 attempts per second (a's 20, c's 1); refused for capacity: a's 10 less the
                    # 5 b rescued (a's and b's tries would say 20 refused of 30 tries).
                    record("job:llm_backoff_shim_capacity_rejections:ratio_rate5m", 5 / 21),
                ],
                "alert_rule_test": [
                    # Over 0.05 from minute 1 (a rate needs two samples), for 10m: firing from 11m.
                    {"eval_time": "10m", "alertname": "LlmBackoffFleetShedding", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "LlmBackoffFleetShedding",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "job": "shims"},
                                "exp_annotations": {
                                    "summary": "shims turns away 23.81% of callers' attempts for capacity",
                                    "description": description("LlmBackoffFleetShedding"),
                                },
                            }
                        ],
                    },
                    # c's +Inf is over 10 s from the start; a's 2 s never is.
                    {
                        "eval_time": "6m",
                        "alertname": "LlmBackoffShimBacklog",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "job": "shims", "instance": "c"},
                                "exp_annotations": {
                                    "summary": "c needs +Inf to work off its queue",
                                    "description": description("LlmBackoffShimBacklog"),
                                },
                            }
                        ],
                    },
                    {"eval_time": "11m", "alertname": "LlmBackoffShimUpstreamUnavailable", "exp_alerts": []},
                    {
                        "eval_time": "14m",
                        "alertname": "LlmBackoffShimUpstreamUnavailable",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical", "job": "shims", "instance": "c"},
                                "exp_annotations": {
                                    "summary": "c answers 503 upstream_unavailable",
                                    "description": description("LlmBackoffShimUpstreamUnavailable"),
                                },
                            }
                        ],
                    },
                    {"eval_time": "20m", "alertname": "LlmBackoffShimSloRed", "exp_alerts": []},
                ],
            }
        ],
    }
    path = tmp_path / "rules-test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    run("test", "rules", str(path))
