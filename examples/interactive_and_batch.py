"""Class-aware defaults: an interactive caller fails fast, a batch caller is patient.

Starts a tiny OpenAI-compatible server on 127.0.0.1 (stdlib only) that refuses each
caller's first request with ``429`` and a ``Retry-After`` hint of its choosing, the
way the llm-backoff shim does, then answers. Three callers, no policy given, only
``request_class``:

- interactive, hint 0.3 s on a 1 s start budget: within the 40 % of the budget the
  preset waits out, so it waits and is served within the budget;
- interactive, hint 0.6 s: it would fit the budget, but a wait that long fails as often
  as not, so the call fails at once (and the application can degrade now);
- batch, hint 1.2 s: waits it out and is served.

    .venv/bin/python examples/interactive_and_batch.py
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import openai

import llm_backoff


class RefuseOnceThenAnswer(BaseHTTPRequestHandler):
    seen: ClassVar[set[str]] = set()
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        caller = self.headers.get("x-caller", "-")
        with self.lock:
            first = caller not in self.seen
            self.seen.add(caller)
        if first:
            hint = self.headers.get("x-hint", "1")
            body = {"error": {"message": "server at capacity", "type": "server_overloaded"}}
            self._send(429, body, {"retry-after": hint})
            return
        self._send(
            200,
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "demo",
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi!"}}
                ],
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
        pass


def ask(client: openai.OpenAI, caller: str, hint: str) -> None:
    began = time.monotonic()
    try:
        reply = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-caller": caller, "x-hint": hint},
        )
        took = time.monotonic() - began
        print(f"  {caller}: served after {took:.2f} s: {reply.choices[0].message.content}")
    except openai.RateLimitError as exc:
        reason = exc.__notes__[-1].splitlines()[0] if getattr(exc, "__notes__", None) else str(exc)
        print(f"  {caller}: failed after {time.monotonic() - began:.2f} s ({reason})")


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), RefuseOnceThenAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    print(f"server listening on {base_url}")

    def client(request_class: str, policy: llm_backoff.RetryPolicy | None = None) -> openai.OpenAI:
        return llm_backoff.wrap(
            openai.OpenAI(api_key="sk-demo", base_url=base_url), policy, request_class=request_class
        )

    # The interactive preset with a 1 s budget instead of its default 5 s, to keep the demo short.
    interactive = client("interactive", llm_backoff.RetryPolicy.interactive(start_deadline=1.0))
    batch = client("batch")  # no policy: RetryPolicy.batch()
    try:
        ask(interactive, "interactive, hint 0.3 s", "0.3")
        ask(interactive, "interactive, hint 0.6 s", "0.6")
        ask(batch, "batch, hint 1.2 s", "1.2")
    finally:
        for each in (interactive, batch):
            each.close()
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
