
"""Security: checkpoints never run code, remote code only with the flag, input data never
becomes a path, no pickle in a store or an index, credentials never shown."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_support import run_cli
from faults import record
from paths import PACKAGE


def run(capsys, monkeypatch, *args):
    return run_cli(capsys, monkeypatch, *args)


class _Payload:
    """Unpickling this creates a file: the proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def fuser_dir(tiny_models, tmp_path):
    from cachegraft_cli.fuser.checkpoint import save_published
    from cachegraft_cli.fuser.fuser import Fuser

    r, s = tiny_models["receiver"], tiny_models["sharer_same"]
    path = tmp_path / "fuser"
    save_published(Fuser.create(r.spec, s.spec, r.geometry, s.geometry, hidden_dim=8, intermediate_dim=8), path)
    return path


@pytest.mark.parametrize("container", ["pickle", "torch-zip"])
def test_a_crafted_pickle_in_a_fuser_is_refused_and_nothing_runs(fuser_dir, tmp_path, container, capsys, monkeypatch):
    import torch

    from cachegraft_cli.errors import CheckpointError
    from cachegraft_cli.fuser import load_fuser

    marker = tmp_path / "pwned"
    target = fuser_dir / "final" / "projector_0.pt"
    if container == "pickle":
        target.write_bytes(pickle.dumps({"gate": _Payload(str(marker))}))
    else:
        torch.save({"gate": _Payload(str(marker))}, target)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_fuser(str(fuser_dir))
    code, _, err = run(capsys, monkeypatch, "fuser", "info", fuser_dir)
    assert code == 4 and "projector_0.pt" in err
    assert not marker.exists()  # nothing ran
    record(faults=1, security=1)


def _remote_code_model(tiny_dirs, root: Path, marker: Path) -> Path:
    """A model directory whose config needs its own Python code (which would create `marker`)."""
    path = root / "remote"
    shutil.copytree(tiny_dirs["receiver"], path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="cachegraft_evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'cachegraft_evil'\n")
    return path


def test_remote_code_runs_only_with_the_flag(tiny_dirs, tmp_path, capsys, monkeypatch):
    from cachegraft_cli.errors import ModelLoadError
    from cachegraft_cli.lm.models import load_causal_lm

    marker = tmp_path / "ran"
    path = _remote_code_model(tiny_dirs, tmp_path, marker)
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    with pytest.raises(ModelLoadError) as exc:
        load_causal_lm(str(path), device="cpu", dtype="float32")
    assert "--trust-remote-code" in exc.value.hint
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "some text"}) + "\n")
    code, _, err = run(capsys, monkeypatch, "encode", corpus, "--store", tmp_path / "s", "--receiver", path)
    assert code == 3 and "--trust-remote-code" in err
    assert not marker.exists()  # refused before any of its code ran
    with pytest.raises(Exception):  # noqa: B017 - with the flag its code runs (and then fails: it is no model)
        load_causal_lm(str(path), device="cpu", dtype="float32", trust_remote_code=True)
    assert marker.read_text() == "ran"
    record(faults=1, security=1)


def test_passage_ids_never_become_paths(tiny_dirs, tmp_path):
    from cachegraft_cli.corpus import Passage
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.session import ModelChoice, ModelSession
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.target import Target

    nasty = ["../../escape", "/etc/passwd", "a/../../b", "..", "C:\\windows\\x", "~root/x", "seg/../../../z",
             "zarr.json", "manifest.json", "segments"]
    store = tmp_path / "deep" / "store"
    (tmp_path / "deep").mkdir()
    outside = sorted(p for p in tmp_path.rglob("*"))
    session = ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32"))
    encode_corpus([Passage(pid, "t", f"text number {i}") for i, pid in enumerate(nasty)], Target.open(str(store)),
                                                                                 session,
                  EncodeOptions())
    after = sorted(p for p in tmp_path.rglob("*") if store not in p.parents and p != store)
    assert after == outside  # nothing was created outside the store
    opened = CacheStore.open(str(store))
    assert sorted(opened.ids()) == sorted(nasty) and opened.verify()["ok"]
    names = {part for p in store.rglob("*") for part in p.relative_to(store).parts}
    assert not names & {"escape", "passwd", "z", "windows"}
    record(bad_inputs=len(nasty))


def test_no_pickle_anywhere_in_a_store_or_its_index(tiny_dirs, tmp_path):
    from cachegraft_cli.corpus import Passage
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.session import ModelChoice, ModelSession
    from cachegraft_cli.store.packed import unpack_arrays
    from cachegraft_cli.store.target import Target

    store = tmp_path / "store"
    session = ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32"))
    encode_corpus([Passage(f"p{i}", "t", f"harbor text {i}") for i in range(5)], Target.open(str(store)), session,
                  EncodeOptions(codec="int4", also_own_cache=True))
    build_store_index(str(store))
    files = [p for p in store.rglob("*") if p.is_file()]
    assert files
    for path in files:
        head = path.read_bytes()[:2]
        assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), f"{path} is a pickle"
        if path.suffix == ".npy":
            assert np.load(path, allow_pickle=False).dtype != object
        elif path.suffix in (".json",) or path.name in ("zarr.json", "CURRENT"):
            json.loads(path.read_bytes())
        elif path.suffix == ".bin":
            assert all(a.dtype != object for a in unpack_arrays(path.read_bytes()).values())
    for meta in store.rglob("zarr.json"):
        dtype = json.loads(meta.read_text()).get("data_type")
        assert dtype in (None, "float32", "uint16", "uint8", "int8", "float16")


def test_the_package_never_unpickles():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"\bimport pickle\b|pickle\.loads?\(|allow_pickle=True|dill|joblib\.load", line):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
            if "torch.load(" in line and "weights_only=True" not in line:
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_credentials_are_never_shown(tmp_path):
    from store_support import fill, identity, prefix

    from cachegraft_cli.errors import CacheGraftError
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.location import Location, redact

    secret = "SECRET-KEY-5c1f"
    options = {"key": secret, "secret": secret}
    url = "memory://bucket-creds/store"
    rng = np.random.default_rng(0)
    store = CacheStore.create(url, identity(), prefix(rng), storage_options=options)
    fill(store, rng, range(3))
    shown = [repr(store.loc), repr(Location.from_url(url, options)), json.dumps(store.info(), default=str),
             json.dumps(store.verify(), default=str)]
    with store.writer({"tool": "test"}):
        try:
            store.writer()
        except CacheGraftError as exc:
            shown.append(str(exc))
    for bad in ("memory://user:" + secret + "@bucket-creds/nowhere", url + "-missing"):
        try:
            CacheStore.open(bad, storage_options=options)
        except CacheGraftError as exc:
            shown.append(str(exc))
    fs = store.loc.fs
    shown += [fs.cat_file(p).decode("latin-1") for p in fs.find(store.loc.root)]
    assert len(shown) > 8 and not [s for s in shown if secret in s]
    assert secret not in redact(f"s3://AKIA:{secret}@bucket/store")
    assert "bucket/store" in redact(f"s3://a:{secret}@bucket/store")
    env_secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    assert not env_secret or env_secret not in "".join(shown)
