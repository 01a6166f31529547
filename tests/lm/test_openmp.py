"""`lm/openmp.release_pool`: the calling thread's OpenMP helper threads are freed, and a later
parallel region still computes the same (in a fresh process: OpenMP pools are per process)."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.paths import REPO

SCRIPT = textwrap.dedent("""
    import json, os, torch
    from cachegraft_cli.lm import openmp
    torch.set_num_threads(2)
    tasks = lambda: len(os.listdir("/proc/self/task"))
    x = torch.linspace(-3, 3, 1 << 21)
    first = torch.exp(x).sum().item()   # a parallel region: the main thread gets a pool
    with_pool = tasks()
    released = openmp.release_pool()
    after = tasks()
    again = torch.exp(x).sum().item()   # a new pool, the same result
    print(json.dumps({"with_pool": with_pool, "released": released, "after": after,
                      "same": first == again, "runtime": openmp.runtime()}))
""")


def _run() -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp and /proc are Linux's")
def test_release_frees_the_callers_helper_threads():
    got = _run()
    if got["runtime"] is None:
        pytest.skip("torch here is not built with libgomp")
    assert got["released"] is True
    assert got["after"] == got["with_pool"] - 1, got  # two threads ran the region: its helper is gone
    assert got["same"]


def test_release_without_libgomp_changes_nothing(monkeypatch):
    from cachegraft_cli.lm import openmp

    monkeypatch.setattr(openmp, "_libgomp", lambda: None)
    assert openmp.release_pool() is False
    assert openmp.runtime() is None
