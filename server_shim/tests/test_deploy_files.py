"""Static checks of the deployment artefacts in server_shim/deploy/ and docs/deploy.md.

No container engine is available in CI, so nothing here builds or runs an image.
Instead each file is parsed and checked against what the shim really offers: the
`serve` flags and their LLM_BACKOFF_SHIM_* variables, the metric names, the ports
and health endpoints, and the cross-references between the files (the compose
file's upstream must be the vLLM service's port, the Kubernetes user id must be
the image's, every dashboard query must name a metric the shim exports, ...).
Where a real validator exists on the machine (`docker compose config`,
`systemd-analyze verify`) it is run as well, and the test is skipped without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llm_backoff_shim.lab import procs
from llm_backoff_shim.serve.config.settings import ShimSettings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "server_shim" / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_SPARK = DEPLOY / "docker-compose.dgx-spark.yml"
ENV_EXAMPLE = DEPLOY / "shim.env.example"
UNIT = DEPLOY / "systemd" / "llm-backoff-shim.service"
K8S = DEPLOY / "kubernetes"
DASHBOARD = DEPLOY / "grafana" / "llm-backoff-shim-dashboard.json"
DEPLOY_DOC = REPO / "docs" / "deploy.md"

# The `llm-backoff-shim serve` flags (the shim's CLI contract); each is also read
# from LLM_BACKOFF_SHIM_<FLAG>.
SERVE_FLAGS = (
    "upstream",
    "host",
    "port",
    "max-concurrency",
    "max-queue",
    "max-queue-wait",
    "reject-status",
    "retry-after-min",
    "retry-after-max",
)
ENV_PREFIX = "LLM_BACKOFF_SHIM_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.upper().replace("-", "_")


KNOWN_ENV = frozenset(env_name(f) for f in SERVE_FLAGS)

# The shim's Prometheus metrics and their labels.
SCALAR_METRICS = frozenset(
    {
        "llm_backoff_shim_requests_total",
        "llm_backoff_shim_attempts_total",
        "llm_backoff_shim_rescues_total",
        "llm_backoff_shim_in_flight",
        "llm_backoff_shim_queue_depth",
        "llm_backoff_shim_drain_rate_per_second",
        "llm_backoff_shim_slo_state",
    }
)
HISTOGRAMS = frozenset(
    {
        "llm_backoff_shim_queue_wait_seconds",
        "llm_backoff_shim_time_to_first_byte_seconds",
        "llm_backoff_shim_retry_after_seconds",
    }
)
SHIM_LABELS = frozenset({"class", "outcome", "code"})
# Labels Prometheus adds at scrape time (job/instance, Kubernetes service discovery).
SCRAPE_LABELS = frozenset({"job", "instance", "namespace", "pod", "container"})
REQUEST_CLASSES = frozenset({"interactive", "batch"})
# Values of llm_backoff_shim_requests_total's labels: `code` is the rejection's
# error code (DESIGN.md), empty for requests that were not rejected.
OUTCOMES = frozenset({"admitted", "completed", "client_disconnected", "upstream_error", "rejected"})
REJECTION_CODES = frozenset(
    {"queue_full", "queue_timeout", "slo_shed", "tenant_rate_limited", "upstream_unavailable"}
)
LABEL_VALUES = {"class": REQUEST_CLASSES, "outcome": OUTCOMES, "code": REJECTION_CODES | {""}}


# --------------------------------------------------------------------------- helpers


def exported_series() -> frozenset[str]:
    suffixes = ("_bucket", "_sum", "_count")
    return SCALAR_METRICS | {h + s for h in HISTOGRAMS for s in suffixes}


_PROMQL_WORDS = frozenset(
    {
        "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "delta",
        "histogram_quantile", "clamp_min", "clamp_max", "vector", "scalar", "abs",
        "by", "without", "on", "ignoring", "group_left", "group_right",
        "or", "and", "unless", "bool", "offset", "time", "topk", "bottomk",
    }
)  # fmt: skip
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def promql_problems(expr: str) -> list[str]:
    """What in a PromQL expression names something the shim does not export.

    A small lexer rather than a PromQL parser: strings, ranges and Grafana
    variables are removed, label names are collected from matchers and grouping
    clauses, and every remaining identifier that is not a PromQL function or
    keyword must be one of the shim's series.
    """
    problems: list[str] = []
    text = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", text):
        labels.update(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    text = re.sub(r"\{[^}]*\}", "", text)
    for group in _GROUPING.findall(text):
        labels.update(label.strip() for label in group.split(",") if label.strip())
    text = _GROUPING.sub("", text)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    names = set(re.findall(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text)) - _PROMQL_WORDS
    if not names:
        problems.append(f"no metric in {expr!r}")
    problems += [f"unknown series {name!r}" for name in sorted(names - exported_series())]
    allowed_labels = SHIM_LABELS | SCRAPE_LABELS | {"le"}
    problems += [f"unknown label {label!r}" for label in sorted(labels - allowed_labels)]
    if "histogram_quantile" in text:
        if not any(name.endswith("_bucket") for name in names):
            problems.append(f"histogram_quantile without a _bucket series in {expr!r}")
        if "le" not in labels:
            problems.append(f"histogram_quantile must keep the le label: {expr!r}")
    for label, values in label_values_used(expr).items():
        unknown = values - LABEL_VALUES.get(label, values)
        problems += [f"{label}={value!r} is never exported" for value in sorted(unknown)]
    return problems


def label_values_used(expr: str) -> dict[str, set[str]]:
    """{label: values} matched by `label="v"` / `label=~"a|b"` (Grafana variables skipped)."""
    used: dict[str, set[str]] = {}
    for label, op, value in re.findall(r'([A-Za-z_]\w*)\s*(=~|=)\s*"([^"]*)"', expr):
        if "$" in value:
            continue
        values = set(value.split("|")) if op == "=~" else {value}
        used.setdefault(label, set()).update(values)
    return used


_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose-style `${VAR:-default}` with an empty environment (the defaults)."""
    if isinstance(value, str):
        assert "${" not in _INTERPOLATION.sub("", value), f"unsupported interpolation in {value!r}"
        return _INTERPOLATION.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = interpolate(load_yaml(COMPOSE))
    return data


def env_mapping(environment: Any) -> dict[str, str]:
    if isinstance(environment, dict):
        return {str(k): str(v) for k, v in environment.items()}
    return dict(item.split("=", 1) for item in environment or [])


def flag_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def parse_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=value: {raw!r}"
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"bad key {key!r}"
        assert not value.startswith(("'", '"')), "systemd and compose quote differently: leave values bare"
        assert key not in out, f"{key} set twice"
        out[key] = value
    return out


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined: list[str] = []
    buf = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        if buf.strip():
            joined.append(buf.strip())
        buf = ""
    assert not buf.strip(), "dangling line continuation"
    out = []
    for line in joined:
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def dockerfile_stages() -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """Global ARG defaults, and the instructions of each stage (FROM first)."""
    global_args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            stages.append([(keyword, args)])
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].append((keyword, args))
    return global_args, stages


def stage_args(stage: list[tuple[str, str]], inherited: dict[str, str]) -> dict[str, str]:
    values = dict(inherited)
    for keyword, args in stage:
        if keyword == "ARG":
            name, _, default = args.partition("=")
            values[name] = default
    return values


def expand(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], text)


def dockerignore_included(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or a parent wins."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        regex = "".join(
            ".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]" if tok == "?" else re.escape(tok)
            for tok in re.findall(r"\*\*|\*|\?|[^*?]+", pattern)
        )
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            included = negate
    return included


def dockerignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def systemd_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """The unit as {section: [(key, value), ...]}; keys may repeat in systemd."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        header = re.fullmatch(r"\[(\w+)\]", line)
        if header:
            current = header.group(1)
            sections.setdefault(current, [])
            continue
        assert current is not None, f"key outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not Key=value: {raw!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def k8s_objects() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += load_yaml_docs(path)
    return docs


def find(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def all_env_names() -> Iterator[tuple[str, str]]:
    """(where, name) for every LLM_BACKOFF_SHIM_* variable any artefact sets."""
    for name in parse_env_file(ENV_EXAMPLE):
        yield ENV_EXAMPLE.name, name
    for name in env_mapping(compose()["services"]["shim"].get("environment")):
        yield COMPOSE.name, name
    for deployment in find(k8s_objects(), "Deployment"):
        for env in containers(deployment)["shim"].get("env", []):
            yield "kubernetes", env["name"]
    for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if keyword == "ENV":
            for name in re.findall(r"(\w+)=", args):
                yield DOCKERFILE.name, name


# --------------------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(
    "expr",
    [
        "sum(vllm:num_requests_waiting)",
        "rate(llm_backoff_shim_queue_depth_bucket[1m])",
        "sum by (tenant) (llm_backoff_shim_in_flight)",
        "histogram_quantile(0.9, sum(rate(llm_backoff_shim_queue_wait_seconds_bucket[1m])))",
        'llm_backoff_shim_queue_depth{class="bulk"}',
        "llm_backoff_shim_queue_wait",
        'sum(rate(llm_backoff_shim_requests_total{code=~"429|503"}[5m]))',
        'llm_backoff_shim_requests_total{outcome="shed"}',
    ],
)
def test_promql_check_flags_what_the_shim_does_not_export(expr: str) -> None:
    assert promql_problems(expr)


@pytest.mark.parametrize(
    ("path", "included"),
    [
        ("src/llm_backoff/__init__.py", True),
        ("server_shim/src/llm_backoff_shim/serve/serving.py", True),
        ("pyproject.toml", True),
        ("README.md", True),
        ("server_shim/pyproject.toml", True),
        (".venv/bin/python", False),
        ("tests/sdk/conftest.py", False),
        ("server_shim/tests/test_deploy_files.py", False),
        ("src/llm_backoff/__pycache__/x.cpython-311.pyc", False),
        (".git/HEAD", False),
    ],
)
def test_build_context_holds_only_the_two_distributions(path: str, included: bool) -> None:
    assert dockerignore_included(path, dockerignore_patterns()) is included


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_base_images_are_pinned() -> None:
    global_args, stages = dockerfile_stages()
    stage_names: set[str] = set()
    for stage in stages:
        ref, _, alias = stage[0][1].partition(" AS ")
        image = expand(ref.strip(), global_args)
        if image not in stage_names:
            name, _, digest = image.partition("@")
            tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
            assert digest or (tag and tag != "latest"), f"unpinned base image {image!r}"
        if alias:
            stage_names.add(alias.strip())
    assert len(stages) >= 2, "multi-stage: build tools stay out of the runtime image"


def test_dockerfile_runtime_stage_is_non_root_with_healthcheck() -> None:
    global_args, stages = dockerfile_stages()
    final = stages[-1]
    values = stage_args(final, global_args)
    users = [expand(args, values) for keyword, args in final if keyword == "USER"]
    assert users, "the runtime stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0", ""}, f"runs as {users[-1]!r}"
    keywords = [keyword for keyword, _ in final]
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k in {"RUN", "COPY"})
    (healthcheck,) = [args for keyword, args in final if keyword == "HEALTHCHECK"]
    assert "NONE" not in healthcheck
    assert "/health" in healthcheck
    assert ("EXPOSE", "8080") in final
    entrypoint = [args for keyword, args in final if keyword == "ENTRYPOINT"]
    assert entrypoint == ['["llm-backoff-shim"]'], "exec form, so signals reach the server"
    assert [args for keyword, args in final if keyword == "CMD"] == ['["serve"]']


def test_dockerfile_user_matches_kubernetes_run_as_user() -> None:
    global_args, stages = dockerfile_stages()
    values = stage_args(stages[-1], global_args)
    uid = int(expand([a for k, a in stages[-1] if k == "USER"][-1], values).split(":")[0])
    (deployment,) = find(k8s_objects(), "Deployment")
    assert containers(deployment)["shim"]["securityContext"]["runAsUser"] == uid


def test_dockerfile_copies_exist_and_survive_the_dockerignore() -> None:
    patterns = dockerignore_patterns()
    copied: list[str] = []
    for stage in dockerfile_stages()[1]:
        for keyword, args in stage:
            if keyword != "COPY" or args.startswith("--from"):
                continue
            *sources, _dest = args.split()
            copied += sources
    assert copied
    for source in copied:
        path = REPO / source
        assert path.exists(), f"COPY {source}: not in the repository (build context = repo root)"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
        assert files, f"COPY {source}: nothing to copy"
        for file in files:
            rel = file.relative_to(REPO).as_posix()
            assert dockerignore_included(rel, patterns), f"{rel} is copied but excluded by the dockerignore"
    # Hatchling reads the root project's readme: it must be in the context.
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert readme is not None
    assert readme.group(1) in copied
    for dist in ("src/llm_backoff", "server_shim/src/llm_backoff_shim"):
        assert any(dist.startswith(s.rstrip("/")) for s in copied), f"{dist} is not copied"


def test_dockerfile_installs_the_shim_without_its_lab_extra() -> None:
    runs = [args for stage in dockerfile_stages()[1] for k, args in stage if k == "RUN"]
    installs = [step for args in runs for step in args.split("&&") if "pip install" in step]
    assert installs, "the build stage installs the two distributions with pip"
    for step in installs:
        assert "./server_shim" in step
        assert "[lab]" not in step, "the image serves; the plots are the lab's"
        assert "matplotlib" not in step
    checks = [step for args in runs for step in args.split("&&") if "find_spec" in step]
    assert checks, "the build checks that no plotting library came in"
    assert "'matplotlib'" in checks[0]
    assert "MPLCONFIGDIR" not in DOCKERFILE.read_text()
    assert "MPLCONFIGDIR" not in (DEPLOY / "systemd" / "llm-backoff-shim.service").read_text()


def test_dockerfile_env_uses_real_shim_settings() -> None:
    names = [n for where, n in all_env_names() if where == DOCKERFILE.name and n.startswith(ENV_PREFIX)]
    assert set(names) == {env_name("host"), env_name("port")}
    assert set(names) <= KNOWN_ENV


# --------------------------------------------------------------------------- docker compose


def test_compose_runs_vllm_behind_the_shim_and_publishes_only_the_shim() -> None:
    services = compose()["services"]
    assert set(services) == {"vllm", "shim"}
    assert "ports" not in services["vllm"], "vLLM must not be published: clients go through the shim"
    published = services["shim"]["ports"]
    assert len(published) == 1
    parts = str(published[0]).split(":")
    assert len(parts) == 3, f"expected ADDR:HOSTPORT:8080, got {published[0]!r}"
    assert parts[-1] == "8080"
    assert parts[0] == "127.0.0.1", "default: loopback only; SHIM_PUBLISH_ADDR opens it up"


def test_compose_shim_points_at_the_vllm_service() -> None:
    services = compose()["services"]
    vllm_port = flag_value(services["vllm"]["command"], "--port")
    assert vllm_port in [str(p) for p in services["vllm"]["expose"]]
    env = env_mapping(services["shim"]["environment"])
    assert env[env_name("upstream")] == f"http://vllm:{vllm_port}"
    assert env[env_name("host")] == "0.0.0.0"
    assert env[env_name("port")] == str(services["shim"]["ports"][0]).split(":")[-1]
    assert services["shim"]["depends_on"]["vllm"]["condition"] in {"service_started", "service_healthy"}


def test_compose_services_have_healthchecks_on_their_health_endpoints() -> None:
    services = compose()["services"]
    for name, port in (("vllm", flag_value(services["vllm"]["command"], "--port")), ("shim", "8080")):
        check = services[name]["healthcheck"]
        assert check["test"][0] == "CMD"
        assert f"127.0.0.1:{port}/health" in " ".join(check["test"]), name
        assert re.fullmatch(r"\d+[smh]", check["start_period"])


def test_compose_builds_the_shim_from_the_repository_root() -> None:
    build = compose()["services"]["shim"]["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == REPO
    assert (context / build["dockerfile"]).resolve() == DOCKERFILE


def test_compose_env_file_is_the_example_and_vllm_has_room_for_the_shim() -> None:
    shim = compose()["services"]["shim"]
    (env_file,) = shim["env_file"]
    assert env_file["required"] is False, "starts without a shim.env (defaults apply)"
    assert (COMPOSE.parent / (env_file["path"] + ".example")).resolve() == ENV_EXAMPLE
    example = parse_env_file(ENV_EXAMPLE)
    max_num_seqs = int(flag_value(compose()["services"]["vllm"]["command"], "--max-num-seqs"))
    assert int(example[env_name("max-concurrency")]) <= max_num_seqs


def test_compose_vllm_image_is_pinned() -> None:
    for path, key in ((COMPOSE, "vllm"), (COMPOSE_SPARK, "vllm")):
        image = interpolate(load_yaml(path))["services"][key]["image"]
        assert ":" in image, f"{path.name}: untagged {image}"
        assert not image.endswith(":latest"), f"{path.name}: {image}"


def test_dgx_spark_override_only_swaps_the_engine() -> None:
    override = interpolate(load_yaml(COMPOSE_SPARK))
    assert set(override["services"]) == {"vllm"}
    vllm = override["services"]["vllm"]
    assert set(vllm) == {"image", "command"}
    assert vllm["image"].startswith("nvcr.io/nvidia/vllm:")
    assert vllm["command"][:2] == ["vllm", "serve"]
    base = compose()["services"]["vllm"]["command"]
    for flag in ("--port", "--host", "--max-num-seqs"):
        assert flag_value(vllm["command"], flag) == flag_value(base, flag)


def _docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _docker_compose_available(), reason="docker compose plugin not installed")
@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_SPARK]], ids=["base", "dgx-spark"])
def test_docker_compose_config_accepts_the_files(files: list[Path]) -> None:
    args = [arg for f in files for arg in ("-f", str(f))]
    result = subprocess.run(
        ["docker", "compose", *args, "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=DEPLOY,
    )
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- environment names


def test_env_example_sets_every_serve_flag_with_sane_values() -> None:
    env = parse_env_file(ENV_EXAMPLE)
    # Every flag but the queue bound, which it leaves to the shim (what the engine drains
    # within the wait) and names in a comment.
    assert set(env) == KNOWN_ENV - {env_name("max-queue")}
    assert f"# {env_name('max-queue')}=" in ENV_EXAMPLE.read_text()
    assert env[env_name("upstream")].startswith("http://")
    assert int(env[env_name("reject-status")]) in {429, 503}
    for flag in ("port", "max-concurrency"):
        assert int(env[env_name(flag)]) > 0
    low, high = float(env[env_name("retry-after-min")]), float(env[env_name("retry-after-max")])
    assert 1 <= low <= high
    assert float(env[env_name("max-queue-wait")]) > 0


def test_every_shim_variable_in_the_artefacts_is_one_the_shim_reads() -> None:
    seen = [(where, name) for where, name in all_env_names() if name.startswith(ENV_PREFIX)]
    assert seen
    unknown = [(where, name) for where, name in seen if name not in KNOWN_ENV]
    assert not unknown


def _serve_help() -> str | None:
    """`llm-backoff-shim serve --help` from the installed CLI, or None before it exists."""
    script = Path(sys.executable).with_name("llm-backoff-shim")
    if not script.exists():
        return None
    result = subprocess.run(
        [str(script), "serve", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        return None
    return result.stdout


def test_serve_flags_match_the_installed_cli() -> None:
    help_text = _serve_help()
    if help_text is None:
        pytest.skip("llm-backoff-shim serve --help is not available in this checkout yet")
    offered = set(re.findall(r"--([a-z][a-z0-9-]*)", help_text))
    missing = [flag for flag in SERVE_FLAGS if flag not in offered]
    assert not missing, f"flags the deployment files rely on but `serve` lacks: {missing}"


# --------------------------------------------------------------------------- systemd


def test_systemd_unit_structure() -> None:
    sections = systemd_sections(UNIT.read_text())
    assert {"Unit", "Service", "Install"} <= set(sections)
    service = dict(sections["Service"])
    exec_start = service["ExecStart"].split()
    assert Path(exec_start[0]).name == "llm-backoff-shim"
    assert exec_start[1:] == ["serve"]
    assert service.get("DynamicUser") == "yes" or service.get("User") not in {None, "root", "0"}
    assert service["EnvironmentFile"].lstrip("-") == "/etc/llm-backoff-shim/shim.env"
    assert service["Restart"] in {"on-failure", "always"}
    assert ("WantedBy", "multi-user.target") in sections["Install"]
    assert "network-online.target" in dict(sections["Unit"])["After"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    # verify insists the ExecStart binary exists; stand in for the venv's script.
    stub = tmp_path / "llm-backoff-shim"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    text = UNIT.read_text()
    original = dict(systemd_sections(text)["Service"])["ExecStart"].split()[0]
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(original, str(stub)))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    # Unknown keys and bad values are only warnings (exit 0), so any line about our unit fails.
    about_unit = [line for line in (result.stdout + result.stderr).splitlines() if unit.name in line]
    assert result.returncode == 0, result.stdout + result.stderr
    assert not about_unit, about_unit


def _seconds(text: str) -> float:
    """``35s``, ``1m`` or ``60`` (seconds) as a number of seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m)?", str(text).strip())
    assert match, text
    return float(match.group(1)) * (60 if match.group(2) == "m" else 1)


def test_every_stop_timeout_leaves_the_shim_its_drain() -> None:
    """On SIGTERM the shim finishes the calls it holds for up to its graceful limit: systemd,
    compose and Kubernetes must wait longer than that before they kill it."""
    from llm_backoff_shim.serve.command import uvicorn_options

    drain = float(uvicorn_options(ShimSettings())["timeout_graceful_shutdown"])
    unit = dict(systemd_sections(UNIT.read_text())["Service"])
    (deployment,) = find(k8s_objects(), "Deployment")
    waits = {
        "systemd TimeoutStopSec": _seconds(unit["TimeoutStopSec"]),
        "compose stop_grace_period": _seconds(compose()["services"]["shim"]["stop_grace_period"]),
        "terminationGracePeriodSeconds": float(
            deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        ),
    }
    assert all(wait > drain for wait in waits.values()), (drain, waits)


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)"
)
@pytest.mark.parametrize("interval", ["1s", "5s", "15s", "60s"])
def test_the_prometheus_config_holds_at_any_scrape_interval(interval: str, tmp_path: Path) -> None:
    """An operator shortens or lengthens the scrape interval: the scrape config stays valid."""
    shipped = DEPLOY / "prometheus"
    text = (shipped / "prometheus.yml").read_text()
    assert "scrape_interval: 15s" in text
    (tmp_path / "prometheus.yml").write_text(
        text.replace("scrape_interval: 15s", f"scrape_interval: {interval}")
    )
    shutil.copy(shipped / "llm-backoff-rules.yml", tmp_path / "llm-backoff-rules.yml")
    result = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- Kubernetes and KEDA


def test_kubernetes_service_exposes_only_the_shim() -> None:
    objects = k8s_objects()
    (deployment,) = find(objects, "Deployment")
    by_name = containers(deployment)
    assert set(by_name) == {"vllm", "shim"}
    shim_ports = {p["name"]: p["containerPort"] for p in by_name["shim"]["ports"]}
    engine_ports = {p["name"]: p["containerPort"] for p in by_name["vllm"]["ports"]}
    for service in find(objects, "Service"):
        assert (
            service["spec"]["selector"].items()
            <= deployment["spec"]["template"]["metadata"]["labels"].items()
        )
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in shim_ports or target in shim_ports.values(), f"Service targets {target!r}"
            assert target not in engine_ports
            assert target not in engine_ports.values()


def test_kubernetes_shim_sidecar_wiring() -> None:
    (deployment,) = find(k8s_objects(), "Deployment")
    by_name = containers(deployment)
    shim, vllm = by_name["shim"], by_name["vllm"]
    env = {e["name"]: e["value"] for e in shim["env"]}
    engine_port = vllm["ports"][0]["containerPort"]
    assert str(engine_port) == flag_value(vllm["args"], "--port")
    assert env[env_name("upstream")] == f"http://127.0.0.1:{engine_port}"
    assert int(env[env_name("port")]) == shim["ports"][0]["containerPort"]
    assert int(env[env_name("max-concurrency")]) <= int(flag_value(vllm["args"], "--max-num-seqs"))
    assert shim["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert shim["livenessProbe"]["httpGet"]["path"] == "/health"
    security = shim["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == shim["ports"][0]["containerPort"]
    assert annotations["prometheus.io/path"] == "/metrics"


def test_podmonitor_scrapes_the_shim_port() -> None:
    objects = k8s_objects()
    (deployment,) = find(objects, "Deployment")
    (monitor,) = find(objects, "PodMonitor")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in containers(deployment)["shim"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_keda_scaled_object_scales_the_deployment_on_shim_metrics() -> None:
    objects = k8s_objects()
    (deployment,) = find(objects, "Deployment")
    (scaled,) = find(objects, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    # The CRD's field names (a typo would be dropped by the API server, not rejected).
    spec_fields = {
        "scaleTargetRef", "minReplicaCount", "maxReplicaCount", "idleReplicaCount", "pollingInterval",
        "cooldownPeriod", "initialCooldownPeriod", "advanced", "fallback", "triggers",
    }  # fmt: skip
    trigger_fields = {"type", "name", "metadata", "metricType", "useCachedMetrics", "authenticationRef"}
    assert set(spec) <= spec_fields
    assert all(set(trigger) <= trigger_fields for trigger in spec["triggers"])
    assert set(spec["advanced"]) <= {"horizontalPodAutoscalerConfig", "restoreToOriginalReplicaCount"}
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    queries = []
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        assert trigger.get("metricType", "AverageValue") in {"AverageValue", "Value"}
        meta = trigger["metadata"]
        assert meta["serverAddress"].startswith(("http://", "https://"))
        assert float(meta["threshold"]) > 0
        assert 0 <= float(meta.get("activationThreshold", "0")) < float(meta["threshold"])
        assert not promql_problems(meta["query"]), promql_problems(meta["query"])
        # Scrape labels differ between the Prometheus Operator and a static config: the
        # queries select on none, so they read the fleet under either (test_scaling_signals).
        assert not set(label_values_used(meta["query"])) & SCRAPE_LABELS, meta["query"]
        queries.append(meta["query"])
    assert any("llm_backoff_shim_queue_depth" in q for q in queries)
    assert any("llm_backoff_shim_queue_wait_seconds_bucket" in q for q in queries)
    # Scale-up must start before the shim starts rejecting for a full queue: the example's
    # queue holds what its slots drain within the wait at the prior's service time.
    depth = next(t for t in spec["triggers"] if "queue_depth" in t["metadata"]["query"])
    env = parse_env_file(ENV_EXAMPLE)
    prior = ShimSettings.model_fields["initial_service_time"].default
    max_queue = int(env[env_name("max-concurrency")]) * float(env[env_name("max-queue-wait")]) / prior
    assert float(depth["metadata"]["threshold"]) < max_queue


# --------------------------------------------------------------------------- Grafana


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def test_dashboard_queries_use_only_shim_metrics() -> None:
    exprs = [t["expr"] for p in _panels(_dashboard()) for t in p.get("targets", [])]
    assert len(exprs) >= 8
    problems = {expr: promql_problems(expr) for expr in exprs}
    assert not {e: p for e, p in problems.items() if p}


def test_dashboard_shows_every_shim_metric() -> None:
    text = " ".join(t["expr"] for p in _panels(_dashboard()) for t in p.get("targets", []))
    missing = [m for m in sorted(SCALAR_METRICS | HISTOGRAMS) if m not in text]
    assert not missing


def test_dashboard_structure_and_variables() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"]
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    definition = variables["class"]["definition"]
    match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", definition)
    assert match
    assert match.group(1) in SCALAR_METRICS
    assert match.group(2) == "class"
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs
        assert len(refs) == len(set(refs))
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area


def test_dashboard_slo_state_maps_the_three_states() -> None:
    (panel,) = [p for p in _panels(_dashboard()) if "llm_backoff_shim_slo_state" in str(p.get("targets"))]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    assert {k: v["text"] for k, v in mapping["options"].items()} == {"0": "green", "1": "yellow", "2": "red"}


# --------------------------------------------------------------------------- docs/deploy.md


def test_deploy_doc_references_files_flags_and_metrics_that_exist() -> None:
    doc = DEPLOY_DOC.read_text()
    paths = set(re.findall(r"(?<![\w/.-])((?:server_shim|docs)/[\w./-]+[\w])", doc))
    assert paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing
    help_text = _serve_help()
    flags = {*SERVE_FLAGS, "help"}
    if help_text is not None:
        flags |= set(re.findall(r"--([a-z][a-z0-9-]*)", help_text))
    for command in re.findall(r"llm-backoff-shim serve((?:[^\n]|\\\n)*)", doc):
        for flag in re.findall(r"--([a-z][a-z0-9-]*)", command):
            assert flag in flags, f"`serve --{flag}` is not a shim flag"
    for name in set(re.findall(r"\bLLM_BACKOFF_SHIM_[A-Z_]+\b", doc)):
        assert name in {env_name(f) for f in flags}, name
    # Recording rules (`level:metric:operations`) are named in the shipped rules file instead.
    for metric in set(re.findall(r"(?<![:\w])llm_backoff_shim_\w+(?!\w|:)", doc)):
        assert metric in exported_series() | HISTOGRAMS, metric
    rules = (DEPLOY / "prometheus" / "llm-backoff-rules.yml").read_text()
    for recorded in set(re.findall(r"\b\w+:llm_backoff_shim_\w+:\w+|\binstance:llm_backoff_shim_\w+", doc)):
        assert f"record: {recorded}\n" in rules, recorded


# ----------------------------------------------------- the real shim, configured by the example


def _free_port() -> int:
    return procs.free_port()


def _wait_for(url: str, deadline_s: float) -> httpx.Response:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            response = httpx.get(url, timeout=2, trust_env=False)
            if response.status_code == 200:
                return response
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {deadline_s} s")
        time.sleep(0.1)


@contextlib.contextmanager
def _process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    # Output goes to a file: an unread pipe could fill and stall the server.
    with log.open("wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _image_healthcheck(port: int) -> int:
    """Exit status of the Dockerfile's HEALTHCHECK command, run here against `port`."""
    (healthcheck,) = [a for k, a in dockerfile_stages()[1][-1] if k == "HEALTHCHECK"]
    command = json.loads(healthcheck[healthcheck.index("CMD") + len("CMD") :].strip())
    assert command[0] == "python"
    env = {**os.environ, env_name("port"): str(port)}
    result = subprocess.run(
        [sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False
    )
    return result.returncode


def test_env_example_configures_a_real_shim_that_exports_the_dashboard_metrics(tmp_path: Path) -> None:
    """Start `serve` from the example env file (upstream: the built-in simulator) and
    check that the settings are accepted and /metrics has every metric the dashboard
    and the KEDA triggers query, with the type the queries assume."""
    script = Path(sys.executable).with_name("llm-backoff-shim")
    if _serve_help() is None:
        pytest.skip("llm-backoff-shim serve is not available in this checkout yet")
    sim_port, shim_port = _free_port(), _free_port()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    shim_env = {
        **base_env,
        **parse_env_file(ENV_EXAMPLE),
        env_name("upstream"): f"http://127.0.0.1:{sim_port}",
        env_name("port"): str(shim_port),
        "LLM_BACKOFF_SHIM_LOG_LEVEL": "warning",
    }
    sim_args = [str(script), "sim", "--port", str(sim_port), "--ttft", "0.01", "--output-tokens", "4"]
    sim_log, shim_log = tmp_path / "sim.log", tmp_path / "shim.log"
    with _process(sim_args, base_env, sim_log), _process([str(script), "serve"], shim_env, shim_log):
        base = f"http://127.0.0.1:{shim_port}"
        try:
            _wait_for(f"{base}/health", 30)
            _wait_for(f"{base}/ready", 30)
        except TimeoutError as exc:
            logs = f"shim:\n{shim_log.read_text()}\nsim:\n{sim_log.read_text()}"
            raise AssertionError(f"{exc}; settings from {ENV_EXAMPLE.name}\n{logs}") from None
        completion = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
            trust_env=False,
        )
        assert completion.status_code == 200, completion.text
        exposition = httpx.get(f"{base}/metrics", timeout=5, trust_env=False).text
        assert _image_healthcheck(shim_port) == 0, "the image's HEALTHCHECK fails on a healthy shim"
    assert _image_healthcheck(shim_port) != 0, "the image's HEALTHCHECK passes with no shim running"
    parsed = list(text_string_to_metric_families(exposition))
    families = {f.name: f.type for f in parsed}
    exported: dict[str, set[str]] = {}
    for family in parsed:
        for sample in family.samples:
            for label, value in sample.labels.items():
                exported.setdefault(label, set()).add(value)
    queries = [t["expr"] for p in _panels(_dashboard()) for t in p.get("targets", [])]
    queries += [t["metadata"]["query"] for t in find(k8s_objects(), "ScaledObject")[0]["spec"]["triggers"]]
    for query in queries:
        for label, values in label_values_used(query).items():
            if label in SHIM_LABELS:
                assert values <= exported.get(label, set()), f"{label}={values - exported.get(label, set())}"
    for metric in sorted(SCALAR_METRICS | HISTOGRAMS):
        if metric in HISTOGRAMS:
            assert families.get(metric) == "histogram", metric
        elif metric.endswith("_total"):
            assert families.get(metric.removesuffix("_total")) == "counter", metric
        else:
            assert families.get(metric) == "gauge", metric
