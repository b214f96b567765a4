"""tenacity with llm_backoff's strategies: a plain openai client, retried by tenacity.

For code that already retries with tenacity and does not want ``wrap()``: the
strategies retry what a wrapped client would retry and wait what the server asked
for. A tiny stdlib server on 127.0.0.1 answers the first two requests with 429 and
``retry-after-ms: 200``, the third with a chat completion.

    .venv/bin/python examples/tenacity_retry.py
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import tenacity

import llm_backoff


class BusyTwice(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        BusyTwice.calls += 1
        if BusyTwice.calls <= 2:
            error = {"error": {"message": "busy", "type": "server_overloaded", "code": "queue_full"}}
            self._send(429, error, {"retry-after-ms": "200"})
        else:
            message = {"role": "assistant", "content": "Hello!"}
            completion = {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "demo",
                "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
            }
            self._send(200, completion, {})

    def _send(self, status: int, body: object, headers: dict[str, str]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        print(f"  server: {self.requestline} -> {args[1]}")


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BusyTwice)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # max_retries=0: tenacity is the only retry loop, so attempts do not multiply.
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="sk-demo", max_retries=0
    )
    policy = llm_backoff.RetryPolicy()

    @tenacity.retry(
        # What a wrapped client would retry, or any error of our own choosing.
        retry=llm_backoff.retry_if_retryable(policy) | tenacity.retry_if_exception_type(KeyError),
        # The server's hint when there is one (else jittered exponential), plus up to 50 ms.
        wait=llm_backoff.wait_retry_after(tenacity.wait_random_exponential(multiplier=0.5, max=30))
        + tenacity.wait_random(0, 0.05),
        stop=tenacity.stop_after_delay(30) | tenacity.stop_after_attempt(5),
        before_sleep=lambda state: print(
            f"  attempt {state.attempt_number} failed, sleeping {state.upcoming_sleep:.2f} s"
        ),
        reraise=True,
    )
    def ask() -> str:
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
        return reply.choices[0].message.content or ""

    try:
        print(f"answer: {ask()}")
    finally:
        client.close()
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
