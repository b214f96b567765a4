"""A real Prometheus as a child process, scraping shims on loopback, and a client for its query API.

The configuration is the shipped one (``server_shim/deploy/prometheus/prometheus.yml``, with its
rules file), rendered for the run by :func:`render_config`: the shims' loopback addresses as the
targets, a short scrape and rule-evaluation interval, optional target labels (e.g. the
``namespace`` the Prometheus Operator would attach, so Kubernetes queries match as written), and
the rules file by absolute path. :class:`PrometheusServer` starts ``prometheus`` (Debian's package
is ``prometheus``) like any :class:`~llm_backoff_shim.lab.procs.ChildServer`: on a free loopback
port, its TSDB in a temporary directory removed on close, ready once ``/-/ready`` answers.
:class:`PromClient` asks its HTTP API (``/api/v1/query``, ``/api/v1/targets``, ``/api/v1/rules``)
with the standard library.

Reading the shipped YAML needs PyYAML (the test extra of the repository has it); the shipped files
live in the checkout, not in the installed package.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_backoff_shim.lab.procs import ChildServer

#: The shipped Prometheus files (in a checkout of the repository).
DEPLOY_DIR = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"
SHIPPED_CONFIG = DEPLOY_DIR / "prometheus.yml"
SHIPPED_RULES = DEPLOY_DIR / "llm-backoff-rules.yml"
#: The scrape job of the shipped configuration whose targets are the shims.
SHIM_JOB = "llm-backoff-shim"


class PromQueryError(RuntimeError):
    """Prometheus answered a query with an error, or could not be asked."""


def prometheus_binary() -> str | None:
    """Path of the ``prometheus`` executable, or None when it is not installed."""
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )


def duration(seconds: float) -> str:
    """A Prometheus duration (``"1s"``, ``"250ms"``) for ``seconds`` (at least 1 ms)."""
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"a duration must be positive and finite, not {seconds!r}")
    millis = max(1, round(seconds * 1000))
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def _load_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "reading the shipped Prometheus configuration needs PyYAML: pip install pyyaml"
        ) from exc
    return yaml.safe_load(path.read_text())


def render_config(
    targets: Sequence[str],
    *,
    scrape_interval: float = 1.0,
    labels: Mapping[str, str] | None = None,
    config: Path = SHIPPED_CONFIG,
) -> dict[str, Any]:
    """The shipped configuration with ``targets`` (``host:port``) as the shims to scrape.

    Scrape and rule evaluation every ``scrape_interval`` seconds (the scrape timeout bounded by
    it); ``labels`` are attached to every target; relative ``rule_files`` become absolute (the
    rendered file is written elsewhere). Raises ValueError when the file has no job named
    :data:`SHIM_JOB`.
    """
    data: dict[str, Any] = dict(_load_yaml(config))
    every = duration(scrape_interval)
    data["global"] = {**data.get("global", {}), "scrape_interval": every, "evaluation_interval": every}
    data["rule_files"] = [str((config.parent / name).resolve()) for name in data.get("rule_files", [])]
    jobs = []
    found = False
    for job in data.get("scrape_configs", []):
        job = dict(job)
        if job.get("job_name") == SHIM_JOB:
            found = True
            group: dict[str, Any] = {"targets": list(targets)}
            if labels:
                group["labels"] = dict(labels)
            job["static_configs"] = [group]
            job["scrape_interval"] = every
            job["scrape_timeout"] = every
        jobs.append(job)
    if not found:
        raise ValueError(f"{config} has no scrape job named {SHIM_JOB!r}")
    data["scrape_configs"] = jobs
    return data


def host_port(url: str) -> str:
    """``host:port`` of a base URL (a scrape target)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"{url!r} names no host and port")
    return f"{parsed.hostname}:{parsed.port}"


@dataclass(frozen=True)
class Sample:
    """One element of an instant vector (or a scalar, with no labels)."""

    labels: dict[str, str]
    value: float


class PromClient:
    """Prometheus' HTTP query API, synchronously (standard library only)."""

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout

    def _get(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        query = "?" + urllib.parse.urlencode(params) if params else ""
        try:
            with urllib.request.urlopen(self.url + path + query, timeout=self._timeout) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # 400/422: a bad query; the body says why
            try:
                body = json.load(exc)
            except ValueError:
                raise PromQueryError(f"GET {path}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PromQueryError(f"GET {path}: {exc}") from None
        if body.get("status") != "success":
            raise PromQueryError(
                f"GET {path} {dict(params or {})}: {body.get('errorType')}: {body.get('error')}"
            )
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        """Evaluate ``expr`` at ``at`` (Unix seconds; now if None): its samples, or one unlabelled
        sample for a scalar. Values are floats (``NaN`` and ``±Inf`` included)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", params)
        kind = data["resultType"]
        if kind == "vector":
            return [Sample(dict(item["metric"]), float(item["value"][1])) for item in data["result"]]
        if kind == "scalar":
            return [Sample({}, float(data["result"][1]))]
        raise PromQueryError(f"{expr!r} is a {kind}, not an instant vector or a scalar")

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The one value of ``expr``; None when its result is empty. Raises when it has several."""
        samples = self.query(expr, at)
        if not samples:
            return None
        if len(samples) > 1:
            raise PromQueryError(f"{expr!r} has {len(samples)} series, expected one")
        return samples[0].value

    def by(self, expr: str, label: str, at: float | None = None) -> dict[str, float]:
        """``{value of label: sample value}`` of ``expr``'s samples."""
        return {s.labels.get(label, ""): s.value for s in self.query(expr, at)}

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (``labels``, ``scrapeUrl``, ``health``, ``lastScrape``, ...)."""
        data = self._get("/api/v1/targets", {"state": "active"})
        return list(data["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        """Every recording and alerting rule with its ``health`` and ``lastError``."""
        data = self._get("/api/v1/rules")
        return [rule for group in data["groups"] for rule in group["rules"]]

    def wait_for(
        self,
        expr: str,
        predicate: Callable[[list[Sample]], bool],
        *,
        timeout: float = 10.0,
        poll: float = 0.2,
    ) -> list[Sample]:
        """Poll ``expr`` until ``predicate`` holds for its samples; TimeoutError with the last
        answer otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.query(expr)
            if predicate(samples):
                return samples
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{expr!r} did not reach the condition in {timeout:g} s; last: {samples}")
            time.sleep(poll)

    def wait_up(self, targets: Sequence[str], *, timeout: float = 10.0) -> None:
        """Wait until every ``host:port`` in ``targets`` was scraped successfully."""
        wanted = set(targets)
        deadline = time.monotonic() + timeout
        while True:
            up = {t["labels"].get("instance") for t in self.targets() if t.get("health") == "up"}
            if wanted <= up:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"targets not scraped in {timeout:g} s: {sorted(wanted - up)}")
            time.sleep(0.1)


class PrometheusServer(ChildServer):
    """``prometheus`` with the rendered shipped configuration, on a free loopback port.

    ``targets``: the shims' ``host:port`` (:func:`host_port` of their URLs). The TSDB, the
    rendered configuration and the log live in a temporary directory removed by :meth:`close`.
    :meth:`set_targets` rewrites the configuration and reloads it (SIGHUP) without a restart.
    """

    def __init__(
        self,
        targets: Sequence[str],
        *,
        scrape_interval: float = 1.0,
        labels: Mapping[str, str] | None = None,
        config: Path = SHIPPED_CONFIG,
        binary: str | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        found = binary or prometheus_binary()
        if found is None:
            raise FileNotFoundError("prometheus is not installed (Debian/Ubuntu: apt-get install prometheus)")
        self.binary = found
        self.scrape_interval = scrape_interval
        self._labels = dict(labels or {})
        self._config = config
        self._dir = tempfile.TemporaryDirectory(prefix="llm-backoff-prometheus-")
        self.config_path = Path(self._dir.name) / "prometheus.yml"
        self.targets: list[str] = []
        self._write(targets)
        super().__init__("prometheus", self._command, health_path="/-/ready", start_timeout=start_timeout)

    def _write(self, targets: Sequence[str]) -> None:
        rendered = render_config(
            targets, scrape_interval=self.scrape_interval, labels=self._labels, config=self._config
        )
        # JSON is YAML: no writer needed. Written whole, then renamed, so a reload never reads half.
        partial = self.config_path.with_suffix(".tmp")
        partial.write_text(json.dumps(rendered, indent=2))
        partial.replace(self.config_path)
        self.targets = list(targets)

    def _command(self, port: int) -> list[str]:
        data = Path(self._dir.name) / "data"
        return [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address={self.host}:{port}",
            "--log.level=warn",
        ]

    @property
    def client(self) -> PromClient:
        return PromClient(self.url)

    def set_targets(self, targets: Sequence[str]) -> None:
        """Scrape ``targets`` from now on (configuration rewritten, then SIGHUP)."""
        self._write(targets)
        if self.pid is not None:
            os.kill(self.pid, signal.SIGHUP)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._dir.cleanup()


__all__ = [
    "DEPLOY_DIR",
    "SHIM_JOB",
    "SHIPPED_CONFIG",
    "SHIPPED_RULES",
    "PromClient",
    "PromQueryError",
    "PrometheusServer",
    "Sample",
    "duration",
    "host_port",
    "prometheus_binary",
    "render_config",
]
