"""A seeded HTTP fuzzer against `cachegraft serve` on localhost (tiny models): mutated JSON
bodies, mangled bytes and header variants (bad Content-Length, chunked bodies, stray control
characters, odd methods and paths), each on its own raw connection. Not one may get a 5xx,
and the server must answer normally afterwards."""

from __future__ import annotations

import json
import random
from collections import Counter

import httpx
import pytest
from conftest import TALLY
from serve_support import QUESTIONS, LiveServer, make_store, raw_request

SEED = 20261203
COUNT = 300
KEY = "k3y"

ASK_FIELDS = ["question", "store", "system", "k", "scheme", "order", "recompute", "blend", "blend_layer",
              "max_new_tokens", "temperature", "top_p", "seed"]
CHAT_FIELDS = ["model", "messages", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
               "n", "stream_options", "user", "stop", "k", "system", "scheme", "order", "recompute", "blend",
               "blend_layer"]
STRINGS = ["", " ", "x", "docs", "docs/text", "text", "graft", "closed", "sharer-text", "best-last", "rotate",
           "\x00", "do\x00cs", "\ud800", "\udfff\ud800x", "\u2028", "é", "😀", "../../etc/passwd", "/", "a" * 3000,
           "%00", "\x7f", "\t\n", "null", QUESTIONS[0], QUESTIONS[1] + "\x00"]
NUMBERS = [0, -1, 1, 2, 3, 7, 20, 21, 2**31, 2**63, 2**64, -(2**63), 10**30, 1e-300, 5e-324, 1e-7, 1e-6, 1e308,
           -0.0, 0.5, 0.999, 1.0, 1.0000001, 3.0, float("inf"), float("-inf"), float("nan")]
OTHERS = [None, True, False, [], {}, [1, "a"], {"a": 1}, [{"role": "user"}], [{"role": "user", "content": None}]]
PATHS = ["/v1/ask", "/v1/chat/completions", "/v1/retrieve", "/v1/models", "/health", "/v1/reload", "/v1/ask/",
         "/%ff", "/v1/../v1/ask", "//v1/ask", "/v1/ask?x=1", "/v1/chat/completions?stream=true", "*"]
METHODS = ["POST"] * 8 + ["GET", "PUT", "DELETE", "HEAD", "OPTIONS", "FOO"]


def value(rng: random.Random):
    pool = rng.choice([STRINGS, NUMBERS, OTHERS])
    return rng.choice(pool)


def json_body(rng: random.Random) -> tuple[str, dict]:
    """A plausible request, then up to 4 mutations of its fields (none: a baseline that must be answered)."""
    question = rng.choice(QUESTIONS)
    path, body = rng.choice([
        ("/v1/ask", {"question": question, "max_new_tokens": 4}),
        ("/v1/retrieve", {"question": question, "k": 2}),
        ("/v1/chat/completions", {"model": "docs", "messages": [{"role": "user", "content": question}],
                                  "max_tokens": 4}),
    ])
    names = CHAT_FIELDS if "chat" in path else ASK_FIELDS
    for _ in range(rng.choice([0, 1, 1, 2, 3, 4])):
        roll = rng.random()
        if roll < 0.6:
            body[rng.choice(names)] = value(rng)
        elif roll < 0.75 and body:
            body.pop(rng.choice(sorted(body)))
        elif roll < 0.85:
            body[rng.choice(STRINGS[:12])] = value(rng)
        elif "messages" in body:
            body["messages"] = [{"role": rng.choice(["user", "system", "", None]), "content": value(rng)}]
    return path, body


def encode(body) -> bytes:
    """JSON as a careless client writes it: NaN and Infinity as bare words, lone surrogates
    escaped (ensure_ascii)."""
    return json.dumps(body).encode()


def mangle(rng: random.Random, data: bytes) -> bytes:
    """Bytes of a body, damaged: flipped, inserted or deleted bytes, cut short, or deeply nested."""
    data = bytearray(data)
    roll = rng.random()
    if roll < 0.2:
        return b"[" * 3000 + b"]" * 3000 if rng.random() < 0.5 else b'{"question": ' + b"[" * 1200 + b"]" * 1200 + b"}"
    for _ in range(rng.randint(1, 6)):
        at = rng.randrange(len(data) + 1)
        op = rng.random()
        if op < 0.4 and data:
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif op < 0.7:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif op < 0.9:
            del data[at:at + rng.randint(1, 8)]
        else:
            data = data[:at]
    return bytes(data)


def headers_for(rng: random.Random, body: bytes) -> tuple[list[str], bytes]:
    """Header lines (Host, auth, Content-Length and friends; for half the requests some of them
    wrong) and the bytes sent as the body (chunked when the headers say so)."""
    if rng.random() < 0.5:
        return ["Host: fuzz", f"Authorization: Bearer {KEY}", "Content-Type: application/json",
                f"Content-Length: {len(body)}"], body
    lines = ["Host: fuzz"] if rng.random() > 0.05 else []
    lines.append(f"Authorization: Bearer {KEY}" if rng.random() > 0.1 else
                 rng.choice(["Authorization: Bearer", "Authorization: Basic eA==", f"Authorization: bearer  {KEY} ",
                             "Authorization: Bearer \x01"]))
    if rng.random() > 0.1:
        lines.append(rng.choice(["Content-Type: application/json", "Content-Type: text/plain",
                                 "Content-Type: application/json; charset=latin-1"]))
    roll = rng.random()
    if roll < 0.6:
        lines.append(f"Content-Length: {len(body)}")
    elif roll < 0.7:
        chunks, rest = b"", body
        while rest:
            size = rng.randint(1, 64)
            chunks += f"{size:x}\r\n".encode() + rest[:size] + b"\r\n"
            rest = rest[size:]
        lines.append("Transfer-Encoding: chunked")
        body = chunks + rng.choice([b"0\r\n\r\n", b"zz\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n"])
    else:
        lines.append(rng.choice([f"Content-Length: {len(body) + rng.randint(1, 50)}",  # stalls: the body timeout
                                 f"Content-Length: {max(0, len(body) - rng.randint(1, 5))}",  # the rest: a next request
                                 "Content-Length: -1", "Content-Length: x", f"Content-Length: {len(body)}, 1",
                                 f"Content-Length: {len(body)}\r\nContent-Length: 0", "Content-Length: 1" + "0" * 30,
                                 f"Content-Length: +{len(body)}", f"Content-Length:  {len(body)} "]))
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        lines.append(rng.choice(["X-Odd: \x00", "Bad Header: 1", "X-Long: " + "a" * 20000, "X-Latin: \xe9",
                                 "Expect: 100-continue", ": empty", "X-Fine: 1", "Connection: keep-alive",
                                 "Transfer-Encoding: gzip"]))
    return lines, body


def request(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.55:
        path, body = json_body(rng)
        data = encode(body)
    elif roll < 0.8:
        path, body = json_body(rng)
        data = mangle(rng, encode(body))
    else:
        path, data = rng.choice(PATHS), mangle(rng, encode(json_body(rng)[1])) if rng.random() < 0.5 else b""
    method = "POST" if roll < 0.8 else rng.choice(METHODS)
    version = "HTTP/1.1" if rng.random() > 0.05 else rng.choice(["HTTP/1.0", "HTTP/2.0", "HTTP/1.1 x", ""])
    lines, data = headers_for(rng, data)
    head = f"{method} {path} {version}\r\n" + "".join(f"{line}\r\n" for line in lines + ["Connection: close"])
    return head.encode("latin-1", "replace") + b"\r\n" + data


def statuses(raw: bytes) -> list[int]:
    """The status of every response on the connection (bytes past a Content-Length are a second request)."""
    out = []
    for part in raw.split(b"HTTP/1.1 ")[1:]:
        code = part[:3]
        if code.isdigit():
            out.append(int(code))
    return out


@pytest.fixture(scope="module")
def store(tiny_dirs, tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("serve_fuzz") / "store", tiny_dirs["receiver"])


def test_fuzzed_requests_never_get_a_5xx_and_the_server_stays_up(store):
    from cachegraft_cli.serving.server import Timeouts

    rng = random.Random(SEED)
    seen: Counter[int] = Counter()
    bad: list[tuple[bytes, bytes]] = []
    with LiveServer({"docs": store}, api_key=KEY, max_new_tokens=8, max_body=1 << 16,
                    timeouts=Timeouts(headers=0.3, body=0.3, shutdown=2)) as server:
        for _ in range(COUNT):
            sent = request(rng)
            raw = raw_request(server.port, sent, limit=15)
            codes = statuses(raw)
            seen.update(codes or [0])  # 0: closed without an answer (a stalled body nobody reads, an idle line)
            if any(c >= 500 for c in codes) or b"This is a bug" in raw:
                bad.append((sent[:300], raw[:300]))
        assert httpx.get(f"{server.url}/health", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        answer = httpx.post(f"{server.url}/v1/ask", json={"question": QUESTIONS[0]},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert answer.status_code == 200 and answer.json()["answer"] is not None
        assert server.worker.load()["admitted"] == 0
    TALLY["serve fuzz: requests sent"] = COUNT
    TALLY["serve fuzz: statuses seen"] = " ".join(f"{code}x{n}" for code, n in sorted(seen.items()))
    TALLY["serve fuzz: 5xx answers"] = len(bad)
    print(f"\nfuzz: {COUNT} requests, statuses {dict(sorted(seen.items()))}, 5xx: {len(bad)}")
    assert not bad, bad[:5]
    assert sum(n for code, n in seen.items() if 200 <= code < 300) >= 20  # the mutations left real answers too
    assert len([c for c in seen if 400 <= c < 500]) >= 5
