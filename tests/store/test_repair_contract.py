"""The verify / repair contract (docs/store-format.md, "What verify and repair may do"):
repair and compact never delete a row they could read and check; what they cannot judge goes to
`<store>/quarantine/<id>/`, named in their output; every passage dropped or left unchecked is
named; `store repair --undo ID` puts the store back as it was. Plus a manifest fuzzer: whatever
a hand edit does to manifest.json, every command works or exits with a clean error (never 70),
and a repair afterwards holds every row the segments hold.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from cli_support import run_cli
from faults import record
from store_support import indexed_store

from cachegraft_cli.store.store import CacheStore

WORDS = ["amber", "basalt", "cobalt", "dusk", "ember", "frost", "granite", "harbor", "indigo", "jade", "kelp", "lumen",
         "moss", "nickel", "opal", "pearl", "quartz", "rust", "slate", "topaz"]


def run(capsys, monkeypatch, *args):
    code, out, err = run_cli(capsys, monkeypatch, *args, forbid=("Traceback", "this is a bug"))
    assert code != 70, err
    return code, out, err


@pytest.fixture(scope="module")
def pristine(tiny_dirs, tmp_path_factory):
    """20 passages in 4 segments of 5, indexed; each passage has its own word."""
    built = indexed_store(tmp_path_factory.mktemp("contract"), WORDS, tiny_dirs["receiver"], commit_every=5)
    assert built.pop("segments") == 4
    return built


@pytest.fixture
def store(pristine, tmp_path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(pristine["store"], copy)
    return copy


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a store but the lock and the index, by path (what undo must restore)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "writer.lock" and "index" not in p.relative_to(root).parts}


def _holds_everything(store: Path, caches: dict) -> None:
    """Every passage of the pristine store, with the very same cache, and nothing twice."""
    opened = CacheStore.open(str(store))
    assert sorted(opened.ids()) == sorted(caches) and sum(len(t) for t in opened.tables) == len(caches)
    assert opened.verify()["ok"]
    for pid, got in zip(opened.ids(), opened.read(opened.ids())):
        assert np.array_equal(got, caches[pid]), pid


def _edit(store: Path, change) -> None:
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _segment(store: Path, i: int) -> str:
    return json.loads((store / "manifest.json").read_text())["segments"][i]["name"]


# ---------------------------------------------------------------- the three cases repair used to destroy


def test_lost_manifest_and_commit_records_keep_every_passage_and_the_repair_undoes(store, pristine, capsys,
                                                                                   monkeypatch):
    (store / "manifest.json").unlink()
    for commit in (store / "segments").glob("*/commit.json"):
        commit.unlink()
    damaged = _files(store)
    code, _, err = run(capsys, monkeypatch, "store", "verify", store)
    assert code == 7 and "manifest.json is missing" in err and "4 segments" in err
    code, out, err = run(capsys, monkeypatch, "store", "repair", store, "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"] and result["dropped"] == [] and len(result["commits_written"]) == 4, err
    _holds_everything(store, pristine["caches"])
    undo = result["undo"]
    assert undo and Path(result["quarantine"]).is_dir()
    code, _, err = run(capsys, monkeypatch, *undo.split()[1:])
    assert code == 0, err
    assert _files(store) == damaged  # byte for byte as before the repair
    record(faults=1, damage=1, lost=0)


def test_negative_tokens_in_the_manifest_are_refused_then_rebuilt_without_a_loss(store, pristine, capsys,
                                                                                  monkeypatch):
    _edit(store, lambda m: m["segments"][1].update(tokens=-5))
    for args in (["store", "verify", store], ["store", "info", store], ["store", "compact", store, "--grace", 0]):
        code, _, err = run(capsys, monkeypatch, *args)
        assert code == 7 and "segments[1] has tokens=-5" in err and "store repair" in err, err
    code, out, err = run(capsys, monkeypatch, "store", "repair", store, "--json")
    assert code == 0 and json.loads(out)["dropped"] == [], err
    _holds_everything(store, pristine["caches"])


def test_a_wrong_token_count_is_fixed_from_the_commit_record_not_by_dropping_the_segment(store, pristine, capsys,
                                                                                          monkeypatch):
    name = _segment(store, 1)
    _edit(store, lambda m: m["segments"][1].update(tokens=m["segments"][1]["tokens"] + 7))
    code, out, err = run(capsys, monkeypatch, "store", "verify", store, "--json")
    problems = json.loads(out)["problems"]
    assert code == 7 and [(p["code"], p["segment"]) for p in problems] == [("entry", name)], err
    code, out, err = run(capsys, monkeypatch, "store", "repair", store, "--json")
    result = json.loads(out)
    assert code == 0 and result["dropped"] == [] and result["entries_fixed"] == [name], err
    _holds_everything(store, pristine["caches"])


def test_compact_never_deletes_a_listed_segment_marked_retired(store, pristine, capsys, monkeypatch):
    name = _segment(store, 1)
    _edit(store, lambda m: m.update(retired=[{"name": name, "retired": "2020-01-01T00:00:00+00:00"}]))
    code, _, err = run(capsys, monkeypatch, "store", "compact", store, "--grace", 0, "--target-bytes", 1)
    assert code == 0, err  # nothing to merge at this target: only the retired record is looked at
    assert (store / "segments" / name).is_dir()
    assert "retired" not in json.loads((store / "manifest.json").read_text()) or \
        name not in {r["name"] for r in json.loads((store / "manifest.json").read_text())["retired"]}
    _holds_everything(store, pristine["caches"])
    code, _, err = run(capsys, monkeypatch, "store", "compact", store, "--grace", 0)
    assert code == 0, err
    _holds_everything(store, pristine["caches"])


# ---------------------------------------------------------------- a listed segment that is gone


@pytest.mark.parametrize("what", ["directory", "rows.bin"])
def test_a_missing_segment_is_named_readers_go_on_writers_point_at_repair(what, store, pristine, capsys,
                                                                          monkeypatch):
    name = _segment(store, 2)
    lost = set(CacheStore.open(str(store)).tables[2].ids)
    if what == "directory":
        shutil.rmtree(store / "segments" / name)
    else:
        (store / "segments" / name / "rows.bin").unlink()
    code, out, err = run(capsys, monkeypatch, "store", "verify", store, "--json")
    (problem,) = json.loads(out)["problems"]
    assert code == 7 and problem["segment"] == name and set(problem["passages"]) == lost, err
    more = store.parent / "more.jsonl"
    more.write_text(json.dumps({"id": "new", "text": "a new passage"}) + "\n")
    for args in (["store", "info", store], ["store", "compact", store, "--grace", 0],
                 ["encode", more, "--store", store, "--receiver", pristine["receiver"]], ["index", "--store", store]):
        code, _, err = run(capsys, monkeypatch, *args)
        assert code == 7 and name in err and "store repair" in err, (args, err)
    gone = min(lost)
    code, _, err = run(capsys, monkeypatch, "ask", f"what about {WORDS[int(gone[1:])]}?", "--store", store, "-k", 1,
                       "--max-new-tokens", 2)
    assert code == 7 and repr(gone) in err and name in err, err
    code, out, err = run(capsys, monkeypatch, "ask", "what about amber?", "--store", store, "-k", 1,
                         "--max-new-tokens", 2, "--json")
    assert code == 0 and json.loads(out)["passages"][0]["id"] == "p0", err
    code, out, err = run(capsys, monkeypatch, "store", "repair", store, "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"] and {u["passage"] for u in result["unchecked"]} == lost, err
    assert name in result["quarantined"] and (Path(result["quarantine"]) / "segments" / name).exists() == \
        (what == "rows.bin")
    assert set(CacheStore.open(str(store)).ids()) == set(pristine["caches"]) - lost
    code, out, err = run(capsys, monkeypatch, "encode", pristine["corpus"], "--store", store, "--receiver",
                         pristine["receiver"], "--dtype", "float32", "--json")
    assert code == 0 and json.loads(out)["added"] == len(lost), err


def test_repair_rebuilds_a_deleted_index(store, capsys, monkeypatch):
    shutil.rmtree(store / "index")
    code, _, err = run(capsys, monkeypatch, "store", "repair", store)
    assert code == 0 and "rebuilt the bm25 index over 20 passages" in err, err
    code, out, err = run(capsys, monkeypatch, "ask", "what about kelp?", "--store", store, "-k", 1, "--json",
                         "--max-new-tokens", 2)
    assert code == 0 and json.loads(out)["passages"][0]["id"] == "p10", err


# ---------------------------------------------------------------- hand-edited manifests


def _variants(first: str, second: str) -> dict:
    """Hand edits of a 4-segment manifest, by name."""
    def seg(i, **kw):
        return lambda m: m["segments"][i].update(**kw)

    def drop(i, key):
        return lambda m: m["segments"][i].pop(key)

    return {
        "retired time unreadable": lambda m: m.update(retired=[{"name": first, "retired": "last tuesday"}]),
        "retired time without zone": lambda m: m.update(retired=[{"name": first, "retired": "2020-01-01T00:00:00"}]),
        "retired a string": lambda m: m.update(retired="yes"),
        "retired entry a list": lambda m: m.update(retired=[[first]]),
        "retired an unlisted segment that does not exist": lambda m: m.update(
            retired=[{"name": "20200101T000000-x-1-abcdef", "retired": "2020-01-01T00:00:00+00:00"}]),
        "retired a listed segment": lambda m: m.update(retired=[{"name": second, "retired": "2020-01-01T00:00:00Z"}]),
        "name missing": drop(0, "name"),
        "name a number": seg(0, name=7),
        "name a path": seg(0, name="../../elsewhere"),
        "name of a segment that does not exist": seg(1, name="20200101T000000-x-1-abcdef"),
        "name listed twice": seg(1, name=first),
        "bytes missing": drop(2, "bytes"),
        "bytes a string": seg(2, bytes="many"),
        "rows missing": drop(3, "rows"),
        "rows a string": seg(3, rows="5"),
        "rows too many": seg(3, rows=50),
        "tokens a float": seg(0, tokens=1.5),
        "tokens zero": seg(0, tokens=0),
        "token_extent below tokens": seg(0, token_extent=1),
        "token_extent far beyond": seg(0, token_extent=10**9),
        "generation a string": lambda m: m.update(generation="twelve"),
        "generation negative": lambda m: m.update(generation=-1),
        "format_version a string": lambda m: m.update(format_version="2"),
        "segments an object": lambda m: m.update(segments={"a": 1}),
        "segments empty": lambda m: m.update(segments=[]),
        "segment entry a string": lambda m: m["segments"].__setitem__(1, "x"),
        "a segment left out": lambda m: m["segments"].pop(1),
        "order reversed": lambda m: m["segments"].reverse(),
    }


VARIANTS = sorted(_variants("a", "b"))
COMMANDS = (["store", "info", "{s}", "--json"], ["store", "verify", "{s}"], ["store", "compact", "{s}", "--grace", "0"],
            ["store", "repair", "{s}"], ["store", "verify", "{s}"])


def _try_every_command(store: Path, caches: dict, capsys, monkeypatch) -> list[int]:
    codes = []
    for args in COMMANDS:
        code, _, err = run(capsys, monkeypatch, *[str(store) if a == "{s}" else a for a in args])
        codes.append(code)
    assert codes[-1] == 0  # repaired
    _holds_everything(store, caches)
    return codes


@pytest.mark.parametrize("variant", VARIANTS)
def test_hand_edited_manifest_never_exits_70_and_repair_keeps_every_row(variant, store, pristine, capsys,
                                                                          monkeypatch):
    names = [_segment(store, i) for i in range(2)]
    _edit(store, _variants(*names)[variant])
    codes = _try_every_command(store, pristine["caches"], capsys, monkeypatch)
    record(bad_inputs=len(codes), lost=0)


def _mutate(manifest: dict, rng: random.Random) -> None:
    """One random deletion, type change or out-of-range value somewhere in the manifest."""
    junk = [None, "x", -1, 1.5, 10**12, [], {}, True, "2020-01-01T00:00:00+00:00"]
    spots: list[tuple[dict, str]] = [(manifest, k) for k in list(manifest)]
    for entry in manifest.get("segments", []):
        spots += [(entry, k) for k in list(entry)]
    for entry in manifest.get("retired", []) if isinstance(manifest.get("retired"), list) else []:
        spots += [(entry, k) for k in list(entry)]
    target, key = rng.choice(spots)
    action = rng.choice(["delete", "junk", "junk", "shift"])
    if action == "delete":
        del target[key]
    elif action == "shift" and isinstance(target[key], int) and not isinstance(target[key], bool):
        target[key] += rng.choice([-10**6, -5, -1, 1, 7, 10**6])
    else:
        target[key] = rng.choice(junk)


def _fuzz_once(pristine, seed: int, capsys, monkeypatch) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        shutil.copytree(pristine["store"], store)
        if rng.random() < 0.5:  # a store compaction left retired records in, for the fuzzer to break
            _edit(store, lambda m: m.update(retired=[{"name": "20200101T000000-x-1-abcdef",
                                                      "retired": "2026-01-01T00:00:00+00:00"}]))
        for _ in range(rng.randint(1, 3)):
            _edit(store, lambda m: _mutate(m, rng))
        _try_every_command(store, pristine["caches"], capsys, monkeypatch)


def test_manifest_fuzzer_seeded(pristine, capsys, monkeypatch):
    for seed in range(12):
        _fuzz_once(pristine, seed, capsys, monkeypatch)
    record(bad_inputs=12 * len(COMMANDS), lost=0)


def test_manifest_schema_hypothesis(pristine, capsys, monkeypatch):
    """Hypothesis over the manifest's fields: any value of any JSON type in any of them."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    values = st.recursive(st.none() | st.booleans() | st.integers(-10**9, 10**9) | st.floats(allow_nan=False)
                          | st.text(max_size=30), lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
    top = st.sampled_from(["format_version", "generation", "updated", "segments", "retired"])
    entry_key = st.sampled_from(["name", "rows", "tokens", "bytes", "token_extent", "committed"])

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(where=st.one_of(st.tuples(st.just("top"), top, st.integers(0, 3)),
                           st.tuples(st.just("entry"), entry_key, st.integers(0, 3))), value=values)
    def check(where, value):
        scope, key, index = where

        def change(m):
            (m if scope == "top" else m["segments"][index])[key] = value

        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store"
            shutil.copytree(pristine["store"], store)
            _edit(store, change)
            _try_every_command(store, pristine["caches"], capsys, monkeypatch)

    check()


# ---------------------------------------------------------------- readers racing compaction


def test_a_reader_that_loses_a_race_with_compaction_reads_on(store, pristine):
    """A snapshot opened before `compact --grace 0` deleted its segments re-reads the manifest."""
    from cachegraft_cli.store.compact import CompactOptions, compact

    reader = CacheStore.open(str(store))
    before = {e["name"] for e in reader.segments}
    report = compact(str(store), CompactOptions(grace_seconds=0))
    assert set(report["retired_deleted"]) == before  # the files this snapshot lists are gone
    ids = sorted(pristine["caches"])
    for pid, got in zip(ids, reader.read(ids)):
        assert np.array_equal(got, pristine["caches"][pid])
    assert [r.id for r in reader.get_rows(ids)] == ids and {e["name"] for e in reader.segments} != before


def test_ask_between_compactions_answers_every_question(store, pristine):
    """An `Asker` (what `ask --questions` holds for a whole run) keeps answering across compactions."""
    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.answering.options import AskOptions
    from cachegraft_cli.lm.generation import GenerationOptions
    from cachegraft_cli.store.compact import CompactOptions, compact

    asker = Asker(str(store))
    options = AskOptions(k=1, generation=GenerationOptions(max_new_tokens=2))
    for i, word in enumerate(WORDS[:3]):
        if i == 1:  # every segment the asker's snapshot lists is merged, then deleted at once
            assert len(compact(str(store), CompactOptions(grace_seconds=0))["retired_deleted"]) == 4
        result = asker.ask(f"what about {word}?", options)
        assert result["passages"][0]["id"] == f"p{i}"
