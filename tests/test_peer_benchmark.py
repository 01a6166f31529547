"""benchmarks/peer_llamacpp.py stays out of the hermetic suite's way: it skips cleanly without the
`peer` extra or the kept GGUF, and its figures are computed as its docstring says."""

import json
import sys

import pytest
from paths import benchmark_module


@pytest.fixture(scope="module")
def peer():
    with benchmark_module("peer_llamacpp") as module:
        yield module


def test_without_the_extra_it_says_why_and_exits_0(peer, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert peer.main(["--per-set", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "not run" in out[0] and "cachegraft[peer]" in out[0]
    parsed = json.loads(out[-1])
    assert parsed["bench"] == "peer_llamacpp" and parsed["run"] is False and "cachegraft[peer]" in parsed["why"]


def test_without_the_kept_gguf_it_names_the_command(peer, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", object())  # the extra "installed"
    monkeypatch.setenv("CACHEGRAFT_HOME", str(tmp_path))  # nothing pulled here
    assert "--keep-gguf" in peer.missing()


def _answer(item: int, first: float, end: float, tokens: int, text: str) -> dict:
    return {"item": item, "first": first, "end": end, "tokens": tokens, "text": text}


def test_figures_of_a_level(peer):
    items = [{"answers": ["Paris"]}, {"answers": ["1910", "in 1910"]}]
    answers = [_answer(0, 0.5, 1.5, 11, "Paris"), _answer(1, 1.0, 2.0, 1, "1911")]
    row = peer.row(answers, items, wall=None)
    assert row["decode_tok_s"] == pytest.approx(10.0)  # one-token answers have no decode time
    assert row["decode_steps_s"] == pytest.approx(11.0)  # 11 < 16 tokens: it stopped, one step more
    assert peer.row(answers, items, wall=None, max_tokens=11)["decode_steps_s"] == pytest.approx(10.0)  # cut off
    assert row["ttft_p50"] == pytest.approx(0.75) and row["whole_p50"] == pytest.approx(1.75)
    assert row["answers_per_s"] == pytest.approx(2 / 3.5)  # one client: answers over their summed time
    assert peer.row(answers, items, wall=2.0)["answers_per_s"] == pytest.approx(1.0)
    assert row["em"] == pytest.approx(50.0) and 50.0 <= row["f1"] < 100.0


def test_agreement_pairs_answers_by_question(peer):
    runs = {("peer-text", 5, 1): [_answer(0, 0, 1, 2, "a"), _answer(1, 0, 1, 2, "b")],
            ("text", 5, 1): [_answer(1, 0, 1, 2, "b"), _answer(0, 0, 1, 2, "x")]}
    assert peer.agreement(runs, 5, 1) == pytest.approx(0.5)
    assert peer.agreement(runs, 3, 1) is None


def test_a_failed_request_is_counted_not_dropped(peer):
    def one(i):
        if i == 1:
            raise RuntimeError("server said no")
        return {"first": 0.1, "end": 0.2, "text": "Paris", "tokens": 2}

    got = sorted(peer.concurrently(one, [0, 1, 2], 2), key=lambda a: a["item"])
    assert [("error" in a) for a in got] == [False, True, False] and "server said no" in got[1]["error"]
    items = [{"answers": ["Paris"]}] * 3
    row = peer.row(got, items, wall=None)
    assert row["answers"] == 2 and row["errors"] == 1 and row["em"] == pytest.approx(100.0)
    assert peer.row([got[1]], items, wall=None) is None  # nothing answered: no figures to make up
