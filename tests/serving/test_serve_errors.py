"""Every bad request gets a 4xx JSON error in OpenAI's shape (never a traceback); the API
key; `cachegraft serve` refusing bad options before any model loads; SIGTERM drains."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from serve_support import QUESTIONS, LiveServer, free_port, make_store, wait_until

CHAT = "/v1/chat/completions"
LONG = " ".join(["lighthouse fishermen harbor town"] * 200)  # far past the tiny receiver's 512 positions


@pytest.fixture(scope="module")
def store(tiny_dirs, tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("serve_errors") / "store", tiny_dirs["receiver"])


@pytest.fixture(scope="module")
def live(store):
    with LiveServer({"docs": store}, api_key="s3cret", max_body=4096, max_new_tokens=64) as server:
        yield server


BAD = [
    ("POST", "/v1/ask", {"question": 3}, 400, "invalid_type"),
    ("POST", "/v1/ask", {"question": "x?", "k": "3"}, 400, "invalid_type"),
    ("POST", "/v1/ask", {"question": "x?", "k": True}, 400, "invalid_type"),
    ("POST", "/v1/ask", {"k": 2}, 400, "missing_question"),
    ("POST", "/v1/ask", {"question": "   "}, 400, "missing_question"),
    ("POST", "/v1/ask", {"question": "x?", "k": 21}, 400, "k_out_of_range"),
    ("POST", "/v1/ask", {"question": "x?", "k": 0}, 400, "k_out_of_range"),
    ("POST", "/v1/ask", {"question": "x?", "max_new_tokens": 100000}, 400, "invalid_request"),
    ("POST", "/v1/ask", {"question": "x?", "top_p": 0}, 400, "invalid_request"),
    ("POST", "/v1/ask", {"question": "x?", "system": "oracle"}, 400, "invalid_request"),
    ("POST", "/v1/ask", {"question": "x?", "colour": "red"}, 400, "unknown_field"),
    ("POST", "/v1/ask", {"question": "x?", "store": "nope"}, 404, "store_not_found"),
    ("POST", "/v1/ask", {"question": "zzqx vvwp?"}, 404, "no_passages"),
    ("POST", "/v1/ask", {"question": LONG[:3000], "max_new_tokens": 64}, 400, "context_length_exceeded"),
    ("POST", "/v1/ask", [1, 2], 400, "invalid_body"),
    ("POST", "/v1/ask", "x" * 5000, 413, "body_too_large"),
    ("POST", "/v1/retrieve", {"question": "x?", "k": 99}, 400, "k_out_of_range"),
    ("POST", CHAT, {"model": "docs"}, 400, "missing_question"),
    ("POST", CHAT, {"model": "docs", "messages": [{"role": "system", "content": "hi"}]}, 400, "missing_question"),
    ("POST", CHAT, {"model": "docs", "messages": "hi"}, 400, "invalid_type"),
    ("POST", CHAT, {"model": "gpt-9", "messages": [{"role": "user", "content": "x?"}]}, 404, "model_not_found"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": "x?"}], "n": 2}, 400, "invalid_request"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": "x?"}], "stream": "yes"}, 400, "invalid_type"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": "x?"}], "temperature": -1}, 400, "invalid_request"),
    ("GET", "/v1/nothing", None, 404, None),
    ("GET", "/v1/ask", None, 405, None),
    # bodies that once got "500 This is a bug": a NUL or lone surrogate naming a store or model, a lone
    # surrogate in the question, JSON nested past the parser's depth, a top_p float32 rounds to 0
    ("POST", "/v1/ask", {"question": "x?", "store": "do\x00cs"}, 400, "invalid_name"),
    ("POST", "/v1/ask", {"question": "x?", "store": "\ud800"}, 400, "invalid_text"),
    ("POST", "/v1/retrieve", {"question": "x?", "store": "/tmp/\x00"}, 400, "invalid_name"),
    ("POST", "/v1/ask", {"question": "lighthouse \ud800?"}, 400, "invalid_text"),
    ("POST", CHAT, {"model": "do\udfffcs", "messages": [{"role": "user", "content": "x?"}]}, 400, "invalid_text"),
    ("POST", CHAT, {"model": "docs\x00", "messages": [{"role": "user", "content": "x?"}]}, 400, "invalid_name"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc80"}]}]}, 400,
     "invalid_text"),
    ("POST", "/v1/ask", "[" * 2000 + "]" * 2000, 400, "invalid_json"),
    ("POST", "/v1/ask", '{"question": "x?", "k": ' + "[" * 1500 + "]" * 1500 + "}", 400, "invalid_json"),
    ("POST", "/v1/ask", {"question": "lighthouse?", "temperature": 1.0, "top_p": 1e-300}, 400, "invalid_request"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": "x?"}], "temperature": 1, "top_p": 5e-324}, 400,
     "invalid_request"),
    ("POST", "/v1/ask", '{"question": "x?", "temperature": NaN}', 400, "invalid_json"),
    ("POST", "/v1/ask", '{"question": "x?", "top_p": -Infinity}', 400, "invalid_json"),
    ("POST", "/v1/ask", '{"question": "x?", "blend": 1e999}', 400, "invalid_number"),
    ("POST", "/v1/ask", '{"question": "x?", "k": ' + "9" * 2000 + "}", 400, "k_out_of_range"),
    ("POST", "/v1/ask", b'{"question": "\xff\xfe?"}', 400, "invalid_json"),
    ("POST", "/v1/ask", '{"question": "x?"}'.encode("utf-16"), 400, "invalid_json"),
]


@pytest.mark.parametrize("method,path,body,status,code", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_their_error(live, method, path, body, status, code):
    content = body if isinstance(body, (str, bytes)) else None if body is None else json.dumps(body)
    response = httpx.request(method, f"{live.url}{path}", content=content,
                             headers={"Authorization": "Bearer s3cret", "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert "Traceback" not in response.text


def test_malformed_json_and_a_body_without_length(live):
    auth = {"Authorization": "Bearer s3cret"}
    bad = httpx.post(f"{live.url}/v1/ask", content=b"{not json", headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    chunked = httpx.post(f"{live.url}/v1/ask", content=iter([b'{"question": "', b"x" * 5000, b'"}']), headers=auth)
    assert chunked.status_code == 413


def test_the_api_key_is_required(live):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = httpx.get(f"{live.url}/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{live.url}/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong").models.list()


def test_ask_server_errors_are_the_cli_errors(live, capsys, monkeypatch):
    from cli_support import run_cli

    code, _, err = run_cli(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", "docs", "--server", live.url)
    assert code == 16 and "--api-key" in err
    monkeypatch.setenv("CACHEGRAFT_API_KEY", "s3cret")
    code, _, err = run_cli(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", "other", "--server", live.url)
    assert code == 5 and "No store 'other'" in err
    code, _, err = run_cli(capsys, monkeypatch, "ask", "zzqx vvwp?", "--store", "docs", "--server", live.url)
    assert code == 10
    code, _, err = run_cli(capsys, monkeypatch, "ask", "x?", "--store", "docs", "--server", f"http://127.0.0.1:{free_port()}")
    assert code == 16 and "cachegraft serve" in err
    code, _, err = run_cli(capsys, monkeypatch, "ask", "x?", "--store", "docs", "--server", live.url, "--device", "cpu")
    assert code == 2 and "cachegraft serve" in err
    code, _, err = run_cli(capsys, monkeypatch, "ask", "x?", "--store", "docs", "--server", live.url,
                           "--weights", "int8")
    assert code == 2 and "--weights" in err and "cachegraft serve" in err


def test_serve_refuses_bad_options_before_loading(store, tmp_path, capsys, monkeypatch):
    from cli_support import run_cli

    code, _, err = run_cli(capsys, monkeypatch, "serve", "--store", tmp_path / "missing")
    assert code == 5 and "cachegraft encode" in err
    code, _, err = run_cli(capsys, monkeypatch, "serve", "--store", f"a={store}", "--store", f"a={store}")
    assert code == 2 and "NAME=DIR" in err
    code, _, err = run_cli(capsys, monkeypatch, "serve", "--store", store, "-k", 30)
    assert code == 2 and "--max-k" in err
    code, _, err = run_cli(capsys, monkeypatch, "serve", "--store", store, "--weights", "int2")
    assert code == 2 and "unknown weights 'int2'" in err and "int4" in err
    with LiveServer({"docs": store}) as taken:
        port = taken.url.rsplit(":", 1)[1]
        code, _, err = run_cli(capsys, monkeypatch, "serve", "--store", store, "--port", port)
        assert code == 2 and "--port" in err


def test_sigterm_finishes_the_request_in_flight_then_exits_0(store):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen([sys.executable, "-m", "cachegraft_cli", "serve", "--store", f"docs={store}",
                             "--port", str(port), "--max-new-tokens", "24"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        log = []
        reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
        reader.start()
        wait_until(lambda: any(line.startswith("ready:") for line in log), limit=300)
        assert any(f"http://127.0.0.1:{port}" in line for line in log)
        body = {"model": "docs", "messages": [{"role": "user", "content": QUESTIONS[0]}], "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}{CHAT}", json=body, timeout=120) as response:
            lines = response.iter_lines()
            next(lines)  # the role chunk: the request is admitted
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=120) == 0
        reader.join(timeout=10)
        assert any("stopped" in line for line in log) and not any("Traceback" in line for line in log)
    finally:
        if proc.poll() is None:
            proc.kill()
