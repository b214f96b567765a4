#!/usr/bin/env bash
# Print the shim's HTTP-layer end-to-end test files, one a line: the files under
# server_shim/tests/serve/ and server_shim/tests/http/ that start a shim on loopback (conftest's
# make_shim, shim_server) or a `serve` process on the run's serving path (shim_http_path).
#
# These are the tests whose behaviour is the serving path's (docs/shim.md, "Serving paths"):
# parsing, framing, head and body limits, refusal from the head, keep-alive and pipelining,
# streaming onto the client's socket, the disconnect signal, the `serve` command's start-up.
# scripts/test.sh and scripts/test-shim-floors.sh run them on the public path as well as the
# fast one; everything above the proxy's ASGI interface reads the same on either path and runs
# once, on the fast path.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -rl --include="test_*.py" "make_shim\|shim_server\|shim_http_path" \
  server_shim/tests/serve server_shim/tests/http | sort
