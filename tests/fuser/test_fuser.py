"""The C2C projector, layer map and checkpoint IO (docs/method.md sections 1-2)."""

import json
import os

import pytest
import torch

from cachegraft_cli.errors import CheckpointError
from cachegraft_cli.fuser import load_fuser
from cachegraft_cli.fuser.checkpoint import convert, load_checkpoint, save_own, save_published
from cachegraft_cli.fuser.fuser import Fuser
from cachegraft_cli.fuser.layermap import from_published, last_aligned, to_published
from cachegraft_cli.fuser.projector import C2CProjector, ProjectorArgs
from cachegraft_cli.lm.kvcache import Geometry


def _small_fuser(gates=None, seed=0):
    torch.manual_seed(seed)
    fuser = Fuser.create("r", "s", Geometry(4, 2, 16), Geometry(6, 3, 32), hidden_dim=32, intermediate_dim=24)
    if gates is not None:
        fuser.set_gates(gates)
    return fuser.eval()


def test_layer_map_examples():
    assert last_aligned(28, 36)[0] == [(8, 0)] and last_aligned(28, 36)[27] == [(35, 27)]
    m = last_aligned(28, 24)
    assert [m[t][0][0] for t in (0, 3, 4, 27)] == [0, 0, 0, 23]
    assert {t: s for t, [(s, _)] in last_aligned(4, 6).items()} == {0: 2, 1: 3, 2: 4, 3: 5}
    assert from_published(to_published(m)) == m
    assert to_published(last_aligned(4, 6))["0"]["1"]["3"] == [[5, 3]]


def test_published_parameter_names_and_count():
    args = ProjectorArgs(source_dim=64, target_dim=128, source_num_heads=2, target_num_heads=8)
    p = C2CProjector(args)
    names = set(p.state_dict())
    for prefix in ("key", "value"):
        assert {f"{prefix}_in.weight", f"{prefix}_in.bias", f"{prefix}_gate_logit"} <= names
        assert f"{prefix}_mlp1.blocks.0.norm.weight" in names
        assert f"{prefix}_proj_mlp2.blocks.0.w1.weight" in names
        assert f"{prefix}_proj_mlp2.blocks.1.w1.weight" not in names
        assert {f"{prefix}_scalar_mlp2.blocks.0.w2.weight", f"{prefix}_scalar_head.bias",
                f"{prefix}_proj_out.weight"} <= names
    assert "gate_temperature" in names
    # docs/method.md section 2: one Qwen3-0.6B <- Qwen2.5-0.5B projector has 17,066,002 parameters.
    assert sum(x.numel() for x in p.parameters()) == 17_066_002


def test_closed_projector_returns_receiver_cache_exactly():
    p = C2CProjector(ProjectorArgs(8, 16, 2, 2, hidden_dim=16, intermediate_dim=16)).eval()
    target = (torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
    source = (torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    k, v = p(source, target)
    assert torch.equal(k, target[0]) and torch.equal(v, target[1])
    with torch.no_grad():
        p.key_gate_logit.fill_(0.5)
    k, v = p(source, target)
    assert not torch.equal(k, target[0]) and torch.equal(v, target[1])


def test_fuse_formula_by_hand():
    """K' = Kt + gate * sigmoid(w) * P, with the weight path and projection computed independently."""
    torch.manual_seed(3)
    p = C2CProjector(ProjectorArgs(4, 6, 1, 2, hidden_dim=8, intermediate_dim=8, dropout=0.0)).eval()
    with torch.no_grad():
        p.key_gate_logit.fill_(1.0)
    ks, kt = torch.randn(1, 1, 3, 4), torch.randn(1, 2, 3, 6)
    x = torch.cat([ks.transpose(1, 2).reshape(1, 3, 4), kt.transpose(1, 2).reshape(1, 3, 12)], -1)

    def block(b, h):
        return h + b.w2(torch.nn.functional.gelu(b.w1(b.norm(h))))

    h = block(p.key_mlp1.blocks[0], p.key_in(x))
    proj = p.key_proj_out(block(p.key_proj_mlp2.blocks[0], h)).view(1, 3, 2, 6).transpose(1, 2)
    w = p.key_scalar_head(block(p.key_scalar_mlp2.blocks[0], h)).permute(0, 2, 1).unsqueeze(-1)
    k, _ = p((ks, torch.randn(1, 1, 3, 4)), (kt, torch.randn(1, 2, 3, 6)))
    torch.testing.assert_close(k, kt + torch.sigmoid(w) * proj)


def test_training_gate_is_gumbel_sigmoid_and_temperature_anneals():
    p = C2CProjector(ProjectorArgs(4, 4, 1, 1, hidden_dim=8, intermediate_dim=8, anneal_steps=10))
    p.update_temperature(0)
    assert float(p.gate_temperature) == pytest.approx(1.0)
    p.update_temperature(5)
    assert float(p.gate_temperature) == pytest.approx(0.001**0.5, rel=1e-4)
    p.update_temperature(50)
    assert float(p.gate_temperature) == pytest.approx(0.001, rel=1e-4)
    p.train()
    g = p._gate(p.key_gate_logit, (1, 1, 200, 1))
    assert g.requires_grad and ((g > 0) & (g < 1) | (g == 0) | (g == 1)).all()
    assert 0.2 < float((g > 0.5).float().mean()) < 0.8  # logit 0: about half open


def test_published_round_trip(tmp_path):
    fuser = _small_fuser(gates=1.0)
    save_published(fuser, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt/final/projector_0.json").read_text())
    assert meta["class"] == "C2CProjector"
    assert meta["init_args"]["dtype"] == {"__type__": "torch.dtype", "value": "float32"}
    recipe = json.loads((tmp_path / "ckpt/config.json").read_text())
    assert recipe["model"]["base_model"] == "r" and recipe["model"]["teacher_model"] == "s"
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.fingerprint() == fuser.fingerprint()
    assert loaded.spec.layer_map == fuser.spec.layer_map


def test_own_format_round_trip_and_conversion(tmp_path):
    fuser = _small_fuser(gates=1.0, seed=4)
    save_own(fuser, tmp_path / "own")
    assert (tmp_path / "own/fuser.safetensors").is_file()
    assert load_checkpoint(tmp_path / "own").fingerprint() == fuser.fingerprint()
    convert(tmp_path / "own", tmp_path / "pub", "published")
    convert(tmp_path / "pub", tmp_path / "own2", "own")
    assert load_checkpoint(tmp_path / "own2").fingerprint() == fuser.fingerprint()


@pytest.fixture
def published(tmp_path):
    save_published(_small_fuser(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_key_is_named(published):
    f = published / "final/projector_2.pt"
    state = torch.load(f, weights_only=True)
    del state["value_proj_out.bias"]
    torch.save(state, f)
    with pytest.raises(CheckpointError, match=r"projector_2\.pt.*missing key 'value_proj_out\.bias'"):
        load_checkpoint(published)


def test_extra_key_is_named(published):
    f = published / "final/projector_1.pt"
    state = torch.load(f, weights_only=True)
    state["key_extra.weight"] = torch.zeros(1)
    torch.save(state, f)
    with pytest.raises(CheckpointError, match=r"projector_1\.pt.*unexpected key 'key_extra\.weight'"):
        load_checkpoint(published)


def test_shape_mismatch_is_named(published):
    f = published / "final/projector_0.pt"
    state = torch.load(f, weights_only=True)
    state["key_in.weight"] = torch.zeros(3, 3)
    torch.save(state, f)
    with pytest.raises(CheckpointError, match=r"projector_0\.pt.*'key_in\.weight' has shape \(3, 3\)"):
        load_checkpoint(published)


class _NotATensor:
    pass


def test_pickle_with_objects_is_refused(published):
    f = published / "final/projector_3.pt"
    torch.save({"key_in.weight": _NotATensor()}, f)
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(published)


def test_missing_projector_file(published):
    os.remove(published / "final/projector_3.pt")
    with pytest.raises(CheckpointError, match=r"projector_3\.pt is missing"):
        load_checkpoint(published)


def test_hub_loading_through_huggingface_hub(tmp_path, monkeypatch):
    """`REPO:SUBFOLDER` goes through huggingface_hub.snapshot_download; a local
    cache laid out like the hub's proves the path without a network."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--nics-efc--C2C_Fuser"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    fuser = _small_fuser(gates=1.0, seed=9)
    save_published(fuser, repo_dir / "snapshots" / commit / "tiny_pair_Fuser")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    loaded = load_fuser("nics-efc/C2C_Fuser:tiny_pair_Fuser")
    assert loaded.fingerprint() == fuser.fingerprint()


def test_unreachable_hub_says_how_to_use_local_files(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    from cachegraft_cli.errors import HubUnreachableError

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnreachableError) as info:
        load_fuser("nics-efc/C2C_Fuser:qwen3_0.6b+qwen3_4b_Fuser")
    assert "--fuser /path/to/folder" in info.value.hint


def test_closed_spec_is_none():
    assert load_fuser("closed") is None and load_fuser(None) is None


def test_fuser_cli_info_and_convert(tmp_path, capsys, monkeypatch):
    import sys

    from cachegraft_cli.cli.app import main

    fuser = _small_fuser(gates=1.0, seed=7)
    save_published(fuser, tmp_path / "pub")

    def cli(*args):
        monkeypatch.setattr(sys, "argv", ["cachegraft", *map(str, args)])
        with pytest.raises(SystemExit) as info:
            main()
        return info.value.code or 0, capsys.readouterr()

    code, (out, _) = cli("fuser", "convert", tmp_path / "pub", tmp_path / "own", "--to", "own")
    assert code == 0 and (tmp_path / "own/fuser.json").is_file()
    code, (out, _) = cli("fuser", "info", tmp_path / "own", "--json")
    info = json.loads(out)
    assert code == 0 and info["projectors"] == 4 and info["fingerprint"] == fuser.fingerprint()[:32]
    assert info["open_gates"] == "4 key / 4 value of 4"
    code, (_, err) = cli("fuser", "convert", tmp_path / "pub", tmp_path / "x", "--to", "pickle")
    assert code == 2 and "--to own" in err


def test_fuser_moves_and_casts_like_any_module():
    fuser = Fuser.create("r", "s", Geometry(2, 1, 8), Geometry(2, 1, 8), hidden_dim=8, intermediate_dim=8)
    assert not fuser.training  # a new fuser is ready for inference
    fuser.to(torch.bfloat16)
    assert fuser.dtype == torch.bfloat16
    fuser.to("cpu").float()
    assert fuser.dtype == torch.float32
