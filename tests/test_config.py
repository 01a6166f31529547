"""Presets: each knows its models, its fuser and, where one ships, its adapter control."""

import pytest
from cli_support import run_cli

from cachegraft_cli.config import PRESETS, preset_adapter


def test_the_offline_preset_carries_its_adapter_control():
    offline = PRESETS["offline"]
    assert offline.adapter_fuser and offline.adapter_fuser.startswith("builtin:") and "adapter" in offline.adapter_fuser
    assert preset_adapter("offline", None) == offline.adapter_fuser
    assert preset_adapter("offline", offline.fuser) == offline.adapter_fuser
    assert preset_adapter("offline", "builtin:another") is None  # another fuser: the preset's control is not its
    assert preset_adapter(None, None) is None


def test_evaluate_with_a_preset_alone_runs_its_adapter(capsys, monkeypatch, tmp_path):
    """`evaluate --preset offline --systems graft,adapter` needs no --adapter-fuser."""
    import cachegraft_cli.evaluation.protocol as run_mod

    seen = {}

    def fake_run(config, answerer):
        seen["adapter"] = answerer.config.adapter_fuser
        seen["fuser"] = answerer._fuser_for("adapter")
        return {"headlines": {}}

    monkeypatch.setattr(run_mod, "run_evaluation", fake_run)
    bench = tmp_path / "b.json"
    bench.write_text('{"data": []}')
    code, _, err = run_cli(capsys, monkeypatch, "evaluate", "-B", f"b={bench}", "--preset", "offline",
                           "--systems", "graft,adapter", "--out", tmp_path / "run", forbid=())
    assert code == 0, err
    assert seen == {"adapter": PRESETS["offline"].adapter_fuser, "fuser": PRESETS["offline"].adapter_fuser}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_names_its_models(name):
    preset = PRESETS[name]
    assert preset.receiver and preset.sharer and preset.fuser and preset.description
