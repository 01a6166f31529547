
"""`encode --runner`: bad runner options fail at once, before the corpus is read or anything loads."""

from __future__ import annotations

import json
import sys

import pytest
from cli_support import run_cli


def run(capsys, monkeypatch, *args):
    code, _, err = run_cli(capsys, monkeypatch, *args, forbid=())
    return code, err


@pytest.mark.parametrize("args, code, message", [
    (["--actors", "2"], 2, "--actors only apply with --runner ray"),
    (["--runner", "local", "--address", "h:1", "--gpus-per-actor", "1"], 2, "--address, --gpus-per-actor only apply"),
    (["--runner", "spark"], 2, "unknown runner 'spark'"),
    (["--runner", "ray", "--address", "nonsense"], 2, "is not HOST:PORT"),
    (["--runner", "ray", "--gpus-per-actor", "1", "--device", "cpu"], 2, "asks for GPUs, but --device is cpu"),
])
def test_bad_runner_options_fail_before_anything_loads(capsys, monkeypatch, tmp_path, args, code, message):
    missing = tmp_path / "no-such-corpus.jsonl"  # never read: the options fail first
    got, err = run(capsys, monkeypatch, "encode", missing, "--store", tmp_path / "s", *args)
    assert got == code and message in err and "hint:" in err
    assert not (tmp_path / "s").exists()


def test_missing_ray_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    got, err = run(capsys, monkeypatch, "encode", tmp_path / "c.jsonl", "--store", tmp_path / "s", "--runner", "ray")
    assert got == 2 and "needs Ray, which is not installed" in err and "cachegraft[ray]" in err


def test_an_address_nobody_listens_at_fails_in_seconds():
    import socket

    from cachegraft_cli.encoding.ray.driver import _probe
    from cachegraft_cli.errors import RunnerError

    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RunnerError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        _probe(f"127.0.0.1:{port}", timeout=2)
    _probe(None)  # no address: Ray starts a local runtime
    _probe("auto")


def test_the_runners_import_no_ray_until_used():
    import subprocess

    code = ("import sys\n"
            "import cachegraft_cli.cli.app, cachegraft_cli.cli.encode_cmd, cachegraft_cli.encoding.ray.driver\n"
            "import cachegraft_cli.encoding.ray.worker, cachegraft_cli.store.parallel, cachegraft_cli.store.compact\n"
            "assert 'ray' not in sys.modules, 'ray imported at module load'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


def test_plan_rows_survive_the_trip_to_an_actor():
    """What the driver puts in the dataset is what `windows_of` gives the actor back."""
    import numpy as np

    from cachegraft_cli.corpus import Passage
    from cachegraft_cli.encoding.plan import Chunk
    from cachegraft_cli.encoding.ray.worker import windows_of

    chunks = [Chunk(Passage("a", "T", "long text", {"k": [1, "x"]}, "c.jsonl", 3), "text", [5, 6, 7],
                    "Title: T\ntext\n\n", 0, (0, 4)),
              Chunk(Passage("b", "", "short"), "short", [9], "short\n\n")]
    records = [c.to_record() for c in chunks]
    ids = [r.pop("ids") for r in records]
    batch = {"window": np.array([4, 4]), "seq": np.array([11, 10]), "ids": [np.array(i, np.int32) for i in ids],
             "chunk": np.array([json.dumps(r) for r in records], dtype=object)}
    [(window, seqs, got)] = windows_of(batch)
    assert window == 4 and seqs == [10, 11]  # plan order restored
    back = dict(zip(seqs, got))
    for seq, chunk in zip([11, 10], chunks):
        assert vars(back[seq]) | {"passage": None} == vars(chunk) | {"passage": None}
        assert back[seq].id == chunk.id and back[seq].content_hash == chunk.content_hash
        assert back[seq].passage.metadata == chunk.passage.metadata and back[seq].passage.title == chunk.passage.title


def test_a_ray_encode_is_refused_by_a_held_lock_before_ray_starts(tmp_path, monkeypatch):
    """The driver takes the store's writer lock first, as `encode` does: a second writer is refused at once,
    before a Ray runtime starts or the store is created (where the models would load)."""
    ray = pytest.importorskip("ray")
    from cachegraft_cli.corpus import Passage
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.encoding.ray.driver import RayOptions, encode_on_ray
    from cachegraft_cli.errors import StoreLockedError
    from cachegraft_cli.session import ModelChoice
    from cachegraft_cli.store.lock import lock_store
    from cachegraft_cli.store.target import Target

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a Ray runtime was started"))
    store = tmp_path / "s"
    with lock_store(str(store), {"tool": "another writer"}):
        with pytest.raises(StoreLockedError, match="is being written by"):
            encode_on_ray([Passage("p1", "", "some text")], Target.open(str(store)),
                          ModelChoice("org/model", None, "closed"), EncodeOptions(), RayOptions())
    assert sorted(p.name for p in store.iterdir()) == ["writer.lock"]  # nothing created


def test_encode_has_no_engine_flag(capsys, monkeypatch, tmp_path):
    """`--engine` names retrieval engines (`index`); encode's runner is `--runner` only."""
    got, err = run(capsys, monkeypatch, "encode", tmp_path / "c.jsonl", "--store", tmp_path / "s", "--engine", "ray")
    assert got == 2 and "--engine" in err and not (tmp_path / "s").exists()
