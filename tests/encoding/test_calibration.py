"""Which calibration and codec a new store gets (`encoding.calibration`), before any model loads."""

from __future__ import annotations

import json

import pytest

from cachegraft_cli.encoding import calibration
from cachegraft_cli.errors import UsageError

OFFLINE = "builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135"


def test_the_offline_fuser_ships_a_calibration_for_its_receivers_geometry():
    path = calibration.shipped_file(OFFLINE)
    assert path is not None and path.name == calibration.SHIPPED
    cal = calibration.load_file(path)
    assert cal.info["geometry"] == {"layers": 24, "kv_heads": 2, "head_dim": 64}
    assert cal.info["rope_theta"] == 1e6 and cal.info["tokens"] >= 30_000  # Qwen2.5's RoPE base, a real corpus
    assert calibration.codec_params("tc", None, OFFLINE)["calibration"].sha256 == cal.sha256


def test_new_stores_are_tc_where_the_fuser_ships_a_calibration_and_int8_elsewhere():
    codec, note = calibration.default_codec(OFFLINE)
    assert codec == "tc" and "calibration this fuser ships" in note and "--codec int8" in note
    for spec in (None, "closed", "/some/dir", "builtin:qwen2.5-coder-0.5b-squadshifts-qa-mix135-adapter"):
        assert calibration.default_codec(spec) == ("int8", None)
    with pytest.raises(UsageError, match="needs a calibration"):
        calibration.codec_params("tc", None, "closed")


def test_calibration_options_are_refused_where_they_do_not_apply(tmp_path):
    with pytest.raises(UsageError, match="transform codec only"):
        calibration.codec_params("int8", "cal.safetensors", OFFLINE)
    with pytest.raises(UsageError, match="keeps the calibration"):
        calibration.codec_params("tc", "cal.safetensors", OFFLINE, exists=True)
    assert calibration.codec_params("tc", None, OFFLINE, exists=True) is None
    (tmp_path / "x.safetensors").write_bytes(b"nope")
    with pytest.raises(UsageError, match="not a transform-codec calibration"):
        calibration.codec_params("tc", str(tmp_path / "x.safetensors"), OFFLINE)


def test_rope_theta_comes_from_the_receivers_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"rope_theta": 5e5}))
    assert calibration.rope_theta_of({"receiver": {"name": str(tmp_path)}}) == 5e5
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"rope_parameters": {"rope_theta": 2e4}}}))
    assert calibration.rope_theta_of({"receiver": {"name": str(tmp_path)}}) == 2e4
    assert calibration.rope_theta_of({"receiver": {"name": "no/such-model-here"}}) == 10000.0
    assert calibration.rope_theta_of({"receiver": {"name": str(tmp_path / "missing")}}) == 10000.0
