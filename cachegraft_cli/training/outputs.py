"""What a run leaves in --out: the shipped fuser (own format, optional published
layout), `summary.json`, the gate report and its warnings."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from cachegraft_cli.fuser.fuser import Fuser
from cachegraft_cli.fuser.projector import ProjectorArgs
from cachegraft_cli.training import fusermodel
from cachegraft_cli.training.log import say
from cachegraft_cli.training.validation import evaluate


def cast_fuser(fuser: Fuser, dtype: str) -> Fuser:
    """A copy whose projectors are built (and saved) in `dtype`."""
    args = [ProjectorArgs(**{**p.args.as_dict(), "dtype": dtype}) for p in fuser.projectors]
    out = Fuser(fuser.spec, args)
    out.load_state_dict(fuser.state_dict())
    return out.eval()


def gate_report(fuser: Fuser, threshold: float, flip: dict | None = None) -> dict:
    """Gate states, counts and warnings; `flip` is `weak_gate_effect`'s measurement, if any."""
    states = fuser.gate_states()
    logits = [g[f"{b}_logit"] for g in states for b in ("key", "value")]
    weak = sum(abs(x) < threshold for x in logits)
    opened = sum(x > 0 for x in logits)
    warnings = []
    if weak:
        effect = ""
        if flip is not None:
            effect = (
                f" Flipping all of them moves the validation NLL from {flip['val_nll']:.4f} to "
                f"{flip['flipped_val_nll']:.4f} ({100 * flip['relative_change']:+.2f}%): the smaller that change, the "
                "less their state matters."
            )
        warnings.append(
            f"{weak} of {len(logits)} gate logits are within +-{threshold} of 0: their inference state (open if > 0) "
            f"is effectively random.{effect} Train longer or raise --gate-lr before shipping this fuser."
        )
    if opened == 0:
        warnings.append("Every gate is closed: this fuser returns the receiver's own cache unchanged (a no-op).")
    return {"gate_states": states, "open": opened, "total": len(logits), "weak": weak,
            "min_abs_logit": min(abs(x) for x in logits), "weak_flip": flip, "warnings": warnings}


def weak_gate_effect(trainer, fuser: Fuser, threshold: float) -> dict | None:
    """Validation NLL of the shipped fuser as saved, and with every weak gate flipped: a
    coin-flip gate is harmless when its state does not change what the receiver predicts."""
    p, c = trainer.p, trainer.c
    probe = copy.deepcopy(fuser).float().requires_grad_(False)  # one float32 copy, measured then flipped
    gates = [getattr(proj, f"{b}_gate_logit") for proj in probe.projectors for b in ("key", "value")]
    weak = [g for g in gates if abs(float(g)) < threshold]
    if not weak or not p.val_items:
        return None
    zero = c.sharer_input == "zero"
    base = evaluate(p.receiver, probe, p.bank, p.prefix, p.val_items, c.batch_size, zero)
    with torch.no_grad():
        for g in weak:
            g.copy_(-g if float(g) != 0 else torch.ones_like(g))  # 0 is closed: flipped is open
    alt = evaluate(p.receiver, probe, p.bank, p.prefix, p.val_items, c.batch_size, zero)
    return {"weak_gates": len(weak), "val_nll": base, "flipped_val_nll": alt, "relative_change": (alt - base) / base}


def shipped_fuser(trainer) -> Fuser:
    plain = fusermodel.fold(trainer.fuser)
    if trainer.best is not None:
        plain.load_state_dict(trainer.best)
    return plain.eval()


def finish(trainer) -> dict:
    from cachegraft_cli.fuser.checkpoint import save_own, save_published

    c, s, p, out = trainer.c, trainer.state, trainer.p, Path(trainer.out)
    if p.val_items and (s.best_step is None or s.best_step != s.step) and not _validated_at(trainer, s.step):
        trainer.validate()
    final_val = _last_val(trainer)
    fuser = cast_fuser(shipped_fuser(trainer), c.save_dtype)
    gates = gate_report(fuser, c.gate_warn_threshold, weak_gate_effect(trainer, fuser, c.gate_warn_threshold))
    training = {"objective": c.objective, "sharer_input": c.sharer_input, "seed": c.seed, "steps": s.step,
                "best_step": s.best_step, "data": c.data}
    save_own(fuser, out, extra={"training": training})
    if c.also_published:
        save_published(fuser, out / "published")
    summary = {
        "status": s.status,
        "steps": s.step,
        "epochs_completed": s.epoch,
        "planned_steps": trainer.planned,
        "train_seconds": round(s.train_seconds, 1),
        "precompute_seconds": round(p.precompute_seconds, 1),
        "final_train_loss": _mean(trainer.recent[-20:]),
        "final_val_nll": final_val,
        "best_val_nll": s.best_val,
        "best_step": s.best_step,
        "closed_val_nll": s.closed_val,
        "shipped": "best validation" if trainer.best is not None else "last step",
        "parameters": fusermodel.parameter_count(fuser),
        "weights_bytes": (out / "fuser.safetensors").stat().st_size,
        "save_dtype": c.save_dtype,
        "gates": gates,
        "data": p.data_info,
        "config": c.as_dict(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    trainer.log.write("end", step=s.step, status=s.status, final_val_nll=final_val, best_val_nll=s.best_val,
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
