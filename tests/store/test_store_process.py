"""Other processes: SIGKILL at any point of a write, a live writer elsewhere, stale locks (the
children are `faults.Cli` processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from faults import Cli, Faults, Run
from store_support import add_passages, fill, identity, memory_url, prefix

from cachegraft_cli.errors import StoreError, StoreLockedError
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.lock import unlock

# The child writer adds passages 100-159 in one session. "sleep" stalls it before its commit record
# (shards flushed, lock held) for the parent to SIGKILL; otherwise it kills itself just before the step.
MODES = {"sleep": Faults(stall_before="write_json:*commit.json"),
         "before-commit-marker": Faults(kill_before="write_json:*commit.json"),
         "before-manifest-rename": Faults(kill_before="replace:*manifest.json")}


def _child(url: str, mode: str, logs) -> Run:
    return Cli(logs).call(add_passages, url, range(100, 160), 20, 7, {"child": mode}, faults=MODES[mode])


@pytest.mark.parametrize("mode", ["sleep", "before-commit-marker", "before-manifest-rename"])
def test_sigkill_at_any_point_leaves_a_good_store(tmp_path, mode):
    url = str(tmp_path / "store")
    rng = np.random.default_rng(1)
    fill(CacheStore.create(url, identity(), prefix(rng), shard_tokens=64), rng, range(5))
    proc = _child(url, mode, tmp_path / "logs")
    if mode == "sleep":
        proc.wait_for("STALLED")
        store = CacheStore.open(url)
        with pytest.raises(StoreLockedError, match=f"pid {proc.pid}"):
            store.writer()
        with pytest.raises(StoreLockedError):
            unlock(store.loc)  # refused: the holder is alive
        proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    store = CacheStore.open(url)
    assert sorted(store.ids()) == [f"p{i}" for i in range(5)]
    assert store.verify()["ok"]
    fill(store, rng, range(5, 8))  # the OS lock died with the child; garbage is collected
    again = CacheStore.open(url)
    # a segment whose commit record was written is complete: the next writer adds it (never deletes it)
    adopted = 60 if mode == "before-manifest-rename" else 0
    assert len(again) == 8 + adopted and again.verify()["ok"]
    names = set(again.loc.list_names("segments")) - {"zarr.json"}
    assert names == {s["name"] for s in again.segments}
    assert not [n for n in again.loc.list_names("") if ".tmp-" in n]


def test_stale_remote_lock_is_reported_and_removable():
    url = memory_url()
    rng = np.random.default_rng(2)
    store = CacheStore.create(url, identity(), prefix(rng))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {"pid": int(dead.stdout), "host": os.uname().nodename, "since": "2026-01-01T00:00:00+00:00", "run": {}}
    store.loc.write_bytes("writer.lock", json.dumps(holder).encode())
    with pytest.raises(StoreLockedError, match=f"pid {holder['pid']}"):
        store.writer()
    assert "removed" in unlock(store.loc)
    fill(store, rng, range(2))
    store.loc.write_bytes("writer.lock", json.dumps({**holder, "host": "elsewhere"}).encode())
    with pytest.raises(StoreError, match="another host"):
        unlock(store.loc)
    assert "removed" in unlock(store.loc, force=True)
    assert unlock(store.loc) == "not locked"


def test_local_lock_held_by_live_process_then_released(tmp_path):
    url = str(tmp_path / "store")
    rng = np.random.default_rng(3)
    CacheStore.create(url, identity(), prefix(rng))
    proc = _child(url, "sleep", tmp_path / "logs")
    try:
        proc.wait_for("STALLED")
        with pytest.raises(StoreLockedError) as exc:
            CacheStore.open(url).writer()
        assert "since" in str(exc.value) and os.uname().nodename in str(exc.value)
        assert CacheStore.open(url).info()["writer"]["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.05)
    assert CacheStore.open(url).info()["writer"] is None
