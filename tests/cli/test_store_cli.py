"""`cachegraft store info|verify|unlock` through the real app and exit-code mapping."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from store_support import fill, flip_bytes, identity, prefix, shard_files
from typer.testing import CliRunner

from cachegraft_cli.cli.app import app
from cachegraft_cli.cli.errors import report
from cachegraft_cli.errors import StoreCorruptError
from cachegraft_cli.store import CacheStore


@pytest.fixture
def store_dir(tmp_path):
    rng = np.random.default_rng(9)
    store = CacheStore.create(str(tmp_path / "store"), identity(), prefix(rng), shard_tokens=64)
    fill(store, rng, range(8), lengths=(10, 12))
    fill(store, rng, range(8, 10), lengths=(10, 12))
    return str(tmp_path / "store")


def invoke(*args):
    result = CliRunner().invoke(app, list(args))
    raised = result.exception and not isinstance(result.exception, SystemExit)
    code = report(result.exception) if raised else result.exit_code
    return result, code


def test_info_json_and_text(store_dir):
    result, code = invoke("store", "info", store_dir, "--json")
    assert code == 0
    info = json.loads(result.stdout)
    assert info["passages"] == 10 and info["segments"]["count"] == 2 and info["codec"] == "bf16"
    assert [s["rows"] for s in info["segments"]["list"]] == [8, 2]
    result, code = invoke("store", "info", store_dir)
    assert code == 0 and "tiny/receiver" in result.stdout and "segments" in result.stdout


def test_verify_ok_then_damage_exits_7(store_dir):
    result, code = invoke("store", "verify", store_dir, "--json")
    assert code == 0 and json.loads(result.stdout)["ok"]
    store = CacheStore.open(store_dir)
    seg = store.segments[0]["name"]
    flip_bytes(store, shard_files(store, seg)[0], at=30)
    result, code = invoke("store", "verify", store_dir, "--json")
    assert isinstance(result.exception, StoreCorruptError) and code == 7
    assert seg in str(result.exception) and "'p0'" in str(result.exception)
    problems = json.loads(result.stdout)["problems"]
    assert problems[0]["segment"] == seg and problems[0]["passage"] == "p0"


def test_missing_store_and_unlock(tmp_path, store_dir):
    result, code = invoke("store", "info", str(tmp_path / "nope"))
    assert code == 5 and "cachegraft encode" in result.exception.hint
    result, code = invoke("store", "unlock", store_dir)
    assert code == 0 and "not locked" in result.stdout


def test_console_script_exit_code(store_dir):
    store = CacheStore.open(store_dir)
    flip_bytes(store, shard_files(store, store.segments[1]["name"])[0], at=30)
    proc = subprocess.run([sys.executable, "-m", "cachegraft_cli", "store", "verify", store_dir],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert "p8" in proc.stderr and store.segments[1]["name"] in proc.stderr
