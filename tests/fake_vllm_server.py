"""A FAKE vLLM server, for the tests of ``grpo_fast.rollout.vllm_server`` that need no vLLM.

It is not vLLM: it answers the HTTP routes ``ServerEngine`` calls (``GET /health``, the RL routes
of a server run with ``VLLM_SERVER_DEV_MODE=1``, ``POST /inference/v1/generate``) with canned
JSON of the same shape, on 127.0.0.1 only. Each route can be told to misbehave:

- ``"hang"``: read the request, never answer (until the server stops);
- ``"close"``: read the request, close the connection without a response;
- ``"error"``: answer HTTP 500 with an error body (``/health`` stays 200);
- ``"hang@3"`` (any of the above, ``@N``): answer as usual up to the route's N − 1-th call, then
  misbehave from its N-th on (for a run in other processes, which cannot switch it mid-run).

The generated tokens are ``[7, 8, 9]`` cut to ``max_tokens``, text ``"789"``, each token's
log-prob -0.5, labelled with the weight version of the latest ``/finish_weight_update`` (or
``/update_weight_version``). ``calls`` lists the routes in the order they were asked.

In a thread: ``with FakeVLLMServer({"/start_weight_update": "hang"}) as fake: fake.url``. As a
process (the tests that kill it): ``python tests/fake_vllm_server.py PORT '{"/route": "hang"}'``;
it prints ``request <path>`` as each request arrives.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS = [7, 8, 9]


class _Server(ThreadingHTTPServer):
    # ServerEngine sends a batch's requests at once (up to 256 in flight); the default listen
    # backlog of 5 let a busy machine's kernel reset the connections past it (ConnectionResetError
    # in a test beside a loaded suite), which a real vLLM server (uvicorn: 2,048) does not do
    request_queue_size = 1024


class FakeVLLMServer:
    """FAKE vLLM server (see the module docstring)."""

    def __init__(self, behaviour: dict[str, str] | None = None, port: int = 0):
        self.behaviour = dict(behaviour or {})
        self.calls: list[str] = []
        self.counts: dict[str, int] = {}  # route → calls so far
        self.lock = threading.Lock()
        self.bodies: list[tuple[str, dict | None]] = []
        self.version = "0"
        self.stopping = threading.Event()
        self.httpd = _Server(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread: threading.Thread | None = None

    def __enter__(self) -> FakeVLLMServer:
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, path: str, body: dict | None) -> dict:
        if path == "/finish_weight_update" and body and body.get("weight_version") is not None:
            self.version = body["weight_version"]
        if path == "/update_weight_version":
            self.version = body["new_version"]
        if path != "/inference/v1/generate":
            return {"ok": True}
        sp = body["sampling_params"]
        tokens = TOKENS[: sp.get("max_tokens", 3)]
        choice = {
            "finish_reason": "length",
            "token_ids": tokens,
            "text": "".join(map(str, tokens)),
            "logprobs": {"content": [{"token": str(t), "logprob": -0.5} for t in tokens]},
            "weight_versions": [{"version": self.version, "start": 0, "end": len(tokens)}],
        }
        out = {"choices": [{**choice, "index": i} for i in range(sp.get("n", 1))], "prompt_logprobs": None}
        if sp.get("prompt_logprobs") is not None:
            out["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": -1.0, "rank": 1}} for t in body["token_ids"][1:]
            ]
        return out


def _handler(fake: FakeVLLMServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _serve(self, body: dict | None) -> None:
            path = self.path.split("?")[0]
            fake.calls.append(path)
            fake.bodies.append((path, body))
            print(f"request {path}", flush=True)
            with fake.lock:
                fake.counts[path] = fake.counts.get(path, 0) + 1
                seen = fake.counts[path]
            how, _, nth = fake.behaviour.get(path, "ok").partition("@")
            if nth and seen < int(nth):
                how = "ok"
            if how == "hang":
                fake.stopping.wait()
                return
            if how == "close":
                self.close_connection = True
                self.connection.close()
                return
            if how == "error":
                data, code = json.dumps({"error": {"message": f"fake failure of {path}"}}).encode(), 500
            else:
                data, code = json.dumps(fake.answer(path, body)).encode(), 200
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._serve(None)

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            self._serve(json.loads(raw) if raw else None)

    return Handler


if __name__ == "__main__":
    server = FakeVLLMServer(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}, port=int(sys.argv[1]))
    print(f"listening on {server.url}", flush=True)
    server.httpd.serve_forever()
