
"""Slow: the real offline receiver (`cachegraft models pull offline`, or $CACHEGRAFT_TEST_RECEIVER);
skipped when absent."""

import json

import pytest
from paths import SAMPLE_DATA
from real_models import real_model, reason

RECEIVER = real_model("CACHEGRAFT_TEST_RECEIVER", "qwen2.5-coder-0.5b-instruct")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not RECEIVER, reason=reason("CACHEGRAFT_TEST_RECEIVER", "qwen2.5-coder-0.5b-instruct")),
]
SAMPLE = SAMPLE_DATA / "corpus.jsonl"


def test_real_receiver_answers_from_its_cache_like_from_text(tmp_path):
    from cachegraft_cli.answering.ask import Asker, AskOptions
    from cachegraft_cli.corpus import read_corpus
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.lm.generation import GenerationOptions
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.session import ModelChoice, ModelSession
    from cachegraft_cli.store.target import Target

    passages = [p for p in read_corpus(SAMPLE) if p.id.startswith("harrowmere")]
    session = ModelSession(ModelChoice(RECEIVER, None, "closed", device="cpu", dtype="float32"))
    url = str(tmp_path / "store")
    encode_corpus(passages, Target.open(url), session, EncodeOptions(codec="float32"))
    build_store_index(url)
    asker = Asker(url, session=session)
    question = "Who led the peat cutters that founded Harrowmere?"
    answers = {s: asker.ask(question, AskOptions(s, 1, generation=GenerationOptions(12)))["answer"]
               for s in ("graft", "text")}
    assert "Odile Varran" in answers["graft"], json.dumps(answers)
    assert answers["graft"] == answers["text"]
