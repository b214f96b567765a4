"""Quick start: a wrapped openai client riding out 429s from a busy server.

Starts a tiny OpenAI-compatible server on 127.0.0.1 (stdlib only) that answers the
first two requests with ``429 Too Many Requests`` plus ``Retry-After`` hints, the
way the llm-backoff shim does, and the third with a chat completion. The wrapped
client waits what the server asked for (plus a little jitter), retries, and the
attempt history is printed.

    .venv/bin/python examples/quickstart.py
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai

import llm_backoff


class BusyThenOk(BaseHTTPRequestHandler):
    calls = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.lock:
            BusyThenOk.calls += 1
            n = BusyThenOk.calls
        if n <= 2:
            body = {
                "error": {
                    "message": "server at capacity, retry in 0.3 s",
                    "type": "server_overloaded",
                    "code": "queue_full",
                    "retry_after_seconds": 0.3,
                }
            }
            self._send(429, body, {"retry-after": "1", "retry-after-ms": "300"})
            return
        self._send(
            200,
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "demo",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "Hello!"},
                    }
                ],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
            },
        )

    def _send(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        print(f"  server: {self.requestline} -> {args[1]}")


def main() -> None:
    # Each retry is also logged at INFO on the "llm_backoff" logger (details at DEBUG).
    logging.basicConfig(level=logging.WARNING)

    server = ThreadingHTTPServer(("127.0.0.1", 0), BusyThenOk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    print(f"server listening on {base_url}")

    client = llm_backoff.wrap(
        openai.OpenAI(api_key="sk-demo", base_url=base_url),
        llm_backoff.RetryPolicy(deadline=10.0),
        on_retry=lambda e: print(
            f"  on_retry: attempt {e.attempt} failed ({e.reason}), waiting {e.wait:.2f} s"
        ),
    )
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": "Say hello"}]
        )
        completion = raw.parse()
        print(f"answer: {completion.choices[0].message.content}")
        print("attempts:")
        for a in raw.http_response.extensions["llm_backoff.attempts"]:
            wait = f", then waited {a.wait:.2f} s" if a.wait is not None else ""
            hint = f", server hint {a.hint:.2f} s" if a.hint is not None else ""
            print(f"  #{a.number}: status {a.status} after {a.started:.2f} s{hint}{wait}")
    finally:
        client.close()
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
