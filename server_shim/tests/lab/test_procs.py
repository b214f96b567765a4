"""Child servers (lab/procs.py): their logs read while they write, a fixed port, kill and restart."""

from __future__ import annotations

import sys
import time

from llm_backoff_shim.lab import procs

LINES = 1500
WRITER = (
    f"import time\nfor i in range({LINES}):\n    print(f'line {{i}}', flush=True)\n    time.sleep(0.0005)\n"
)


def test_reading_the_log_while_the_child_writes_loses_no_line() -> None:
    child = procs.ChildServer("writer", lambda port: [sys.executable, "-c", WRITER])
    child.launch()
    try:
        while child.alive():  # read as often as a test polling an access log would, and more
            child.log_tail()
            time.sleep(0.001)
        lines = child.log_tail(10_000_000).splitlines()
    finally:
        child.close()
    assert lines == [f"line {i}" for i in range(LINES)]


def http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]


def test_a_fixed_port_is_kept_across_kill_and_restart() -> None:
    port = procs.free_port()
    with procs.ChildServer("http", http_server, health_path="/", port=port) as child:
        assert child.port == port
        first = child.pid
        child.kill()
        assert not child.alive()
        assert not procs.is_healthy(child.url + "/")
        child.restart()
        assert child.port == port
        assert child.pid != first
        assert procs.is_healthy(child.url + "/")


def test_restart_keeps_a_port_that_was_chosen_freely() -> None:
    with procs.ChildServer("http", http_server, health_path="/") as child:
        port = child.port
        child.stop()
        child.restart()
        assert child.port == port
        assert child.fixed_port == 0  # later plain starts may pick a fresh port again
        assert procs.is_healthy(child.url + "/")


def test_a_child_is_not_up_while_another_process_answers_on_its_port() -> None:
    """Ports are handed out free, then bound by the child later: another server may take the
    port first and answer its health URL while the child has yet to fail to bind. The child is
    up only once the socket listening there is its own."""
    port = procs.free_port()
    with procs.ChildServer("other", http_server, health_path="/", port=port) as other:
        assert procs.listens_on(other.pid or 0, port) is True
        # A child that never listens, told the same port: the other server answers for it.
        silent = procs.ChildServer(
            "silent",
            lambda p: [sys.executable, "-c", "import time; time.sleep(30)"],
            health_path="/",
            port=port,
            start_timeout=1.0,
        )
        assert procs.is_healthy(f"http://127.0.0.1:{port}/")
        try:
            silent.launch()
            assert not silent.wait_ready()
            assert procs.listens_on(silent.pid or 0, port) is False
        finally:
            silent.close()
