"""What a run leaves in --out: the shipped fuser (own format, optional published
layout), `summary.json`, the gate report and its warnings."""

from __future__ import annotations

import json
import math
from pathlib import Path


from cachegraft_cli.fuser.fuser import Fuser
from cachegraft_cli.fuser.projector import ProjectorArgs
from cachegraft_cli.training import fusermodel
from cachegraft_cli.training.log import say


def cast_fuser(fuser: Fuser, dtype: str) -> Fuser:
    """A copy whose projectors are built (and saved) in `dtype`."""
    args = [ProjectorArgs(**{**p.args.as_dict(), "dtype": dtype}) for p in fuser.projectors]
    out = Fuser(fuser.spec, args)
    out.load_state_dict(fuser.state_dict())
    return out.eval()


def gate_report(fuser: Fuser, threshold: float) -> dict:
    states = fuser.gate_states()
    logits = [g[f"{b}_logit"] for g in states for b in ("key", "value")]
    weak = sum(abs(x) < threshold for x in logits)
    opened = sum(x > 0 for x in logits)
    warnings = []
    if weak:
        warnings.append(
            f"{weak} of {len(logits)} gate logits are within +-{threshold} of 0: their inference state (open if > 0) "
            "is effectively random. Train longer or raise --gate-lr before shipping this fuser."
        )
    if opened == 0:
        warnings.append("Every gate is closed: this fuser returns the receiver's own cache unchanged (a no-op).")
    return {"gate_states": states, "open": opened, "total": len(logits), "weak": weak,
            "min_abs_logit": min(abs(x) for x in logits), "warnings": warnings}


def shipped_fuser(trainer) -> Fuser:
    plain = fusermodel.fold(trainer.fuser)
    if trainer.best is not None:
        plain.load_state_dict(trainer.best)
    return plain.eval()


def finish(trainer) -> dict:
    from cachegraft_cli.fuser.checkpoint import save_own, save_published

    c, s, p, out = trainer.c, trainer.state, trainer.p, Path(trainer.out)
    if p.val_items and (s["best_step"] is None or s["best_step"] != s["step"]) and not _validated_at(trainer, s["step"]):
        trainer.validate()
    final_val = _last_val(trainer)
    fuser = cast_fuser(shipped_fuser(trainer), c.save_dtype)
    gates = gate_report(fuser, c.gate_warn_threshold)
    training = {"objective": c.objective, "sharer_input": c.sharer_input, "seed": c.seed, "steps": s["step"],
                "best_step": s["best_step"], "data": c.data}
    save_own(fuser, out, extra={"training": training})
    if c.also_published:
        save_published(fuser, out / "published")
    summary = {
        "status": s["status"],
        "steps": s["step"],
        "epochs_completed": s["epoch"],
        "planned_steps": trainer.planned,
        "train_seconds": round(s["train_seconds"], 1),
        "precompute_seconds": round(p.precompute_seconds, 1),
        "final_train_loss": _mean(trainer.recent[-20:]),
        "final_val_nll": final_val,
        "best_val_nll": s["best_val"],
        "best_step": s["best_step"],
        "closed_val_nll": s["closed_val"],
        "shipped": "best validation" if trainer.best is not None else "last step",
        "parameters": fusermodel.parameter_count(fuser),
        "weights_bytes": (out / "fuser.safetensors").stat().st_size,
        "save_dtype": c.save_dtype,
        "gates": gates,
        "data": p.data_info,
        "config": c.as_dict(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    trainer.log.write("end", step=s["step"], status=s["status"], final_val_nll=final_val, best_val_nll=s["best_val"],
                      gate_open=gates["open"], gate_weak=gates["weak"])
    for w in gates["warnings"]:
        say(f"warning: {w}")
    return summary


def _validated_at(trainer, step: int) -> bool:
    path = Path(trainer.out) / "train_log.jsonl"
    return path.exists() and any(
        json.loads(line).get("event") == "validation" and json.loads(line).get("step") == step
        for line in path.read_text().splitlines()
    )


def _last_val(trainer):
    path = Path(trainer.out) / "train_log.jsonl"
    vals = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    vals = [v["val_nll"] for v in vals if v.get("event") == "validation"]
    return vals[-1] if vals else None


def _mean(xs):
    return sum(xs) / len(xs) if xs else math.nan
