"""`encode --runner ray` on a local Ray runtime (2 CPUs, shared by all tests): the same store as
the local runner, bit for bit; failed tasks retried without duplicates; a SIGKILLed driver re-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from tiny import open_fuser

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.local import encode_corpus
from cachegraft_cli.encoding.plan import EncodeOptions
from cachegraft_cli.encoding.ray.driver import RayOptions, encode_on_ray  # imports no ray itself
from cachegraft_cli.errors import StoreMismatchError
from cachegraft_cli.session import ModelChoice, ModelSession
from cachegraft_cli.store import CacheStore, segments
from cachegraft_cli.store.target import Target

pytest.importorskip("ray")

N = 200  # a few hundred passages
OPTIONS = EncodeOptions(codec="bf16", batch_size=8, commit_every=25)  # 8 windows of 25
WORDS = ["harbor", "town", "was", "founded", "by", "fishermen", "who", "built", "the", "first", "lighthouse",
         "near", "the", "river", "bank", "the", "treaty", "was", "signed", "in", "vienna", "after", "long", "talks",
         "photosynthesis", "turns", "light", "into", "sugar"]


def _passages(n: int) -> list[Passage]:
    """Passages of 3 to 24 words, so batches are padded and their composition matters."""
    return [Passage(f"p{i}", f"Title {i % 17}", " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 22)))
            for i in range(n)]


@pytest.fixture(scope="module")
def choice(tiny_models, tiny_dirs, tmp_path_factory):
    """receiver <- sharer_same through a random fuser with open gates (so fusion is not the identity)."""
    from cachegraft_cli.fuser.checkpoint import save_published

    path = tmp_path_factory.mktemp("fuser") / "open"
    save_published(open_fuser(tiny_models["receiver"], tiny_models["sharer_same"], seed=3), path)
    return ModelChoice(str(tiny_dirs["receiver"]), str(tiny_dirs["sharer_same"]), str(path), device="cpu",
                       dtype="float32")


@pytest.fixture(scope="module")
def local_store(choice, tmp_path_factory):
    """The reference: the local runner's store of the whole corpus."""
    url = str(tmp_path_factory.mktemp("local") / "store")
    summary = encode_corpus(_passages(N), Target.open(url), ModelSession(choice), OPTIONS)
    assert summary.added == N and len(summary.segments) == 8
    return CacheStore.open(url)


def _tables(store):
    return segments.load_tables(store.loc, [s["name"] for s in store.segments], store.rows_file)


def assert_same_as_local(url: str, local, n: int = N) -> CacheStore:
    """Same passages, each exactly once, in the same segments (windows), with bit-identical caches."""
    store = CacheStore.open(url)
    tables, reference = _tables(store), _tables(local)
    listed = [pid for t in tables for pid in t.ids]
    assert len(listed) == len(set(listed)) == len(store) == n  # every passage exactly once
    assert [t.ids for t in tables] == [t.ids for t in reference][: len(tables)]  # same windows, plan order
    ids = [f"p{i}" for i in range(n)]
    for a, b in zip(store.read(ids), local.read(ids)):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # bit-identical (bf16 words)
    assert [t.hashes.tolist() for t in tables] == [t.hashes.tolist() for t in reference][: len(tables)]
    assert store.verify()["ok"]
    return store


def test_two_actors_make_the_local_runners_store(ray_cluster, choice, local_store, tmp_path):
    url = str(tmp_path / "ray")
    summary = encode_on_ray(_passages(N), Target.open(url), choice, OPTIONS, RayOptions(actors=2, commit_seconds=0))
    assert summary.added == N and summary.tokens == local_store.info()["tokens"] and len(summary.segments) == 8
    store = assert_same_as_local(url, local_store)
    assert [s["name"] for s in store.segments] == summary.segments
    assert {s["run_info"]["engine"] for s in store.segments} == {"ray"}
    pids = {s["name"].rsplit("-", 2)[1] for s in store.segments}  # <time>-<host>-<pid>-<random>
    # written by the pool's actors: usually both, but Ray Data hands windows to whichever actor is
    # free, and on 2 busy cores one actor can take all 8 before the other starts (seen in CI)
    assert 1 <= len(pids) <= 2
    again = encode_on_ray(_passages(N), Target.open(url), choice, OPTIONS, RayOptions(actors=2))
    assert again.added == 0 and again.skipped_existing == N and again.segments == []


def test_a_tc_store_on_ray_is_the_local_runners_with_the_drivers_calibration(ray_cluster, choice, local_store,
                                                                              tmp_path):
    """The driver reads the calibration once and the set-up task stores it: the Ray store holds the
    same calibration and the same bytes as the local runner's, and appends reuse it."""
    from cachegraft_cli.encoding.calibration import fit_from_store
    from cachegraft_cli.store.transform import FitOptions

    cal_file = tmp_path / "cal.safetensors"
    cal_file.write_bytes(fit_from_store(local_store.loc.url, FitOptions())[0].to_bytes())
    options = EncodeOptions(codec="tc", batch_size=8, commit_every=25, calibration=str(cal_file))
    local, ray_url = str(tmp_path / "local"), str(tmp_path / "ray")
    encode_corpus(_passages(50), Target.open(local), ModelSession(choice), options)
    encode_on_ray(_passages(50), Target.open(ray_url), choice, options, RayOptions(actors=2, commit_seconds=0))
    a, b = CacheStore.open(local), CacheStore.open(ray_url)
    assert a.codec.params == b.codec.params and a.info()["codec_tables"] == b.info()["codec_tables"]
    ids = [f"p{i}" for i in range(50)]
    assert all(np.array_equal(x, y) for x, y in zip(a.read(ids), b.read(ids)))
    encode_on_ray(_passages(60), Target.open(ray_url), choice, replace(options, calibration=None), RayOptions(actors=1))
    assert len(CacheStore.open(ray_url)) == 60 and CacheStore.open(ray_url).verify()["ok"]


def test_store_mismatches_are_refused(ray_cluster, choice, local_store):
    with pytest.raises(StoreMismatchError, match="codec"):  # found by the driver, before any actor starts
        encode_on_ray(_passages(3), Target.open(local_store.loc.url), choice, EncodeOptions(codec="int8"), RayOptions())
    closed = ModelChoice(choice.receiver, None, "closed", device="cpu", dtype="float32")
    with pytest.raises(StoreMismatchError, match="sharer") as info:  # found by an actor, from the weights
        encode_on_ray(_passages(N + 3), Target.open(local_store.loc.url), closed, OPTIONS, RayOptions())
    assert "store info" in info.value.hint
    assert len(CacheStore.open(local_store.loc.url)) == N  # nothing written


def test_failed_tasks_are_retried_without_duplicates(ray_cluster, choice, local_store, tmp_path):
    from ray_support import FailTwice

    url, n = str(tmp_path / "ray"), 100  # four windows
    summary = encode_on_ray(_passages(n), Target.open(url), choice, OPTIONS, RayOptions(actors=2, commit_seconds=0),
                            worker=FailTwice)
    assert os.path.exists(url + ".crashed") and os.path.exists(url + ".errored")  # both failures happened
    store = assert_same_as_local(url, local_store, n)
    assert summary.added == n and len(store.segments) == 4
    on_disk = set(store.loc.list_names("segments")) - {"zarr.json"}
    orphans = sorted(on_disk - {s["name"] for s in store.segments})
    complete = sorted(store.loc.exists(f"segments/{name}/commit.json") for name in orphans)
    assert complete == [False, True]  # one half-written, one complete duplicate: neither listed
    store.writer().abort()  # the next writer deletes them
    assert set(store.loc.list_names("segments")) - {"zarr.json"} == {s["name"] for s in store.segments}


def _encode_cmd(corpus, store, choice, address):
    return [sys.executable, "-m", "cachegraft_cli", "encode", str(corpus), "--store", str(store),
            "--receiver", choice.receiver, "--sharer", choice.sharer, "--fuser", choice.fuser, "--device", "cpu",
            "--dtype", "float32", "--codec", OPTIONS.codec, "--batch-size", str(OPTIONS.batch_size),
            "--commit-every", str(OPTIONS.commit_every), "--runner", "ray", "--address", address, "--actors", "2",
            "--json"]


def test_sigkill_of_the_driver_then_rerun_completes_the_store(ray_cluster, choice, local_store, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in _passages(N)))
    url = tmp_path / "ray"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(_encode_cmd(corpus, url, choice, ray_cluster), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    manifest = url / "manifest.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if manifest.exists() and json.loads(manifest.read_text()).get("segments"):
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the job ended before it could be killed: {proc.stderr.read()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = CacheStore.open(str(url))
    assert 0 < len(partial) < N and partial.verify()["ok"]  # committed windows only
    done = subprocess.run(_encode_cmd(corpus, url, choice, ray_cluster), env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["added"] == N - len(partial) and summary["skipped_existing"] == len(partial)
    assert_same_as_local(str(url), local_store)


@pytest.fixture
def s3_store(s3_bucket):
    """A store URL in a fresh bucket on the test's S3 server (see `s3_bucket`)."""
    return f"s3://{s3_bucket}/store"


def _ask(url: str, questions: list[str]) -> list[tuple[str, int]]:
    """(answer, array bytes read from the store) per question."""
    from cachegraft_cli.answering.ask import Asker, AskOptions
    from cachegraft_cli.lm.generation import GenerationOptions

    asker = Asker(url)
    out = []
    for q in questions:
        before = asker.store.stats_bytes_read
        result = asker.ask(q, AskOptions("graft", 3, generation=GenerationOptions(max_new_tokens=6)))
        out.append((result["answer"], asker.store.stats_bytes_read - before))
    return out


def test_s3_round_trip_encode_ask_compact(ray_cluster, choice, local_store, s3_store, s3_server, record_property):
    """Ray actors write segments to a real S3 server on localhost; ask reads lazily from it."""
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.store.compact import CompactOptions, compact

    n = 75
    summary = encode_on_ray(_passages(n), Target.open(s3_store),
                                      choice, OPTIONS, RayOptions(actors=2, commit_seconds=0))
    assert summary.added == n
    store = assert_same_as_local(s3_store, local_store, n)  # read back over S3, verify included
    questions = ["who built the lighthouse", "where was the treaty signed", "what does photosynthesis make"]
    build_store_index(s3_store)
    answers = _ask(s3_store, questions)
    total = store.info()["bytes"]["total"]
    for question, (_, nbytes) in zip(questions, answers):
        print(f"ask {question!r}: {nbytes:,} bytes read from S3 of {total:,} stored")
        assert 0 < nbytes < total / 4  # the 3 passages' chunks only, not the store
    record_property("s3_bytes_read_per_ask", [b for _, b in answers])
    rows, ids = _rows(store), sorted(store.ids())
    decoded = store.read(ids)
    report = compact(s3_store, CompactOptions(target_bytes=1 << 40, grace_seconds=0))
    assert report["segments_before"] == 3 and report["segments_after"] == 1
    after = CacheStore.open(s3_store)  # every row's checksums as before, bit-identical reads, verify clean
    assert _rows(after) == rows and after.verify()["ok"]
    assert all(np.array_equal(a, b) for a, b in zip(after.read(ids), decoded))
    assert [a for a, _ in _ask(s3_store, questions)] == [a for a, _ in answers]
    fs, root = store.loc.fs, store.loc.root
    written = b"".join(fs.cat_file(path) for path in fs.find(root.split("/", 1)[0]))
    for secret in (s3_server.secret, s3_server.env["AWS_ACCESS_KEY_ID"]):
        assert secret.encode() not in written  # credentials are never written into the store
    assert not fs.exists(f"{root}/writer.lock")


def _rows(store) -> list:
    return [(pid, t.content_hash(i), {k: t.checksum(i, k) for k in store.kinds})
            for t in _tables(store) for i, pid in enumerate(t.ids)]
