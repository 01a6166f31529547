"""The Python API as a user calls it: `import cachegraft_cli as cg` (tiny models)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cachegraft_cli as cg
from cachegraft_cli.errors import NoPassagesError, StoreNotFoundError, UsageError

PASSAGES = [
    {
        "id": "harbor",
        "title": "Harbor town",
        "text": "Harbor town was founded in 1820 by fishermen who built the first lighthouse.",
    },
    {
        "id": "treaty",
        "title": "Treaty",
        "text": "The treaty was signed in Vienna after long talks between the two empires.",
    },
]
MORE = cg.Passage("photo", "Photosynthesis", "Photosynthesis turns light, water and carbon dioxide into sugar and "
                                             "oxygen.")


@pytest.fixture
def store(tiny_dirs, tmp_path):
    path = tmp_path / "store"
    summary = cg.encode_passages(PASSAGES, path, receiver=str(tiny_dirs["receiver"]), dtype="float32", codec="float32")
    assert summary.added == 2 and summary.fuser == "closed"
    cg.index_store(path)
    return path


def test_import_is_light_and_lists_the_api():
    code = (
        "import sys, cachegraft_cli as cg; assert 'torch' not in sys.modules and 'cachegraft_cli.api' not in "
        "sys.modules; "
        "print(sorted(n for n in cg.__all__ if not n.startswith('_')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "open_store" in proc.stdout and "encode_passages" in proc.stdout and "answer_many" in proc.stdout


def test_store_keeps_its_models_across_questions(store, loads):
    graft = cg.open_store(store)
    one = graft.ask("who built the lighthouse?", k=1, max_new_tokens=4)
    assert isinstance(one, cg.Answer) and one.sources[0].id == "harbor" and one.system == "graft"
    assert str(one) == one.text and one.as_dict()["answer"] == one.text and one.tokens["generated"] > 0
    many = graft.ask_many(["who built the lighthouse?", "where was the treaty signed?"], k=1, max_new_tokens=4,
                          batch_size=2)
    assert [a.text for a in many][0] == one.text and many[1].sources[0].id == "treaty"
    text = graft.ask("who built the lighthouse?", k=1, max_new_tokens=4, system="text")
    assert text.text == one.text  # closed fuser, k=1: the cache answer is the text answer
    assert loads == [loads[0]]  # one receiver load for every question and system


def test_append_and_reindex_through_the_handle(store, loads):
    graft = cg.open_store(store)
    graft.warm()
    summary = graft.encode([MORE])  # the store's own models: no model option given
    assert summary.added == 1 and summary.skipped_existing == 0
    assert graft.index()["added"] == 1
    answer = graft.ask("what does photosynthesis make?", k=1, max_new_tokens=2)
    assert answer.sources[0].id == "photo"
    assert len(loads) == 2  # the handle's receiver, plus the one encode loaded; asking after reloads nothing


def test_one_shot_calls_and_their_errors(store, tmp_path):
    answer = cg.answer("where was the treaty signed?", store, k=1, max_new_tokens=3, dtype="float32")
    assert answer.sources[0].id == "treaty"
    assert [a.sources[0].id for a in cg.answer_many(["who built the lighthouse?"], store, k=1, max_new_tokens=2)] == \
        ["harbor"]
    with pytest.raises(UsageError, match="Unknown ask option"):
        cg.answer("q?", store, top_k=3)
    with pytest.raises(UsageError, match="Unknown system"):
        cg.answer("q?", store, system="nope")
    with pytest.raises(NoPassagesError):
        cg.answer("zzqx vvbnm", store)
    with pytest.raises(StoreNotFoundError):
        cg.open_store(tmp_path / "missing")
    assert cg.ask_options(k=5, seed=1).generation.seed == 1


def test_passages_from_dicts_are_checked(tiny_dirs, tmp_path):
    from cachegraft_cli.errors import CorpusError

    with pytest.raises(CorpusError, match=r"\[0\]: missing text"):
        cg.encode_passages([{"id": "x", "title": "no text"}], tmp_path / "s", receiver=str(tiny_dirs["receiver"]))
    assert not (tmp_path / "s").exists()  # refused before anything was written
