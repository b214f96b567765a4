"""Tenants: the file, identities, classes by key, quota buckets and headers; end to end on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llm_backoff.tokens import estimate_tokens
from llm_backoff_shim.decide.admission import AdmissionController
from llm_backoff_shim.decide.requests import UnknownClassError
from llm_backoff_shim.decide.tenants import (
    Tenant,
    TenantDirectory,
    TenantLimits,
    TenantsFileError,
    key_hash,
    load_tenants_file,
)
from llm_backoff_shim.serve.api.rejection import Refusal
from llm_backoff_shim.serve.app import create_app, shim_state
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.serve.config.values import ConfigError
from llm_backoff_shim.serve.policy.quota import TenantQuotas, quota_headers, reset_duration, specs_for
from llm_backoff_shim.serve.policy.request_hooks import ShimPolicies
from llm_backoff_shim.serve.serving import ServerThread, shim_server
from llm_backoff_shim.sim.server import SimConfig, create_sim_app
from llm_backoff_shim.testing import ManualClock

CLASSES = ("interactive", "batch")

MakeController = Callable[..., tuple[AdmissionController, ManualClock]]  # conftest's make_controller


def write(tmp_path: Path, data: object, name: str = "tenants.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


# --------------------------------------------------------------------------- file and identities


def test_key_hash_is_short_sha256() -> None:
    assert key_hash("sk-abc") == "1460db1b6902"  # sha256("sk-abc")[:12]
    assert len(key_hash("x" * 1000)) == 12


def test_file_loads_json_and_toml_and_hashes_clear_keys(tmp_path: Path) -> None:
    toml = write(
        tmp_path,
        """
[default]
requests_per_minute = 60

[[tenants]]
name = "chat"
key = "sk-chat"
classes = ["interactive"]

[[tenants]]
key_hash = "ABCDEF012345"
classes = ["batch", "interactive"]
default_class = "interactive"
""",
        "tenants.toml",
    )
    parsed = load_tenants_file(toml, CLASSES)
    assert parsed.default.requests_per_minute == 60
    assert [t.identity for t in parsed.tenants] == [key_hash("sk-chat"), "abcdef012345"]
    assert "sk-chat" not in repr(parsed)
    as_json = write(tmp_path, {"tenants": [{"id": "acme", "tokens_per_minute": 1000}]})
    assert load_tenants_file(as_json, CLASSES).tenants[0].identity == "acme"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tenants": [{"key": "a", "classes": ["nightly"]}]}, "tenants.0 names unknown classes ['nightly']"),
        ({"tenants": [{"key": "a", "id": "b"}]}, "exactly one of 'key', 'key_hash' or 'id'"),
        ({"tenants": [{"key_hash": "xyz"}]}, "12 hex digits"),
        ({"tenants": [{"key": "a"}, {"key_hash": key_hash("a")}]}, "same identity as tenants.0"),
        ({"default": {"requests_per_minute": -1}}, "default.requests_per_minute"),
        ({"tenants": [{"key": "a", "classes": ["batch"], "default_class": "interactive"}]}, "not in classes"),
        ({"tenant": []}, "tenant: Extra inputs are not permitted"),
        ("{not json", "not valid json"),
    ],
)
def test_file_errors_name_the_file_and_the_place(tmp_path: Path, data: object, message: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(TenantsFileError) as info:
        load_tenants_file(path, CLASSES)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_settings_reject_a_bad_tenants_file_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, {"tenants": [{"key": "a", "classes": ["nightly"]}]})
    with pytest.raises(ConfigError, match="unknown classes"):
        load_settings(["--tenants-file", str(path)])
    with pytest.raises(ConfigError, match="No such file"):
        load_settings(["--tenants-file", str(tmp_path / "missing.json")])


def test_identities_by_key_by_header_and_anonymous(tmp_path: Path) -> None:
    file = load_tenants_file(
        write(tmp_path, {"tenants": [{"name": "chat", "key": "sk-chat", "requests_per_minute": 600}]}),
        CLASSES,
    )
    directory = TenantDirectory(file, requests_per_minute=60, tokens_per_minute=1000)
    chat = directory.identify(bearer("sk-chat"))
    assert (chat.id, chat.name, chat.limits.requests_per_minute) == (key_hash("sk-chat"), "chat", 600)
    other = directory.identify(bearer("sk-other"))
    assert (other.id, other.limits.requests_per_minute, other.limits.tokens_per_minute) == (
        key_hash("sk-other"),
        60,
        1000,
    )
    assert directory.identify([]).id == "-"
    by_header = TenantDirectory(None, header="X-Tenant")
    assert by_header.identify([(b"x-tenant", b" acme "), *bearer("sk-chat")]).id == "acme"
    assert by_header.identify(bearer("sk-chat")).id == "-"
    assert not by_header.limited


def test_classes_by_key_bound_what_a_key_may_ask_for(make_controller: MakeController, tmp_path: Path) -> None:
    file = load_tenants_file(
        write(
            tmp_path,
            {
                "tenants": [
                    {"key": "sk-batch", "classes": ["batch"]},
                    {"key": "sk-any", "default_class": "batch"},
                ]
            },
        ),
        CLASSES,
    )
    c, _ = make_controller(2, max_queue=5, max_wait=10.0, start=1000.0)
    policies = ShimPolicies(c, directory=TenantDirectory(file))
    assert policies.choose_class(bearer("sk-batch"), None, c) == ("batch", key_hash("sk-batch"))
    assert policies.choose_class(bearer("sk-batch"), "Batch", c) == ("batch", key_hash("sk-batch"))
    refused = policies.choose_class(bearer("sk-batch"), "interactive", c)
    assert isinstance(refused, Refusal)
    assert refused.status == 403
    assert json.loads(refused.body)["error"]["code"] == "class_not_allowed"
    assert policies.choose_class(bearer("sk-any"), None, c)[0] == "batch"  # type: ignore[index]
    assert policies.choose_class(bearer("sk-any"), "interactive", c)[0] == "interactive"  # type: ignore[index]
    assert policies.choose_class(bearer("sk-unlisted"), None, c)[0] == "interactive"  # type: ignore[index]
    with pytest.raises(UnknownClassError):
        policies.choose_class(bearer("sk-any"), "nightly", c)


# --------------------------------------------------------------------------- buckets and headers


def test_reset_durations_in_openai_format() -> None:
    assert reset_duration(0) == "0s"
    assert reset_duration(0.0201) == "21ms"
    assert reset_duration(1.5) == "1.5s"
    assert reset_duration(360) == "6m0s"
    assert reset_duration(3723.25) == "1h2m3.25s"


def test_quota_headers_openai_and_ietf_draft() -> None:
    tenant = Tenant("t", None, TenantLimits(requests_per_minute=60, tokens_per_minute=6000))
    headers = dict(quota_headers(specs_for(tenant), [59.4, 5000.0]))
    assert headers[b"x-ratelimit-limit-requests"] == b"60"
    assert headers[b"x-ratelimit-remaining-requests"] == b"59"
    assert headers[b"x-ratelimit-reset-requests"] == b"600ms"
    assert headers[b"x-ratelimit-limit-tokens"] == b"6000"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"5000"
    assert headers[b"x-ratelimit-reset-tokens"] == b"10s"
    assert headers[b"ratelimit-policy"] == b'"requests";q=60;w=60, "tokens";q=6000;w=60'
    assert headers[b"ratelimit"] == b'"requests";r=59;t=1, "tokens";r=5000;t=10'


async def test_quota_holds_exactly_refills_and_refuses_without_charging() -> None:
    clock = ManualClock(1000.0)
    quotas = TenantQuotas(clock=clock)
    tenant = Tenant("t", None, TenantLimits(requests_per_minute=3))
    remaining = []
    for _ in range(3):
        decision = await quotas.take(tenant, 100)
        assert decision.granted
        remaining.append(dict(decision.headers)[b"x-ratelimit-remaining-requests"])
    assert remaining == [b"2", b"1", b"0"]
    refused = await quotas.take(tenant, 100)
    assert not refused.granted
    assert refused.retry_after == pytest.approx(20.0)  # one request per 20 s
    clock.now += 19.9
    assert not (await quotas.take(tenant, 100)).granted
    clock.now += 0.1
    assert (await quotas.take(tenant, 100)).granted


async def test_token_charge_is_corrected_from_usage_and_refunded_when_not_served() -> None:
    clock = ManualClock(1000.0)
    quotas = TenantQuotas(clock=clock)
    tenant = Tenant("t", None, TenantLimits(tokens_per_minute=1000))
    first = await quotas.take(tenant, 400)
    await quotas.settle(first.charge, served=True, status=200, used_tokens=100)
    second = await quotas.take(tenant, 400)
    assert dict(second.headers)[b"x-ratelimit-remaining-tokens"] == b"500"  # 1000 - 100 - 400
    await quotas.settle(second.charge, served=False, status=None, used_tokens=None)
    third = await quotas.take(tenant, 950)
    assert not third.granted  # 900 left
    assert third.retry_after == pytest.approx(50 / (1000 / 60))
    error = await quotas.take(tenant, 900)
    await quotas.settle(error.charge, served=True, status=400, used_tokens=None)  # nothing generated
    broken = await quotas.take(tenant, 900)
    assert broken.granted
    await quotas.settle(broken.charge, served=True, status=200, used_tokens=None)  # stream cut: kept
    assert not (await quotas.take(tenant, 1)).granted
    # An estimate above the burst is capped at the burst instead of never being granted.
    clock.now += 60
    assert (await quotas.take(tenant, 5000)).granted


# --------------------------------------------------------------------------- end to end


@pytest.fixture
def sim() -> Iterator[ServerThread]:
    config = SimConfig(max_num_seqs=4, ttft=0.01, itl=0.002, output_tokens=20, seed=5)
    with ServerThread(create_sim_app(config)) as server:
        yield server


@pytest.fixture
def frozen_shim() -> Iterator[Callable[..., ServerThread]]:
    """A shim whose clock never moves, so bucket levels in headers are exact."""
    servers: list[ServerThread] = []

    def factory(upstream: str, **settings: Any) -> ServerThread:
        values: dict[str, Any] = {"upstream": upstream, "log_level": "warning"}
        values.update(settings)
        app = create_app(ShimSettings(**values), clock=lambda: 5000.0)
        # serve's protocol: a stream's usage is then read on the relay's direct path.
        server = shim_server(app).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 100}


def chat(url: str, key: str, body: dict[str, Any] = BODY, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}", **{k.replace("_", "-"): v for k, v in headers.items()}},
        timeout=30,
    )


def test_tenant_limits_hold_exactly_with_correct_headers(
    sim: ServerThread, frozen_shim: Callable[..., ServerThread], tmp_path: Path
) -> None:
    path = write(tmp_path, {"tenants": [{"name": "small", "key": "sk-small", "requests_per_minute": 3}]})
    shim = frozen_shim(sim.url, tenants_file=str(path), tenant_requests_per_minute=100)
    answers = [chat(shim.url, "sk-small") for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0", "0"]
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"3"}
    assert answers[0].headers["x-ratelimit-reset-requests"] == "20s"
    assert answers[2].headers["x-ratelimit-reset-requests"] == "1m0s"
    assert answers[2].headers["ratelimit-policy"] == '"requests";q=3;w=60'
    assert answers[2].headers["ratelimit"] == '"requests";r=0;t=60'
    refused = answers[3]
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("tenant_rate_limited", "rate_limit_exceeded")
    assert error["retry_after_seconds"] == 20.0
    assert refused.headers["retry-after"] == "20"
    assert refused.headers["retry-after-ms"] == "20000"
    assert key_hash("sk-small") in error["message"]
    assert "sk-small" not in refused.text
    # Another key has its own (default) quota.
    other = chat(shim.url, "sk-other")
    assert other.status_code == 200
    assert other.headers["x-ratelimit-limit-requests"] == "100"
    assert other.headers["x-ratelimit-remaining-requests"] == "99"


def test_token_quota_is_corrected_from_reported_usage(
    sim: ServerThread, frozen_shim: Callable[..., ServerThread]
) -> None:
    shim = frozen_shim(sim.url, tenant_tokens_per_minute=1000)
    estimate = estimate_tokens(json.dumps(BODY).encode(), path="/v1/chat/completions")
    first = chat(shim.url, "sk-t")
    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == str(1000 - estimate)
    used = first.json()["usage"]["total_tokens"]
    assert used < estimate  # 20 generated tokens against an allowance of 100
    second = chat(shim.url, "sk-t")
    assert second.headers["x-ratelimit-remaining-tokens"] == str(1000 - used - estimate)
    stream = chat(shim.url, "sk-t", {**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert stream.status_code == 200
    third = chat(shim.url, "sk-t")
    assert third.headers["x-ratelimit-remaining-tokens"] == str(1000 - 3 * used - estimate)


def test_class_map_and_unknown_or_forbidden_classes(
    sim: ServerThread, make_shim: Callable[..., Any], tmp_path: Path
) -> None:
    path = write(tmp_path, {"tenants": [{"key": "sk-nightly", "classes": ["batch"]}]})
    shim = make_shim(sim.url, tenants_file=str(path))
    assert chat(shim.url, "sk-nightly").status_code == 200
    forbidden = chat(shim.url, "sk-nightly", x_request_class="interactive")
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["code"] == "class_not_allowed"
    assert forbidden.headers["x-llm-backoff-refusal"] == "final-class-not-allowed"
    unknown = chat(shim.url, "sk-nightly", x_request_class="overnight")
    assert unknown.status_code == 400
    assert unknown.json()["error"]["code"] == "invalid_request_class"
    assert chat(shim.url, "sk-someone", x_request_class="interactive").status_code == 200
    samples = shim.metrics()

    def completed(cls: str) -> float:
        return samples[  # type: ignore[no-any-return]
            ("llm_backoff_shim_requests_total", (("class", cls), ("code", ""), ("outcome", "completed")))
        ]

    assert (completed("batch"), completed("interactive")) == (1, 1)


REDIS_URL = os.environ.get("LLM_BACKOFF_TEST_REDIS_URL")


@pytest.mark.redis
@pytest.mark.skipif(not REDIS_URL, reason="LLM_BACKOFF_TEST_REDIS_URL not set")
def test_two_shims_share_one_quota_through_redis(sim: ServerThread, make_shim: Callable[..., Any]) -> None:
    pytest.importorskip("redis")
    key = "sk-" + secrets.token_hex(8)  # fresh buckets for every run
    one = make_shim(sim.url, tenant_requests_per_minute=4, redis_url=REDIS_URL)
    two = make_shim(sim.url, tenant_requests_per_minute=4, redis_url=REDIS_URL)
    statuses = [chat(shim.url, key).status_code for shim in (one, two, one, two, one, two)]
    assert statuses == [200, 200, 200, 200, 429, 429]
    refused = chat(two.url, key)
    assert refused.json()["error"]["code"] == "tenant_rate_limited"
    assert 1 <= int(refused.headers["retry-after"]) <= 15
    assert chat(one.url, "sk-" + secrets.token_hex(8)).status_code == 200


def test_quota_state_is_per_app(sim: ServerThread) -> None:
    # Two apps in one process do not share local buckets (no global state).
    values: dict[str, Any] = {"upstream": sim.url, "tenant_requests_per_minute": 1}
    first = create_app(ShimSettings(**values))
    second = create_app(ShimSettings(**values))
    p1, p2 = shim_state(first).policy, shim_state(second).policy
    assert p1 is not None
    assert p2 is not None
    assert p1.quotas is not None
    assert p2.quotas is not None
    tenant = Tenant("x", None, TenantLimits(requests_per_minute=1))
    assert asyncio.run(p1.quotas.take(tenant, 0)).granted
    assert asyncio.run(p2.quotas.take(tenant, 0)).granted


def test_an_unreachable_redis_answers_503_and_leaks_nothing(
    sim: ServerThread, make_shim: Callable[..., Any], waiter: Callable[..., None]
) -> None:
    pytest.importorskip("redis")
    from llm_backoff_shim.serve.serving import free_socket

    closed = free_socket()
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    shim = make_shim(sim.url, tenant_requests_per_minute=10, redis_url=f"redis://127.0.0.1:{port}/0")
    answer = chat(shim.url, "sk-a")
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["code"] == "upstream_unavailable"
    assert "quota store" in error["message"]
    assert int(answer.headers["retry-after"]) >= 1
    waiter(lambda: shim.state() == {"interactive": (0, 0), "batch": (0, 0)}, what="nothing held")
