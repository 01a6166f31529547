"""`cachegraft serve` over real HTTP on localhost with tiny models: the openai client (plain
and streaming) and httpx get what `ask --json` prints; concurrent clients; the queue limit;
a client leaving mid-stream; reload after an append; `ask --server`."""

import json
import threading

import httpx
import pytest
from conftest import MIN_GREEDY_MARGIN
from serve_support import (
    NEW,
    QUESTIONS,
    LiveServer,
    ask_json,
    make_store,
    wait_until,
    without_timings,
)

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def store(tiny_dirs, tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("serve") / "store", tiny_dirs["receiver"])


@pytest.fixture(scope="module")
def live(store):
    with LiveServer({"docs": store}) as server:
        yield server


def test_ask_endpoint_returns_what_ask_json_prints(live, store, capsys, monkeypatch):
    for question in QUESTIONS:
        local = ask_json(capsys, monkeypatch, store, question, "-k", 2, "--max-new-tokens", 8)
        served = httpx.post(f"{live.url}/v1/ask", json={"question": question, "k": 2, "max_new_tokens": 8}).json()
        assert without_timings(served) == without_timings(local)
        assert set(served["timings"]) == set(local["timings"])


def test_openai_client_plain_and_streaming(live, store, capsys, monkeypatch):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused")
    question = QUESTIONS[1]
    local = ask_json(capsys, monkeypatch, store, question, "-k", 2, "--max-new-tokens", 8, "--system", "text")
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": question}]
    reply = client.chat.completions.create(model="docs/text", messages=messages, max_tokens=8)
    assert reply.choices[0].message.content == local["answer"]
    assert reply.model_extra["sources"] == local["passages"]
    assert reply.usage.completion_tokens == local["tokens"]["generated"]
    chunks = list(client.chat.completions.create(model="text", messages=messages, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == local["answer"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].model_extra["sources"] == local["passages"]
    graft = client.chat.completions.create(model="docs", messages=messages, max_tokens=8)  # the default system
    assert graft.model_extra["cachegraft"]["system"] == "graft"
    assert "docs/graft" in [m.id for m in client.models.list().data]


def test_sampling_is_honoured_and_seeded(live):
    body = {"question": QUESTIONS[0], "temperature": 1.5, "top_p": 0.9, "seed": 7, "max_new_tokens": 8}
    first, again = (httpx.post(f"{live.url}/v1/ask", json=body).json() for _ in range(2))
    assert first["answer"] == again["answer"]
    greedy = httpx.post(f"{live.url}/v1/ask", json={"question": QUESTIONS[0], "max_new_tokens": 3}).json()
    assert greedy["tokens"]["generated"] <= 3


def test_retrieve_and_health(live):
    hits = httpx.post(f"{live.url}/v1/retrieve", json={"question": "who built the lighthouse?", "k": 1}).json()
    assert [p["id"] for p in hits["passages"]] == ["harbor"] and hits["passages"][0]["title"] == "Harbor town"
    health = httpx.get(f"{live.url}/health").json()
    assert health["status"] == "ok" and health["stores"]["docs"] == {"passages": 3, "indexed": 3}


def test_concurrent_clients_are_all_answered_with_their_own_answers(live, store, capsys, monkeypatch, greedy_margins):
    expected = {q: ask_json(capsys, monkeypatch, store, q, "-k", 2, "--max-new-tokens", 8)["answer"] for q in QUESTIONS}
    asked = QUESTIONS * 4
    answers: dict[int, dict] = {}

    def client(i: int) -> None:
        answers[i] = httpx.post(f"{live.url}/v1/ask", json={"question": asked[i]}, timeout=120).json()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(asked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # batched vs one at a time: equal up to rounding only
    assert [answers[i]["answer"] for i in range(len(asked))] == [expected[q] for q in asked]


def test_questions_waiting_together_are_decoded_as_one_batch(store):
    with LiveServer({"docs": store}, start_worker=False) as server:
        results = []
        threads = [threading.Thread(target=lambda q=q: results.append(
            httpx.post(f"{server.url}/v1/ask", json={"question": q}, timeout=120))) for q in QUESTIONS]
        for t in threads:
            t.start()
        wait_until(lambda: server.worker.load()["waiting"] == 3)
        server.worker.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200, 200, 200]
        assert server.worker.load()["batches"] == {"3": 1}
        assert all(set(r.json()["timings"]) == {"retrieve", "load", "prefill", "first_token", "total"} for r in results)


def test_a_full_queue_answers_429_with_retry_after_and_recovers(store):
    with LiveServer({"docs": store}, start_worker=False, max_queue=2) as server:
        held = []
        threads = [threading.Thread(target=lambda: held.append(
            httpx.post(f"{server.url}/v1/ask", json={"question": QUESTIONS[0]}, timeout=120))) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: server.worker.load()["admitted"] == 2)
        refused = httpx.post(f"{server.url}/v1/ask", json={"question": QUESTIONS[0]})
        assert refused.status_code == 429 and refused.headers["retry-after"].isdigit()
        assert refused.json()["error"]["type"] == "rate_limit_error"
        server.worker.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in held] == [200, 200]
        assert httpx.post(f"{server.url}/v1/ask", json={"question": QUESTIONS[0]}).status_code == 200


def test_a_client_leaving_mid_stream_frees_its_slot(store):
    with LiveServer({"docs": store}, start_worker=False, max_queue=1) as server:
        body = {"model": "docs", "messages": [{"role": "user", "content": QUESTIONS[0]}], "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            first = next(lines)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
            assert server.worker.load()["admitted"] == 1
        wait_until(lambda: server.worker.load()["admitted"] == 0)
        server.worker.start()
        assert httpx.post(f"{server.url}/v1/ask", json={"question": QUESTIONS[0]}).status_code == 200


def test_an_append_is_seen_after_reload_and_by_the_watcher(tiny_dirs, tmp_path):
    import cachegraft_cli as cg

    store = make_store(tmp_path / "store", tiny_dirs["receiver"])
    question = {"question": "when does the comet Velmora return over the lighthouse?", "k": 1}
    with LiveServer({"docs": store}, watch_seconds=0) as server:
        before = httpx.post(f"{server.url}/v1/retrieve", json=question).json()
        cg.encode([NEW], store)
        cg.index(store)
        unchanged = httpx.post(f"{server.url}/v1/retrieve", json=question).json()
        assert unchanged == before and "comet" not in [p["id"] for p in before["passages"]]
        report = httpx.post(f"{server.url}/v1/reload").json()
        assert report["stores"]["docs"] == {"passages": 4, "indexed": 4, "reloaded": True}
        after = httpx.post(f"{server.url}/v1/retrieve", json=question).json()
        assert [p["id"] for p in after["passages"]] == ["comet"]
        answer = httpx.post(f"{server.url}/v1/ask", json=question).json()
        assert [p["id"] for p in answer["passages"]] == ["comet"]
    with LiveServer({"docs": store}, watch_seconds=0.05) as server:
        cg.encode([{**NEW, "id": "comet2", "text": "A second comet, Orrin, was seen in 1911."}], store)
        cg.index(store)
        # the watcher may reload between the append and its index (5 passages, 4 indexed), then again
        wait_until(lambda: httpx.get(f"{server.url}/health").json()["stores"]["docs"] == {"passages": 5, "indexed": 5})


def test_ask_server_prints_what_ask_prints(live, store, tmp_path, capsys, monkeypatch, greedy_margins):
    from cli_support import run_cli

    local = ask_json(capsys, monkeypatch, store, QUESTIONS[0], "-k", 2, "--max-new-tokens", 8)
    served = ask_json(capsys, monkeypatch, "docs", QUESTIONS[0], "-k", 2, "--max-new-tokens", 8, "--server", live.url)
    assert without_timings(served) == without_timings(local)
    code, plain_local, _ = run_cli(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "--show-passages")
    monkeypatch.setenv("CACHEGRAFT_SERVER", live.url)
    code2, plain_served, _ = run_cli(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "--show-passages")
    assert (code, plain_local) == (code2, plain_served)
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(QUESTIONS)))
    code, out, err = run_cli(capsys, monkeypatch, "ask", "--questions", qfile, "--store", "docs", "-b", 3)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["id"] for x in lines] == ["q0", "q1", "q2"]
    monkeypatch.delenv("CACHEGRAFT_SERVER")
    code, out, err = run_cli(capsys, monkeypatch, "ask", "--questions", qfile, "--store", store, "-b", 3)
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # batches formed by arrival vs by file: equal up to rounding
    assert [without_timings(x) for x in lines] == [without_timings(json.loads(line)) for line in out.splitlines()]


def test_a_question_joins_the_running_batch_without_waiting_for_the_others_answer(store):
    """Continuous batching: a question that arrives while another decodes is answered while that
    one is still decoding (it waited for a decode step, not for the other's whole answer)."""
    from cachegraft_cli.answering.options import AskOptions
    from cachegraft_cli.lm.sampling import GenerationOptions
    from cachegraft_cli.serving.worker import Job, JobKind

    with LiveServer({"docs": store}) as server:
        worker, pieces = server.worker, []
        long = Job(JobKind.ASK, "docs", QUESTIONS[0], AskOptions(k=2, generation=GenerationOptions(200)),
                   on_text=pieces.append)
        worker.submit(long)
        wait_until(lambda: len(pieces) >= 2)
        short = worker.submit(Job(JobKind.ASK, "docs", QUESTIONS[1], AskOptions(k=2, generation=GenerationOptions(3))))
        answer = short.future.result(timeout=120)
        assert not long.future.done() and worker.load()["decoding"] == 1
        worker.cancel(long)
        assert 2 <= long.future.result(timeout=120)["tokens"]["generated"] < 200
        assert answer["tokens"]["generated"] <= 3 and worker.load() == {**worker.load(), "admitted": 0, "decoding": 0}
