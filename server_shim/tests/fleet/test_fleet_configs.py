"""The shipped nginx and HAProxy files: accepted by the real binaries as shipped and as the
loopback fleet renders them, and rendered by changing addresses and paths only.

``nginx -t`` and ``haproxy -c`` need the binaries (Debian's nginx 1.22 and HAProxy 2.6): the
tests skip without them, and fail instead when CI is set.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from llm_backoff_shim.lab.fleet import LoadBalancer
from llm_backoff_shim.lab.fleet_configs import (
    HAPROXY_CONFIG,
    LB_SHIM_FLAGS,
    NGINX_CONFIG,
    ConfigShapeError,
    lb_binary,
    nginx_main_config,
    render_haproxy,
    render_nginx,
)

REPLICAS = ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004"]


def binary(lb: str) -> str:
    found = lb_binary(lb)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{lb} is not installed, and CI must run this test (scripts/test.sh installs it)")
        pytest.skip(f"{lb} is not installed (apt-get install {lb})")
    return found


def changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    old, new = before.splitlines(), after.splitlines()
    return [line for line in old if line not in new], [line for line in new if line not in old]


def test_nginx_accepts_the_shipped_file_as_shipped(tmp_path: Path) -> None:
    nginx = binary("nginx")
    site = tmp_path / "llm-backoff-fleet.conf"
    site.write_text(NGINX_CONFIG.read_text())
    (tmp_path / "nginx.conf").write_text(nginx_main_config(tmp_path, site))
    result = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-e", "stderr", "-c", str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_haproxy_accepts_the_shipped_file_as_shipped() -> None:
    haproxy = binary("haproxy")
    result = subprocess.run(
        [haproxy, "-c", "-f", str(HAPROXY_CONFIG)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr + result.stdout
    # Every setting is understood: HAProxy warns about unknown or misplaced ones and goes on.
    assert "WARNING" not in result.stderr + result.stdout, result.stderr + result.stdout


@pytest.mark.parametrize("lb", ["nginx", "haproxy"])
def test_the_binary_accepts_the_file_the_fleet_renders(lb: str, tmp_path: Path) -> None:
    binary(lb)
    balancer = LoadBalancer(lb, REPLICAS, tmp_path)
    output = balancer.check_config()
    assert "WARNING" not in output
    balancer.close()


def test_nginx_rendering_changes_only_the_servers_and_the_listen_address() -> None:
    shipped = NGINX_CONFIG.read_text()
    removed, added = changed_lines(shipped, render_nginx(REPLICAS, "127.0.0.1:8123"))
    assert all(re.fullmatch(r"\s*(server \S+:\d+ max_fails=0;|listen \d+;)", line) for line in removed)
    assert [line.strip() for line in added] == [
        *(f"server {r} max_fails=0;" for r in REPLICAS),
        "listen 127.0.0.1:8123;",
    ]


def test_haproxy_rendering_changes_only_addresses_and_paths(tmp_path: Path) -> None:
    shipped = HAPROXY_CONFIG.read_text()
    socket = tmp_path / "admin.sock"
    removed, added = changed_lines(shipped, render_haproxy(REPLICAS, "127.0.0.1:8123", stats_socket=socket))
    assert all(re.match(r"\s*(server replica\d |bind |stats socket )", line) for line in removed)
    assert [line.strip() for line in added] == [
        f"stats socket {socket} mode 660 level admin",
        "bind 127.0.0.1:8123",
        *(f"server replica{i + 1} {r}" for i, r in enumerate(REPLICAS)),
    ]


def test_the_recipes_rely_on_what_the_docs_say() -> None:
    nginx = NGINX_CONFIG.read_text()
    assert re.search(r"proxy_next_upstream error timeout http_429 http_503 non_idempotent;", nginx)
    assert "proxy_buffering off;" in nginx
    assert re.search(r"max_fails=0;", nginx)
    haproxy = HAPROXY_CONFIG.read_text()
    assert re.search(r"^\s*retry-on conn-failure empty-response 503$", haproxy, re.MULTILINE)
    assert re.search(r"^\s*option httpchk GET /ready$", haproxy, re.MULTILINE)
    assert re.search(r"^\s*option http-buffer-request$", haproxy, re.MULTILINE)
    # Every replica in turn, enough retries to reach each (docs/deploy.md has the measurement).
    assert re.search(r"^\s*balance roundrobin$", haproxy, re.MULTILINE)
    assert re.search(r"^\s*retries 8$", haproxy, re.MULTILINE)
    # Logs reach the journal or `docker logs` without a syslog socket.
    assert re.search(r"^\s*log stdout format raw local0$", haproxy, re.MULTILINE)
    assert not re.search(r"^\s*log /dev/log", haproxy, re.MULTILINE)
    # HAProxy retries only a 503: its shims refuse with 503 (the fleet passes the flag).
    assert LB_SHIM_FLAGS["haproxy"] == ("--reject-status", "503")


@pytest.mark.parametrize(
    ("render", "text"),
    [
        (render_nginx, "upstream x {\n}\nserver { listen 80; }\n"),
        (render_nginx, "upstream x {\n    server 10.0.0.1:80;\n}\n"),
        (render_haproxy, "backend b\n    server a 10.0.0.1:80\n"),
    ],
)
def test_a_file_missing_a_line_the_renderer_replaces_is_an_error(render: object, text: str) -> None:
    with pytest.raises(ConfigShapeError):
        render(REPLICAS, "127.0.0.1:1", text)  # type: ignore[operator]


def test_the_deploy_doc_names_the_files_the_command_and_the_tested_versions() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "deploy.md").read_text()
    fleet = doc.split("## A fleet", 1)[1]
    for needed in (
        "server_shim/deploy/nginx/llm-backoff-fleet.conf",
        "server_shim/deploy/haproxy/llm-backoff-fleet.cfg",
        "nginx 1.22.1",
        "HAProxy 2.6.12",
        "llm-backoff-shim fleet",
        "retries 8",
    ):
        assert needed in fleet, needed


@pytest.mark.parametrize("lb", ["nginx", "haproxy"])
def test_the_balancers_own_refusal_says_a_retry_can_succeed(lb: str, tmp_path: Path) -> None:
    """With no replica reachable the balancer answers itself: a 503 in the shim's format, with
    the shim's refusal-reason header (docs/protocol.md)."""
    binary(lb)
    with contextlib.ExitStack() as stack:
        dead = []
        for _ in range(3):  # bound, never listening: every connection is refused
            probe = stack.enter_context(socket.socket())
            probe.bind(("127.0.0.1", 0))
            dead.append(f"127.0.0.1:{probe.getsockname()[1]}")
        balancer = LoadBalancer(lb, dead, tmp_path).start()
        stack.callback(balancer.stop)
        response = httpx.post(balancer.url + "/v1/chat/completions", json={"model": "m"}, timeout=30)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert response.headers["retry-after"] == "1"
    assert response.headers["x-llm-backoff-refusal"] == "retry-upstream-unavailable"
