"""Model loading: local directory, .gguf file, hub id (offline), dtype choice."""

import shutil

import pytest
import torch

from cachegraft_cli.errors import HubUnreachableError, ModelLoadError
from cachegraft_cli.lm import models


def test_local_dir_loads_in_eval_mode_with_stable_fingerprint(tiny_dirs, tmp_path):
    a = models.load_causal_lm(str(tiny_dirs["receiver"]), device="cpu", dtype="float32")
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dirs["receiver"], copy)
    b = models.load_causal_lm(str(copy), device="cpu", dtype="float32")
    other = models.load_causal_lm(str(tiny_dirs["sharer_same"]), device="cpu", dtype="float32")
    assert not a.model.training and a.dtype == torch.float32 and a.tokenizer.pad_token_id is not None
    assert a.identity["fingerprint"] == b.identity["fingerprint"] != other.identity["fingerprint"]
    assert a.geometry.as_dict() == {"layers": 4, "kv_heads": 2, "head_dim": 16}


def test_gguf_file_loads(tmp_path):
    from pull_fixtures import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    lm = models.load_causal_lm(str(path), device="cpu", dtype="float32")
    ids = lm.tokenizer("hello", add_special_tokens=False)["input_ids"]
    assert lm.model(input_ids=torch.tensor([ids])).logits.shape[-1] == lm.model.config.vocab_size
    assert lm.identity["name"] == str(path)


def test_hub_id_without_hub_says_how_to_use_local_files(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(HubUnreachableError) as info:
        models.load_causal_lm("Qwen/Qwen3-0.6B", device="cpu")
    assert "local model directory" in info.value.hint


@pytest.mark.parametrize("spec", ["./missing-dir", "not a model", "/nope/model.gguf"])
def test_bad_specs(spec):
    with pytest.raises(ModelLoadError):
        models.resolve_source(spec)


def test_dtype_choice(monkeypatch):
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: True)
    assert models.pick_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: False)
    assert models.pick_dtype("cpu") == torch.float32
    assert models.pick_dtype("cpu", "fp16") == torch.float16
    with pytest.raises(ModelLoadError):
        models.pick_dtype("cpu", "float7")
