"""The training loop: steps, validation, early stopping, checkpoints, resume, outputs."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch

from cachegraft_cli.errors import TrainingError
from cachegraft_cli.training import fusermodel, objectives, outputs, setup
from cachegraft_cli.training.config import TrainConfig
from cachegraft_cli.training.log import Progress, RunLog, say
from cachegraft_cli.training.state import FINISHED, TrainState
from cachegraft_cli.training.validation import evaluate

__all__ = ["Trainer", "evaluate", "planned_steps", "run"]

STATE_DIR = "checkpoint"
RESUME_KEYS = (
    "receiver",
    "sharer",
    "objective",
    "sharer_input",
    "data",
    "val_data",
    "seed",
    "hidden_dim",
    "intermediate_dim",
    "num_layers",
    "batch_size",
    "epochs",
    "max_steps",
    "lr",
    "gate_lr",
    "passages_per_item",
    "distractors",
    "order",
    "recompute",
    "holdout",
    "holdout_seed",
)


def epoch_batches(items, batch_size: int, seed: int, epoch: int) -> list[list]:
    """Seeded batches of items with similar passage length (little padding), in shuffled order."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(items)
    rng.shuffle(order)
    order.sort(key=lambda i: i.past_tokens // 32)  # stable: random within a length bucket
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, config, prepared, fuser, planned_steps: int, progress: bool):
        self.c, self.p, self.fuser, self.planned = config, prepared, fuser, planned_steps
        self.out = Path(config.out)
        self.zero = config.sharer_input == "zero"
        self.opt = torch.optim.AdamW(
            [
                {
                    "params": fusermodel.other_parameters(fuser),
                    "lr": config.lr,
                    "weight_decay": config.weight_decay,
                    "base": config.lr,
                },
                {
                    "params": fusermodel.gate_parameters(fuser),
                    "lr": config.gate_lr,
                    "weight_decay": 0.0,
                    "base": config.gate_lr,
                },
            ]
        )
        self.state = TrainState()
        self.best: dict | None = None  # folded state dict of the best validated fuser
        self.recent: list[float] = []
        self.log = RunLog(self.out, config.resume)
        self.show = progress

    # ---- checkpoints ---------------------------------------------------------

    def save_checkpoint(self) -> None:
        folder = self.out / STATE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        blob = {"fuser": self.fuser.state_dict(), "optimizer": self.opt.state_dict(), "rng": torch.get_rng_state(),
                "best": self.best or {}}
        torch.save(blob, folder / "state.pt.tmp")
        (folder / "state.pt.tmp").replace(folder / "state.pt")
        meta = {"state": self.state.as_dict(), "config": {k: getattr(self.c, k) for k in RESUME_KEYS}}
        (folder / "state.json").write_text(json.dumps(meta, indent=1))

    def load_checkpoint(self) -> bool:
        folder = self.out / STATE_DIR
        if not (folder / "state.json").is_file():
            return False
        meta = json.loads((folder / "state.json").read_text())
        saved = {k: meta["config"].get(k, getattr(TrainConfig, k, None)) for k in RESUME_KEYS}  # older runs: defaults
        differ = [k for k in RESUME_KEYS if saved[k] != getattr(self.c, k)]
        if differ:
            raise TrainingError(
                f"Cannot resume: {', '.join(differ)} differ from the interrupted run in {self.out}.",
                "Resume with the same options, or train into a new --out directory.",
            )
        blob = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
        self.fuser.load_state_dict(blob["fuser"])
        self.opt.load_state_dict(blob["optimizer"])
        torch.set_rng_state(blob["rng"])
        self.best = blob["best"] or None
        self.state = TrainState.from_dict(meta["state"])
        if self.state.status not in FINISHED:
            self.state.status = "running"  # interrupted or out of time: continue
        self.log.truncate_after(self.state.step)
        return True

    # ---- steps ---------------------------------------------------------------

    def train_step(self, batch) -> dict:
        c, step = self.c, self.state.step
        fusermodel.set_temperature(self.fuser, step)
        for group in self.opt.param_groups:
            group["lr"] = group["base"] * lr_factor(step, c.warmup_steps, self.planned)
        self.fuser.train()
        loss_sum, n = objectives.batch_nll(self.p.receiver, self.fuser, self.p.bank, self.p.prefix, batch, self.zero)
        loss = loss_sum / max(n, 1)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.fuser.parameters(), c.grad_clip if c.grad_clip > 0 else float("inf")
        )
        self.opt.step()
        self.state.step += 1
        return {"loss": float(loss.detach()), "tokens": n, "grad_norm": float(grad_norm),
                "lr": self.opt.param_groups[0]["lr"], "tau": float(self.fuser.projectors[0].gate_temperature)}

    def validate(self) -> float:
        val = evaluate(
            self.p.receiver, self.fuser, self.p.bank, self.p.prefix, self.p.val_items, self.c.batch_size, self.zero
        )
        s = self.state
        improved = s.best_val is None or val < s.best_val - 1e-4
        if improved:
            s.best_val, s.best_step, s.bad_evals = val, s.step, 0
            self.best = {k: v.clone() for k, v in fusermodel.fold(self.fuser).state_dict().items()}
        else:
            s.bad_evals += 1
        gates = self.fuser.gate_states()
        self.log.write("validation", step=s.step, val_nll=val, best_val_nll=s.best_val, improved=improved,
                       gates_open=_open(gates), gate_states=gates)
        return val

    def run(self, on_step=None) -> None:
        c, s = self.c, self.state
        bar = Progress(self.planned, s.step, self.show)
        t_start, t_base = time.perf_counter(), s.train_seconds
        try:
            while s.status == "running":
                batches = epoch_batches(self.p.train_items, c.batch_size, c.seed, s.epoch)
                while s.batch < len(batches) and s.status == "running":
                    info = self.train_step(batches[s.batch])
                    s.batch += 1
                    s.train_seconds = t_base + time.perf_counter() - t_start
                    self._after_step(info, len(batches[s.batch - 1]), bar)
                    if on_step:
                        on_step(s.step)
                if s.batch >= len(batches):
                    s.epoch, s.batch = s.epoch + 1, 0
                    if s.epoch >= c.epochs and not c.max_steps:
                        s.status = "completed"
        except KeyboardInterrupt:
            s.status = "interrupted"
            self.save_checkpoint()
            bar.close()
            raise
        bar.close()

    def _after_step(self, info: dict, items: int, bar: Progress) -> None:
        c, s = self.c, self.state
        self.recent = (self.recent + [info["loss"]])[-50:]
        gates = self.fuser.gate_states()
        self.log.write("step", step=s.step, epoch=s.epoch, seconds=round(s.train_seconds, 2), **info)
        bar.step(info["loss"], items, info["tokens"], _open(gates), 2 * len(gates))
        if self.p.val_items and s.step % c.val_every == 0:
            val = self.validate()
            bar.note(f"step {s.step}: val NLL {val:.4f} (best {s.best_val:.4f} at {s.best_step}; "
                     f"receiver's own cache {s.closed_val:.4f}); gates open {_open(gates)}/{2 * len(gates)}")
            if c.patience is not None and s.bad_evals >= c.patience:
                s.status = "early_stopped"
        if c.max_steps and s.step >= c.max_steps:
            s.status = "completed"
        if c.max_minutes and s.train_seconds >= 60 * c.max_minutes:
            s.status = "time_limit"
        if s.step % c.save_every == 0 or s.status != "running":
            self.save_checkpoint()


def _open(gates) -> int:
    return sum(int(g["key"]) + int(g["value"]) for g in gates)


def planned_steps(config, n_items: int) -> int:
    per_epoch = max(1, math.ceil(n_items / config.batch_size))
    return config.max_steps or per_epoch * config.epochs


def run(config, progress: bool = True, on_step=None) -> dict:
    """Prepare, train (or resume), validate, save; returns the summary."""
    config.check()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if not config.resume and (out / STATE_DIR / "state.json").is_file():
        raise TrainingError(f"{out} already holds a training run.", "Pass --resume to continue it, or choose a new "
                                                                    "--out.")
    prepared, fuser, planned = prepare(config, progress)
    trainer = Trainer(config, prepared, fuser, planned, progress)
    resumed = config.resume and trainer.load_checkpoint()
    if not resumed:
        trainer.state.closed_val = evaluate(prepared.receiver, None, prepared.bank, prepared.prefix,
                                               prepared.val_items, config.batch_size, False)
        trainer.log.write("start", step=0, planned_steps=planned, closed_val_nll=trainer.state.closed_val,
                          train_items=len(prepared.train_items), val_items=len(prepared.val_items))
        say(f"training {len(prepared.train_items)} items ({len(prepared.train_keys)} passages), validating on "
            f"{len(prepared.val_items)} ({len(prepared.val_keys)} passages); {planned} steps planned; receiver's own "
            f"cache val NLL {trainer.state.closed_val:.4f}")
    else:
        say(f"resumed {out} at step {trainer.state.step}")
    if trainer.state.status == "running":
        trainer.run(on_step)
    return outputs.finish(trainer)


def prepare(config, progress: bool):
    from cachegraft_cli.training.data import read_files

    torch.manual_seed(config.seed)
    dataset, held_out = setup.without_holdout(config, read_files(config.data, config.allow_eval_sets))
    val_dataset = read_files(config.val_data, config.allow_eval_sets) if config.val_data else None
    if val_dataset is not None:
        val_dataset, held_val = setup.without_holdout(config, val_dataset)
        held_out += held_val
    if config.objective == "qa" and not dataset.questions:
        raise TrainingError("The qa objective needs questions, and the data has none.",
                            "Give SQuAD-format JSON files, or use --objective lm for plain text.")
    receiver, sharer, _ = setup.load_models(config)
    template = setup.template_for(config, receiver)
    ids, train_keys, val_keys = setup.select_passages(config, template, dataset, val_dataset)
    questions = dataset.questions + (val_dataset.questions if val_dataset else [])
    texts = {**dataset.passages, **(val_dataset.passages if val_dataset else {})}
    notes = setup.extend_ids_with_notes(config, sharer, template, texts, ids, train_keys + val_keys, progress)
    train_items = setup.build_items(config, template, ids, train_keys, questions, texts)
    val_items = setup.cap_items(setup.build_items(config, template, ids, val_keys, questions, texts),
                                config.max_val_items, config.seed)
    planned = planned_steps(config, len(train_items))
    sgeo = setup.sharer_geometry(config, sharer)
    torch.manual_seed(config.seed)
    fuser = fusermodel.create(receiver, config.sharer, sgeo, config, planned, setup.needs_alignment(receiver, sharer))
    bank, prefix, seconds = setup.fill_bank(
        config, receiver, sharer, template, fuser, ids, train_keys + val_keys, progress
    )
    del sharer
    setup.free(None)
    scales = None
    if config.normalize_inputs:
        scales = bank.input_scales(train_keys[:32], fuser.spec.layer_map)
        fusermodel.add_input_scales(fuser, scales)
    info = {"train_passages": len(train_keys), "val_passages": len(val_keys), "train_items": len(train_items),
            "val_items": len(val_items), "held_out_passages": held_out, "input_scales": scales,
            **({"notes": notes} if notes else {})}
    return setup.TrainingSetup(receiver, template, sgeo, train_items, val_items, train_keys, val_keys, bank, prefix,
                          seconds, info), fuser, planned
