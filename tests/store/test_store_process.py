"""Other processes: SIGKILL at any point of a write, a live writer elsewhere, stale locks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from paths import TESTS
from store_support import fill, identity, memory_url, prefix

from cachegraft_cli.errors import StoreError, StoreLockedError
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.lock import unlock

# Child writer: adds passages in one session. MODE "sleep" stalls mid-write (shards already
# flushed) for the parent to SIGKILL; otherwise it kills itself just before the named step.
CHILD = r"""
import os, signal, sys, time
import numpy as np
sys.path.insert(0, sys.argv[3])
from store_support import bf16_cache, row
from cachegraft_cli.store import CacheStore, location, segments
url, mode = sys.argv[1], sys.argv[2]

def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)

if mode == "before-commit-marker":
    real = location.Location.write_json_atomic
    def patched(self, rel, obj, compact=False):
        if rel.endswith("commit.json"):
            die()
        return real(self, rel, obj, compact)
    location.Location.write_json_atomic = patched
elif mode == "before-manifest-rename":
    real_replace = os.replace
    def patched_replace(src, dst):
        if str(dst).endswith("manifest.json"):
            die()
        return real_replace(src, dst)
    os.replace = patched_replace
store = CacheStore.open(url)
rng = np.random.default_rng(7)
with store.writer({"child": mode}) as w:
    for i in range(100, 160):
        w.add(row(i), {"fused": bf16_cache(rng, 20)})
    print("READY", flush=True)
    if mode == "sleep":
        time.sleep(60)
"""


def _child(url: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, url, mode, str(TESTS)], stdout=subprocess.PIPE, text=True)


def _wait_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line.strip() == "READY", line


@pytest.mark.parametrize("mode", ["sleep", "before-commit-marker", "before-manifest-rename"])
def test_sigkill_at_any_point_leaves_a_good_store(tmp_path, mode):
    url = str(tmp_path / "store")
    rng = np.random.default_rng(1)
    fill(CacheStore.create(url, identity(), prefix(rng), shard_tokens=64), rng, range(5))
    proc = _child(url, mode)
    if mode == "sleep":
        _wait_ready(proc)
        store = CacheStore.open(url)
        with pytest.raises(StoreLockedError, match=f"pid {proc.pid}"):
            store.writer()
        with pytest.raises(StoreLockedError):
            unlock(store.loc)  # refused: the holder is alive
        proc.send_signal(signal.SIGKILL)
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
    proc = _child(url, "sleep")
    try:
        _wait_ready(proc)
        with pytest.raises(StoreLockedError) as exc:
            CacheStore.open(url).writer()
        assert "since" in str(exc.value) and os.uname().nodename in str(exc.value)
        assert CacheStore.open(url).info()["writer"]["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.05)
    assert CacheStore.open(url).info()["writer"] is None
