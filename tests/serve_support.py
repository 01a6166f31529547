"""A `cachegraft serve` app on a free localhost port, in a thread of the test process, over a
tiny store; and the tiny store itself."""

from __future__ import annotations

import json
import socket
import threading
import time

from cli_support import PASSAGES, QUESTIONS as QUESTIONS  # QUESTIONS: re-exported for the serving tests

NEW = {"id": "comet", "title": "Comet", "text": "The comet Velmora returns every seventy years over the northern sky."}


def make_store(path, receiver, passages=PASSAGES) -> str:
    import cachegraft_cli as cg

    cg.encode(list(passages), str(path), models=cg.Models(receiver=str(receiver), dtype="float32"),
              options=cg.EncodeOptions(codec="float32"))
    cg.index(str(path))
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `build_app` in a thread, set up as `cachegraft serve` sets it up (read
    deadlines, bounded drain: `timeouts`). `start_worker=False` leaves the worker's thread
    stopped, so requests stay queued (deterministic queue and disconnect tests) until `.worker.start()`."""

    def __init__(self, stores: dict[str, str], api_key: str | None = None, start_worker: bool = True,
                 timeouts=None, **settings):
        from cachegraft_cli.answering.options import AskOptions
        from cachegraft_cli.lm.sampling import GenerationOptions
        from cachegraft_cli.serving.http import AppOptions, build_app
        from cachegraft_cli.serving.requests import Limits
        from cachegraft_cli.serving.server import Timeouts, bind, uvicorn_server
        from cachegraft_cli.serving.worker import Worker, WorkerOptions

        limits = {k: settings.pop(k) for k in ("max_k", "max_new_tokens", "max_body") if k in settings}
        defaults = AskOptions(k=2, generation=GenerationOptions(max_new_tokens=8))
        timeouts = timeouts or Timeouts()
        self.worker = Worker(stores, options=WorkerOptions(**settings), log=lambda m: None)
        self.worker.open("graft")
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(self.worker, AppOptions(defaults, Limits(**limits), api_key, body_timeout=timeouts.body))
        self.server = uvicorn_server(app, timeouts)
        if start_worker:
            self.worker.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.worker.start()  # a no-op unless the test left it stopped: queued work is answered, then it ends
        self.worker.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def wait_until(condition, limit: float = 60.0, every: float = 0.02):
    """Poll `condition` until it is true (a bound so a broken server fails the test instead of hanging it)."""
    deadline = time.monotonic() + limit
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(every)
    return value


def without_timings(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "timings"}


def ask_json(capsys, monkeypatch, store: str, question: str, *args) -> dict:
    from cli_support import run_cli

    code, out, err = run_cli(capsys, monkeypatch, "ask", question, "--store", store, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def raw_request(port: int, data: bytes, limit: float = 10.0, then=None) -> bytes:
    """Send `data` on a fresh connection to 127.0.0.1:`port` (nothing more; `then(sock)` may
    write more) and read until the server closes it, within `limit` seconds: what a client that
    stops sending sees. A server that holds the connection past `limit` fails the test."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as sock:
        sock.sendall(data)
        if then is not None:
            then(sock)
        return read_to_close(sock, limit)


def read_to_close(sock: socket.socket, limit: float) -> bytes:
    deadline, out = time.monotonic() + limit, b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            raise AssertionError(f"the server held the connection open past {limit} s (got {out[:200]!r})") from None
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def parse_reply(raw: bytes) -> tuple[int, dict, bytes]:
    """(status, headers in lower case, body) of one HTTP/1.1 response with a Content-Length
    (a chunked body, a stream's, is returned as sent)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if "content-length" in headers:
        body = body[: int(headers["content-length"])]
    return status, headers, body
