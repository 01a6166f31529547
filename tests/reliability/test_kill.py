"""Kill tests: `encode`, `index` and `evaluate` SIGKILLed at seeded random moments, then resumed.

After every kill the store must open, verify, hold each passage at most once
with a cache bit-identical to an uninterrupted run's, and an index published
before must still serve; the resumed run must end where an uninterrupted one does.
Kill moments are drawn (seeded) half by wall-clock time since the start of the
process and half by write step (a file written, renamed or linked), so that
some land inside the writes themselves, including the store's creation.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from faults import Cli, Faults, record

from cachegraft_cli.store import CacheStore

PASSAGES = 200
COMMIT_EVERY = 10
KILLS = 20
WORDS = ["amber", "basalt", "cobalt", "dusk", "ember", "frost", "granite", "harbor", "indigo", "jade", "kelp", "lumen"]


def _corpus(path: Path, n: int = PASSAGES) -> Path:
    rng = random.Random(5)
    with open(path, "w") as fh:
        for i in range(n):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            fh.write(json.dumps({"id": f"p{i}", "title": f"N{i}", "text": f"{i} {words}"}) + "\n")
    return path


def _encode_args(corpus: Path, store: Path, receiver) -> list:
    return ["encode", corpus, "--store", store, "--receiver", receiver, "--dtype", "float32",
            "--commit-every", COMMIT_EVERY, "--batch-size", 8]


@pytest.fixture(scope="module")
def reference(tiny_dirs, tmp_path_factory):
    """An uninterrupted encode: its caches, wall time and number of write steps."""
    root = tmp_path_factory.mktemp("kill-ref")
    cli = Cli(root / "logs")
    assert cli.run("--version")[0] == 0  # the fork server is up: what is timed below is the run alone
    corpus = _corpus(root / "corpus.jsonl")
    store = root / "store"
    steps = root / "steps"
    t0 = time.perf_counter()
    code, run = cli.run(*_encode_args(corpus, store, tiny_dirs["receiver"]), faults=Faults(steps_file=str(steps)))
    assert code == 0, run.stderr
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    code, run = cli.run(*_encode_args(corpus, store, tiny_dirs["receiver"]))  # nothing left to do: start-up only
    assert code == 0 and '"added": 0' not in run.stdout, run.stderr
    startup = time.perf_counter() - t0
    ref = CacheStore.open(str(store))
    ids = ref.ids()
    assert len(ids) == PASSAGES
    return {"root": root, "corpus": corpus, "store": store, "cli": cli, "seconds": seconds, "startup": startup,
            "steps": int(steps.read_text()), "caches": dict(zip(ids, ref.read(ids)))}


def _stored(store_dir: Path) -> tuple[int, int]:
    """(passages, rows) of a store: rows - passages is how many are stored twice."""
    store = CacheStore.open(str(store_dir))
    return len(store), sum(len(t) for t in store.tables)


def _check(store_dir: Path, caches: dict) -> int:
    """The invariants after any kill; returns how many passages the store holds."""
    try:
        store = CacheStore.open(str(store_dir))
    except Exception as exc:  # noqa: BLE001 - only "not created yet" is acceptable
        from cachegraft_cli.errors import StoreNotFoundError

        assert isinstance(exc, StoreNotFoundError), f"store unusable after a kill: {exc!r}"
        return 0
    report = store.verify()
    assert report["ok"], report["problems"][:3]
    ids = store.ids()
    rows = sum(len(t) for t in store.tables)
    assert rows == len(ids), "a passage is stored twice"
    assert set(ids) <= set(caches)
    for pid, got in zip(ids, store.read(ids)):
        assert np.array_equal(got, caches[pid]), f"{pid} differs from the uninterrupted run"
    return len(ids)


def _kill_once(cli: Cli, args: list, rng: random.Random, by_step: bool, steps: int, seconds: float) -> bool:
    """Start `args`, SIGKILL it at a drawn moment; True if it was killed (not finished first)."""
    if by_step:
        run = cli.start(*args, faults=Faults(kill_at=rng.randint(1, max(1, steps))))
    else:
        run = cli.start(*args)
        deadline = run.started + rng.uniform(0.0, seconds)
        while run.alive() and time.perf_counter() < deadline:
            time.sleep(0.01)
        if run.alive():
            run.kill()
    code = run.wait()
    assert code in (0, -9), run.stderr[-2000:]
    return code == -9


def test_encode_survives_seeded_sigkills(reference, tiny_dirs):
    rng = random.Random(1515)
    cli, caches = reference["cli"], reference["caches"]
    store = reference["root"] / "killed"
    args = _encode_args(reference["corpus"], store, tiny_dirs["receiver"])
    kills = trials = chains = 0
    held = 0
    while kills < KILLS:
        trials += 1
        by_step = kills % 2 == 1
        remaining = 1 - held / PASSAGES  # a resumed run has fewer steps and less time left to be killed in
        seconds = reference["startup"] + (reference["seconds"] - reference["startup"]) * remaining
        if _kill_once(cli, args, rng, by_step, int(reference["steps"] * remaining) + 8, seconds):
            kills += 1
        held = _check(store, caches)
        if held == PASSAGES and kills < KILLS:  # done before all kills were spent: start a new store
            shutil.rmtree(store)
            held, chains = 0, chains + 1
    code, run = cli.run(*args)
    assert code == 0, run.stderr
    held, rows = _stored(store)
    record(kills=kills, faults=kills, lost=PASSAGES - held, duplicated=rows - held, encode_kill_trials=trials)
    assert _check(store, caches) == PASSAGES


@pytest.mark.parametrize("step", range(1, 9))
def test_kill_during_store_creation_then_resume(reference, tiny_dirs, tmp_path, step):
    """The first write steps create the store (prefix, manifest, zarr.json): a kill there must
    leave something the next run completes, never 'a zarr group but not a cache store'."""
    store, corpus = tmp_path / "store", tmp_path / "small.jsonl"
    corpus.write_text("".join(reference["corpus"].read_text().splitlines(keepends=True)[:12]))  # a small store
    cli = reference["cli"]
    args = _encode_args(corpus, store, tiny_dirs["receiver"])
    code, run = cli.run(*args, faults=Faults(kill_at=step))
    assert code == -9, run.stderr
    _check(store, reference["caches"])
    code, run = cli.run(*args)
    assert code == 0, run.stderr
    held, rows = _stored(store)
    record(kills=1, faults=1, lost=12 - held, duplicated=rows - held)
    assert _check(store, reference["caches"]) == 12
    assert not [p for p in store.iterdir() if ".tmp-" in p.name or p.name.endswith(".partial")]


# ---------------------------------------------------------------- index


QUERIES = ["amber harbor", "cobalt frost ember", "granite jade", "lumen kelp indigo", "17 dusk"]


def _searches(store: Path) -> list:
    from cachegraft_cli.retrieval.stored import open_index

    index = open_index(CacheStore.open(str(store)), str(store))
    return [[h.id for h in index.search(q, 5)] for q in QUERIES]


def test_index_survives_seeded_sigkills(reference):
    rng = random.Random(99)
    cli = reference["cli"]
    store = reference["root"] / "indexed"
    shutil.copytree(reference["store"], store)
    steps_file = reference["root"] / "index-steps"
    t0 = time.perf_counter()
    code, run = cli.run("index", "--store", store, faults=Faults(steps_file=str(steps_file)))
    assert code == 0, run.stderr
    seconds, steps = time.perf_counter() - t0, int(steps_file.read_text())
    expected = _searches(store)
    kills = trials = 0
    while kills < KILLS:
        trials += 1
        args = ["index", "--store", store] + (["--rebuild"] if trials % 2 else [])
        kills += _kill_once(cli, args, rng, kills % 2 == 1, steps + 2, seconds)
        assert _searches(store) == expected  # the published index still serves, whatever was killed
    code, run = cli.run("index", "--store", store)
    assert code == 0, run.stderr
    left = sorted(p.name for p in (store / "index").iterdir())
    assert len(left) == 3 and left[:2] == ["CURRENT", "lock"], left  # no staging or temp files left behind
    assert _searches(store) == expected
    record(kills=kills, faults=kills, index_kill_trials=trials)


# ---------------------------------------------------------------- evaluate


def _squad(path: Path) -> Path:
    rng = random.Random(3)
    data = []
    for a in range(2):
        paragraphs = []
        for p in range(2):
            words = [rng.choice(WORDS) for _ in range(6)]
            qas = [{"id": f"a{a}p{p}q{q}", "question": f"what follows {words[q]} in note {a}-{p}?",
                    "answers": [{"text": words[q + 1], "answer_start": 0}]} for q in range(2)]
            paragraphs.append({"context": f"Note {a}-{p}: " + " ".join(words) + ".", "qas": qas})
        data.append({"title": f"Article {a}", "paragraphs": paragraphs})
    path.write_text(json.dumps({"data": data}))
    return path


def _eval_args(squad: Path, out: Path, stores: Path, receiver) -> list:
    return ["evaluate", "-B", f"tiny={squad}", "--out", out, "--stores", stores, "--systems", "graft,text",
            "--k", "1,2", "--receiver", receiver, "--fuser", "closed", "--dtype", "float32", "--max-new-tokens", 4,
            "--json"]


def _scores(summary: dict) -> dict:
    """Everything a run decides: the whole summary but the systems' timings (which differ run to run)."""
    return {**summary, "systems": [{k: v for k, v in s.items() if k != "timings"} for s in summary["systems"]]}


def test_evaluate_resumed_after_kills_gives_the_uninterrupted_summary(tiny_dirs, tmp_path):
    rng = random.Random(7)
    cli = Cli(tmp_path / "logs")
    assert cli.run("--version")[0] == 0
    squad = _squad(tmp_path / "squad.json")
    t0 = time.perf_counter()
    code, run = cli.run(*_eval_args(squad, tmp_path / "clean", tmp_path / "stores-clean", tiny_dirs["receiver"]))
    assert code == 0, run.stderr
    seconds = time.perf_counter() - t0
    clean = json.loads((tmp_path / "clean" / "summary.json").read_text())
    args = _eval_args(squad, tmp_path / "killed", tmp_path / "stores-killed", tiny_dirs["receiver"])
    kills = trials = 0
    while kills < KILLS and trials < 3 * KILLS:
        trials += 1
        killed = _kill_once(cli, args, rng, False, 0, seconds)
        kills += killed
        if not killed:  # it finished: start over so that every kill interrupts real work
            shutil.rmtree(tmp_path / "killed")
    code, run = cli.run(*args)
    assert code == 0, run.stderr
    resumed = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert _scores(resumed) == _scores(clean)
    assert kills == KILLS
    record(kills=kills, faults=kills, evaluate_kill_trials=trials)
