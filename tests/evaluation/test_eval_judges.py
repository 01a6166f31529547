"""The LM judge on a tiny random-weight model (real code path, offline)."""

import pytest

from cachegraft_cli.errors import ModelLoadError
from cachegraft_cli.evaluation.judges import JudgeItem, LMJudge, PairItem, judge_name, load_judge


def tiny_causal_lm(vocab_size: int, seed: int = 5):
    """A 2-layer random Qwen2 (not saved: built in memory only)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from tiny import build_tokenizer
    from transformers import PreTrainedTokenizerFast

    chat = build_tokenizer(tmp_path_factory.mktemp("judge"), "a")  # chat template + pad token
    plain = PreTrainedTokenizerFast(tokenizer_object=chat.backend_tokenizer, eos_token="<|im_end|>")  # neither
    model = tiny_causal_lm(len(chat))
    return {"a": (model, chat), "b": (model, plain)}


ITEMS = [
    JudgeItem("Who built the lighthouse?", ["the fishermen"], "The fishermen of Harbor town built it."),
    JudgeItem("When was Harbor town founded?", ["1820"], "1820"),
    JudgeItem("Where was the treaty signed?", ["Vienna", "in Vienna"], "It was signed in Paris, long ago, "
              "after talks between the two empires that went on for years."),
]


@pytest.mark.parametrize("kind", ["a", "b"])
def test_lm_judge_end_to_end(tiny_lm, kind):
    model, tok = tiny_lm[kind]
    judge = load_judge("some/dir/tiny-judge", load_model=lambda spec: (model, tok), batch_size=2)
    assert judge.name == "tiny-judge"
    verdicts = judge.judge(ITEMS)
    assert len(verdicts) == 3
    for v in verdicts:
        assert v.verdict in (0, 1) and 0.0 <= v.probability <= 1.0
        assert v.verdict == int(v.probability >= 0.5)
    # batching with left padding gives the same probabilities as one at a time
    single = LMJudge(model, tok, batch_size=1).judge(ITEMS)
    assert [v.probability for v in verdicts] == pytest.approx([v.probability for v in single], abs=1e-5)


def test_pairwise_judge_is_order_symmetric(tiny_lm):
    model, tok = tiny_lm["a"]
    judge = LMJudge(model, tok, batch_size=4)
    item = PairItem("k1", "When was Harbor town founded?", ["1820"], "1820", "in 1900")
    swapped = PairItem("k1", item.question, item.golds, item.answer_b, item.answer_a)
    (v,), (w,) = judge.judge_pairs([item], seed=0), judge.judge_pairs([swapped], seed=0)
    assert v.verdict in ("a", "b", "tie") and 0.0 <= v.prob_a <= 1.0
    # both orders are always read, so swapping the answers mirrors the result
    assert v.prob_a == pytest.approx(1.0 - w.prob_a, abs=1e-5)
    assert {v.verdict, w.verdict} in ({"tie"}, {"a", "b"})


def test_loader_accepts_loaded_model_objects(tiny_lm):
    model, tok = tiny_lm["b"]

    class Loaded:
        def __init__(self):
            self.model, self.tokenizer = model, tok

    judge = load_judge("x.gguf", load_model=lambda spec: Loaded())
    assert judge.name == "x" and judge.judge(ITEMS[:1])[0].verdict in (0, 1)
    judge.close()
    assert judge.model is None


def test_unusable_tokenizer_is_reported():
    class Tok:
        pad_token, eos_token, unk_token_id = "<pad>", "</s>", 0

        def encode(self, text, add_special_tokens=False):
            return [0]

    with pytest.raises(ModelLoadError):
        LMJudge(object(), Tok())


def test_judge_name():
    assert judge_name("Qwen/Qwen3-1.7B") == "Qwen3-1.7B"
    assert judge_name("/models/llama/") == "llama"


class _EchoAnswerer:
    """graft answers the gold, text a wrong word; retrieval returns the gold passage."""

    def prepare(self, name, passages):
        pass

    def answer(self, name, questions, system, k):
        return [{"answer": q.answers[0] if system == "graft" else "lighthouse", "passages": [{"id": q.gold_ids[0]}],
                 "timings": {"first_token": 0.0, "total": 0.0}} for q in questions]

    def close_models(self):
        pass


def test_run_with_lm_judge_and_pairwise(tiny_lm, tmp_path):
    import json

    from cachegraft_cli.evaluation.protocol import RunConfig, run_evaluation

    rows = [{"id": f"q{i}", "question": f"What year is number {i}?", "answers": [str(1820 + i)],
             "context": f"Year {1820 + i}.", "title": "Years"} for i in range(4)]
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    model, tok = tiny_lm["a"]
    config = RunConfig(benchmarks=[str(qa)], systems=["graft", "text"], out=tmp_path / "out", ks=[1],
                       judges=["tiny/lm-judge"], pairwise=True, bootstrap_samples=100)
    loader = lambda spec: load_judge(spec, load_model=lambda s: (model, tok), batch_size=3)  # noqa: E731
    summary = run_evaluation(config, _EchoAnswerer(), loader, progress=False)
    verdicts = [json.loads(x) for x in (tmp_path / "out/verdicts.jsonl").read_text().splitlines()]
    assert len(verdicts) == 8 and all(v["verdict"] in (0, 1) and 0 <= v["probability"] <= 1 for v in verdicts)
    (pair,) = summary["pairwise"]
    assert (pair["a"], pair["b"], pair["n"]) == ("graft", "text", 4)
    assert pair["a_better"] + pair["ties"] + pair["b_better"] == 4
    assert {c["judge"] for c in summary["comparisons"]} == {"em", "lm-judge"}
    assert "## Pairwise judge preferences (both orders averaged)" in (tmp_path / "out/report.md").read_text()
