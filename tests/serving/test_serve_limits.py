"""`cachegraft serve` against clients that misbehave at the HTTP level, over raw sockets on
localhost: half-sent headers and stalled bodies get a 408 and are closed; SIGTERM with a
stalled client still exits within its bound; a non-streamed client that hangs up frees its
slot; bad Content-Length headers get a JSON 400; a damaged store is a permanent 500, not
503; a padded --api-key is stripped; a chat `model` may be the served path."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_support import (
    QUESTIONS,
    LiveServer,
    free_port,
    make_store,
    parse_reply,
    raw_request,
    read_to_close,
    wait_until,
)

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def store(tiny_dirs, tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("serve_limits") / "store", tiny_dirs["receiver"])


@pytest.fixture(scope="module")
def live(store):
    from cachegraft_cli.serving.server import Timeouts

    with LiveServer({"docs": store}, timeouts=Timeouts(headers=0.5, body=0.5, shutdown=2)) as server:
        yield server


def post(path: str, body: bytes, length: int | None = None, extra: str = "") -> bytes:
    """A POST's head (and body) as bytes; `length` overrides the Content-Length, `extra` adds headers."""
    size = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n"
            f"{extra}\r\n".encode() + body)


def error_of(raw: bytes) -> tuple[int, str]:
    """(status, error code) of a reply that must be OpenAI's JSON error shape."""
    status, headers, body = parse_reply(raw)
    assert headers["content-type"].startswith("application/json"), raw
    error = json.loads(body)["error"]
    assert error["message"] and error["type"], raw
    return status, error["code"]


# -- 6: read timeouts and a bounded drain ------------------------------------------------------------


def test_half_sent_headers_get_a_408_and_silent_connections_are_closed(live):
    """20 connections that never finish their headers and 20 that send nothing: all are closed
    by the server within the header timeout (0.5 s here), the first with a JSON 408."""
    results: dict[int, bytes] = {}

    def client(i: int) -> None:
        head = b"POST /v1/ask HTTP/1.1\r\nHost: t\r\nContent-Le" if i % 2 else b""
        results[i] = raw_request(live.port, head, limit=8)

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < 8
    assert len(results) == 40
    assert all(results[i] == b"" for i in range(0, 40, 2))
    assert {error_of(results[i]) for i in range(1, 40, 2)} == {(408, "request_timeout")}
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_a_body_stalled_midway_gets_a_408(live):
    raw = raw_request(live.port, post("/v1/ask", b'{"question": "wh', length=100), limit=8)
    assert error_of(raw) == (408, "request_timeout")
    assert parse_reply(raw)[1]["connection"] == "close"
    # a body the app never reads (an unknown endpoint answers without it) is dropped after the timeout too
    raw = raw_request(live.port, post("/v1/nothing", b"{", length=100), limit=8)
    assert parse_reply(raw)[0] == 404
    assert live.worker.load()["admitted"] == 0


def test_sigterm_with_a_stalled_client_exits_within_the_shutdown_bound(store):
    """Also 15 end to end: a key given with spaces around it is the key without them."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen([sys.executable, "-m", "cachegraft_cli", "serve", "--store", f"docs={store}",
                             "--port", str(port), "--api-key", "  s3cret  ", "--shutdown-timeout", "1",
                             "--header-timeout", "300", "--body-timeout", "300"],
                            stderr=subprocess.PIPE, text=True, env=env)
    log: list[str] = []
    try:
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        wait_until(lambda: any(line.startswith("ready:") for line in log) or proc.poll() is not None, limit=300)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert models.status_code == 200
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            head = post("/v1/ask", b'{"question": "wh', length=100, extra="Authorization: Bearer s3cret\r\n")
            stalled.sendall(head)  # and nothing more
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            code = proc.wait(timeout=30)
            took = time.monotonic() - started
            cut = read_to_close(stalled, 5)
        assert code == 0 and took < 15, (code, took, log)
        assert error_of(cut) == (503, "shutting_down")  # an answer, not a dropped connection
        wait_until(lambda: any("stopped" in line for line in log), limit=10)
        assert any("cut off" in line for line in log) and not any("Traceback" in line for line in log), log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stream_still_running_at_the_shutdown_bound_ends_with_an_error_event(store):
    from cachegraft_cli.serving.server import Timeouts

    server = LiveServer({"docs": store}, start_worker=False, timeouts=Timeouts(shutdown=1))
    try:
        body = {"model": "docs", "messages": [{"role": "user", "content": QUESTIONS[0]}], "stream": True}
        with httpx.stream("POST", f"{server.url}{CHAT}", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)  # the role chunk: admitted, and never answered (the worker is stopped)
            server.server.should_exit = True  # what SIGTERM sets
            rest = [line for line in lines if line]
        server.thread.join(timeout=15)
        assert not server.thread.is_alive()
        assert [json.loads(line.removeprefix("data: "))["error"]["code"] for line in rest] == ["shutting_down"]
        assert server.worker.load()["admitted"] == 0
    finally:
        server.stop()


# -- 10: a non-streamed client that hangs up -------------------------------------------------------


def test_a_non_streamed_client_that_hangs_up_frees_its_slot_at_once(store):
    with LiveServer({"docs": store}, start_worker=False, max_queue=1) as server:
        for path, body in (("/v1/ask", {"question": QUESTIONS[0]}),
                           (CHAT, {"messages": [{"role": "user", "content": QUESTIONS[0]}]})):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(post(path, json.dumps(body).encode()))
            wait_until(lambda: server.worker.load()["admitted"] == 1, limit=10)
            sock.close()
            wait_until(lambda: server.worker.load() == {**server.worker.load(), "admitted": 0, "waiting": 0},
                       limit=5)
        server.worker.start()
        assert httpx.post(f"{server.url}/v1/ask", json={"question": QUESTIONS[0]}, timeout=60).status_code == 200


# -- 13: which errors are permanent ------------------------------------------------------------------


def test_every_error_maps_to_its_status():
    from cachegraft_cli import errors
    from cachegraft_cli.serving.http import error_status
    from cachegraft_cli.serving.worker import Busy

    expected = {
        errors.StoreCorruptError("x"): (500, "store_damaged"),
        errors.StoreMismatchError("x"): (500, "store_mismatch"),
        errors.StoreNotFoundError("x"): (500, "store_missing"),
        errors.StoreError("x"): (500, "store_error"),
        errors.IndexMissingError("x"): (500, "index_missing"),
        errors.RetrievalIndexError("x"): (500, "index_damaged"),
        errors.DiskFullError("x"): (500, "storage_error"),
        errors.ModelLoadError("x"): (500, "model_error"),
        errors.CorpusError("x"): (500, "server_error"),
        errors.StoreLockedError("x"): (503, "store_locked"),
        errors.NoPassagesError("x"): (404, "no_passages"),
        errors.UsageError("past the context window"): (400, "context_length_exceeded"),
        errors.UsageError("x"): (400, "invalid_request"),
        Busy("x"): (429, "queue_full"),
        Busy("x", status=503): (503, "shutting_down"),
    }
    assert {exc: error_status(exc)[::2] for exc in expected} == expected


def test_a_damaged_store_is_a_permanent_500_not_503(tiny_dirs, tmp_path):
    store = make_store(tmp_path / "store", tiny_dirs["receiver"])
    with LiveServer({"docs": store}) as server:
        assert httpx.post(f"{server.url}/v1/ask", json={"question": QUESTIONS[0]}, timeout=60).status_code == 200
        damaged = 0
        for path in Path(store).rglob("*"):  # every cache chunk: whichever passage is retrieved is damaged
            if path.is_file() and "/c/" in str(path) and "/fused/" in str(path):
                data = bytearray(path.read_bytes())
                data[len(data) // 2:] = bytes(b ^ 0xFF for b in data[len(data) // 2:])
                path.write_bytes(bytes(data))
                damaged += 1
        assert damaged
        reply = httpx.post(f"{server.url}/v1/ask", json={"question": QUESTIONS[0]}, timeout=60)
        assert reply.status_code == 500, reply.text
        assert reply.json()["error"]["code"] == "store_damaged" and "retry-after" not in reply.headers


# -- 15: the API key ---------------------------------------------------------------------------------


def test_a_padded_api_key_is_stripped_and_an_empty_one_refused(store, capsys, monkeypatch):
    from cli_support import run_cli

    import cachegraft_cli.serving.server as run

    seen = []
    monkeypatch.setattr(run, "serve", lambda config, log, ready: seen.append(config.api_key) or True)
    code, _, err = run_cli(capsys, monkeypatch, "serve", "--store", store, "--api-key", "  s3cret \t")
    assert code == 0 and seen == ["s3cret"], err
    for empty in ("", "   "):
        code, _, err = run_cli(capsys, monkeypatch, "serve", "--store", store, "--api-key", empty)
        assert code == 2 and "--api-key is empty" in err and "Traceback" not in err
    assert seen == ["s3cret"]


# -- 16: a chat model named by the served path -------------------------------------------------------


def test_a_chat_model_may_be_the_path_the_store_is_served_from(live, store):
    question = [{"role": "user", "content": QUESTIONS[0]}]
    for model, system in ((store, "graft"), (store + "/", "graft"), (f"{store}/text", "text"), ("docs/text", "text")):
        reply = httpx.post(f"{live.url}{CHAT}", json={"model": model, "messages": question}, timeout=60)
        assert reply.status_code == 200, (model, reply.text)
        assert reply.json()["cachegraft"]["system"] == system and reply.json()["model"] == model
    missing = httpx.post(f"{live.url}{CHAT}", json={"model": store + "-other", "messages": question})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


# -- 17: bad Content-Length ---------------------------------------------------------------------------

BAD_LENGTHS = [
    b"Content-Length: abc\r\n",
    b"Content-Length: -5\r\n",
    b"Content-Length: 1e3\r\n",
    b"Content-Length: 5\r\nContent-Length: 6\r\n",
    b"Content-Length: 5, 6\r\n",
    b"Content-Length: \r\n",
    b"Content-Length: 5\r\nTransfer-Encoding: gzip\r\n",
]


@pytest.mark.parametrize("header", BAD_LENGTHS, ids=range(len(BAD_LENGTHS)))
def test_a_bad_content_length_gets_a_json_400(live, header):
    raw = raw_request(live.port, b"POST /v1/ask HTTP/1.1\r\nHost: t\r\n" + header + b"\r\n{\"question\": 1}", limit=8)
    assert error_of(raw) == (400, "invalid_http")


def test_a_body_longer_than_its_content_length_gets_a_json_400_for_the_rest(live):
    """The bytes past the Content-Length are read as the next request: not HTTP, a JSON 400."""
    body = json.dumps({"question": QUESTIONS[0], "k": 1}).encode()
    raw = raw_request(live.port, post("/v1/retrieve", body, length=len(body) - 1) + b"trailing garbage\r\n\r\n",
                      limit=8)
    first, _, rest = raw.partition(b"HTTP/1.1 ")[2].partition(b"HTTP/1.1 ")
    assert parse_reply(b"HTTP/1.1 " + first)[0] == 400  # the body cut one byte short: not JSON
    assert error_of(b"HTTP/1.1 " + rest) == (400, "invalid_http")


@pytest.mark.parametrize("length", [b"abc", b"-5", b"\xb2", b"5 "])
def test_a_bad_content_length_the_app_sees_is_a_json_400(length):
    """What h11 lets through (another HTTP server under the app might not check) the app refuses itself."""
    import asyncio

    from starlette.requests import Request

    from cachegraft_cli.serving.http import error_response, read_json

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    request = Request({"type": "http", "method": "POST", "headers": [(b"content-length", length)]}, receive)
    with pytest.raises(Exception) as caught:
        asyncio.run(read_json(request, 1024, 5.0))
    response = error_response(caught.value)
    assert response.status_code == 400
    assert json.loads(response.body)["error"]["code"] == "invalid_content_length"
