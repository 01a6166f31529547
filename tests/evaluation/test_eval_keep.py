"""evaluate's store variants: `SYSTEM@keep=R`, `@codec=C`, `@keep_by=M` answer from their own
store of the same corpus, fused once; the keys of unpruned runs and stores are unchanged."""

import pytest

from cachegraft_cli.errors import UsageError
from cachegraft_cli.evaluation.answerer import AnswererConfig, ReusedFusion, StoreAnswerer
from cachegraft_cli.evaluation.variants import check_variant, parse_variant


def _config(**kw):
    return AnswererConfig("r", "s", "f", stores_dir="/tmp/x", **{"codec": "bf16", **kw})


def test_store_variants_parse_and_name_their_stores():
    v = parse_variant("graft@keep=0.5@codec=int4@recompute=16")
    assert v.store == {"keep": 0.5, "codec": "int4"} and v.assembly == {"recompute": 16}
    answerer = StoreAnswerer(_config(), ["graft", "graft@keep=0.5", "graft@codec=int4@keep=0.5", "text",
                                         "text@notes=48"])
    assert answerer.stores_needed == [("bf16", 1.0, "even", 0), ("bf16", 0.5, "even", 0), ("int4", 0.5, "even", 0),
                                      ("bf16", 1.0, "even", 48)]
    urls = {answerer._store_url("squad", "f", s) for s in answerer.stores_needed}
    urls.add(answerer._store_url("squad", "f", mismatched=True))
    assert len(urls) == 5 and answerer._store_url("squad", "f") in urls
    assert answerer.options("graft@keep=0.5@order=retrieval", 5).order == "retrieval"


def test_the_default_store_is_encode_default():
    from cachegraft_cli.store.codecs import DEFAULT_CODEC

    assert AnswererConfig("r", "s", "f").codec == DEFAULT_CODEC == "int8"


def test_unpruned_keys_are_the_old_keys():
    assert "keep" not in _config().results_key() and "keep_by" not in _config().results_key()
    assert _config(keep=0.5).results_key()["keep"] == 0.5
    assert StoreAnswerer(_config(), ["graft"])._store_url("squad", "f").endswith("squad-" + __import__(
        "hashlib").sha256(b'["r", "s", "f", "bf16"]').hexdigest()[:10])


@pytest.mark.parametrize("bad", ["graft@keep=2", "graft@keep=0", "graft@codec=int3", "graft@keep_by=random"])
def test_bad_store_variants_are_refused(bad):
    with pytest.raises(UsageError):
        check_variant(bad)


def test_reused_fusion_fuses_each_batch_once():
    calls = []

    class Fusion:
        prefix_ids = [1, 2]

        def fuse(self, passages, attention=False, donors=None):
            calls.append(attention)
            return [object() for _ in passages]

    reused = ReusedFusion(Fusion())
    first = reused.fuse([[1, 2], [3]])
    assert reused.fuse([[1, 2], [3]], attention=True) is first and reused.fuse([[4]]) is not first
    assert reused.fuse([[1, 2], [3]], donors=[[3, 4], [1]]) is not first  # another sharer input, fused again
    assert calls == [True, True, True] and reused.prefix_ids == [1, 2]


@pytest.mark.parametrize("stored", [False, True])
def test_a_rerun_keeps_the_calibration_of_the_tc_store_an_earlier_run_made(monkeypatch, stored):
    """evaluate is re-run to resume: a new tc store gets the fuser's calibration, a store an earlier
    (killed) run made keeps its own (encode refuses a calibration named for an existing store)."""
    from types import SimpleNamespace

    from cachegraft_cli.encoding import local
    from cachegraft_cli.retrieval import stored as stored_index
    from cachegraft_cli.store import target

    seen = []
    monkeypatch.setattr(target.Target, "open", classmethod(lambda cls, url: SimpleNamespace(
        store=object() if stored else None, url=url)))
    monkeypatch.setattr(local, "encode_corpus", lambda rows, tgt, session, options, progress=None:
                        seen.append(options.calibration))
    monkeypatch.setattr(stored_index, "build_store_index", lambda *a, **k: None)
    answerer = StoreAnswerer(_config(codec="tc"), ["graft"])
    monkeypatch.setattr(answerer, "_calibration", lambda codec: "shipped.safetensors")
    monkeypatch.setattr(answerer, "_session", lambda fuser: None)
    answerer.prepare("squad", [{"id": "p0", "title": "", "text": "x"}])
    assert seen == [None if stored else "shipped.safetensors"]
