"""The shipped nginx and HAProxy configurations, checked by nginx and HAProxy themselves.

``nginx -t`` and ``haproxy -c`` on the files users copy and on the renderings the loopback fleet
runs; the renderings differ from the shipped files only in addresses, ports and the log target
(so the end-to-end tests exercise what is shipped); the features the recipe relies on are in
the files; a shipped file without the lines the renderer replaces is a clear error.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
from pathlib import Path

import pytest

from llm_backoff_shim.lab.fleet import LoadBalancer
from llm_backoff_shim.lab.fleet_configs import (
    HAPROXY_CONFIG,
    NGINX_CONFIG,
    ConfigShapeError,
    lb_binary,
    nginx_main_config,
    render_haproxy,
    render_nginx,
)

DEPLOY_DOC = Path(__file__).resolve().parents[3] / "docs" / "deploy.md"


def binary(lb: str) -> str:
    found = lb_binary(lb)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{lb} is not installed, and CI must run this test (scripts/test.sh installs it)")
        pytest.skip(f"{lb} is not installed (apt-get install {lb})")
    return found


def check(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_shipped_nginx_file_passes_nginx_t(tmp_path: Path) -> None:
    nginx = binary("nginx")
    (tmp_path / "nginx.conf").write_text(nginx_main_config(tmp_path, NGINX_CONFIG))
    out = check([nginx, "-p", str(tmp_path), "-e", "stderr", "-c", str(tmp_path / "nginx.conf"), "-t"])
    assert "test is successful" in out


def test_shipped_haproxy_file_passes_haproxy_c() -> None:
    out = check([binary("haproxy"), "-c", "-f", str(HAPROXY_CONFIG)])
    assert "valid" in out


@pytest.mark.parametrize("lb", ["nginx", "haproxy"])
@pytest.mark.parametrize("replicas", [1, 2, 5])
def test_rendered_configurations_pass_their_checker(lb: str, replicas: int, tmp_path: Path) -> None:
    binary(lb)
    addresses = [f"127.0.0.1:{18080 + i}" for i in range(replicas)]
    balancer = LoadBalancer(lb, addresses, tmp_path, port=18000)
    balancer.check_config()
    text = (tmp_path / ("llm-backoff-fleet.conf" if lb == "nginx" else "haproxy.cfg")).read_text()
    for address in addresses:
        assert f" {address}" in text
    assert "127.0.0.1:18000" in text


def changed_lines(shipped: str, rendered: str) -> list[str]:
    return [
        line[1:].strip()
        for line in difflib.unified_diff(shipped.splitlines(), rendered.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def test_renderings_change_only_addresses_ports_and_the_log_target() -> None:
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    nginx = changed_lines(NGINX_CONFIG.read_text(), render_nginx(addresses, "127.0.0.1:9"))
    assert nginx, "nothing rendered"
    assert all(re.fullmatch(r"(server \S+:\d+ max_fails=0|listen \S+);", line) for line in nginx), nginx
    haproxy = changed_lines(HAPROXY_CONFIG.read_text(), render_haproxy(addresses, "127.0.0.1:9"))
    allowed = r"server replica\d \S+:\d+|bind \S+|log (/dev/log|stdout format raw) local0"
    assert all(re.fullmatch(allowed, line) for line in haproxy), haproxy


def test_the_recipes_features_are_in_the_shipped_files() -> None:
    nginx = NGINX_CONFIG.read_text()
    for needed in (
        "proxy_next_upstream error timeout http_429 http_503 non_idempotent;",
        "proxy_next_upstream_tries 3;",
        "proxy_next_upstream_timeout",
        "max_fails=0",
        "proxy_buffering off;",
        "proxy_http_version 1.1;",
        "keepalive ",
        "proxy_read_timeout 600s;",
    ):
        assert needed in nginx, needed
    haproxy = HAPROXY_CONFIG.read_text()
    for needed in (
        "retry-on conn-failure empty-response 503",
        "option redispatch 1",
        "option http-buffer-request",
        "option httpchk GET /ready",
        "http-check expect status 200",
        "timeout server 600s",
    ):
        assert needed in haproxy, needed
    assert "response-timeout" not in haproxy.split("retry-on", 1)[1].split("\n", 1)[0]


def test_a_file_without_server_lines_is_a_clear_error() -> None:
    with pytest.raises(ConfigShapeError, match="server line"):
        render_nginx(["127.0.0.1:1"], "127.0.0.1:2", text="server { listen 80; }\n")
    with pytest.raises(ConfigShapeError, match="server line"):
        render_haproxy(["127.0.0.1:1"], "127.0.0.1:2", text="frontend f\n    bind :80\n")


def test_the_deploy_doc_names_the_files_and_tested_versions() -> None:
    doc = DEPLOY_DOC.read_text()
    fleet = doc.split("## A fleet", 1)[1]
    for needed in (
        "server_shim/deploy/nginx/llm-backoff-fleet.conf",
        "server_shim/deploy/haproxy/llm-backoff-fleet.cfg",
        "nginx 1.22.1",
        "HAProxy 2.6.12",
        "llm-backoff-shim fleet",
    ):
        assert needed in fleet, needed
