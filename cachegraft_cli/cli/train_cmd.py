from __future__ import annotations

from typing import Annotated, Optional

import typer

from cachegraft_cli.answering.assembly import DEFAULT_ORDER, DEFAULT_RECOMPUTE
from cachegraft_cli.cli.options import (
    DeviceOpt,
    InstructionOpt,
    JsonOpt,
    OrderOpt,
    PresetOpt,
    ReceiverOpt,
    RecomputeOpt,
    SharerOpt,
    TrustOpt,
)
from cachegraft_cli.cli.output import emit_json, log


def train_fuser(
    out: Annotated[str, typer.Option("--out", "-o", help="Run directory: the fuser (own format), logs, checkpoint.")],
    data: Annotated[
        list[str], typer.Option("--data", help="Training data: SQuAD JSON, JSONL ('text') or .txt; repeatable.")
    ],
    preset: PresetOpt = None,
    receiver: ReceiverOpt = None,
    sharer: SharerOpt = None,
    objective: Annotated[
        str,
        typer.Option(
            help="qa: answer tokens after prefix + fused passage + question; lm: continuation of a fused text prefix."
        ),
    ] = "qa",
    sharer_input: Annotated[
        str, typer.Option(help="model, or zero: a receiver-only adapter control (the sharer never runs).")
    ] = "model",
    sharer_notes: Annotated[
        int, typer.Option(help="Train on passages followed by the sharer's notes (up to N tokens each), as "
                               "`encode --sharer-notes N` stores them (0: none).")
    ] = 0,
    val_data: Annotated[
        Optional[list[str]],
        typer.Option("--val-data", help="Validation files (default: a seeded held-out split of --data by passage)."),
    ] = None,
    val_fraction: Annotated[float, typer.Option(help="Share of passages held out for validation.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed for the split, batch order, init, dropout and gate noise.")] = 0,
    hidden_dim: Annotated[int, typer.Option(help="Fuser hidden width.")] = 1024,
    intermediate_dim: Annotated[int, typer.Option(help="Fuser FFN intermediate width.")] = 1024,
    num_layers: Annotated[int, typer.Option(help="Fuser depth L (L-2 projection FFN blocks).")] = 3,
    dropout: Annotated[float, typer.Option(help="Fuser dropout (training only).")] = 0.1,
    lr: Annotated[float, typer.Option(help="Peak learning rate of the projector weights.")] = 5e-4,
    gate_lr: Annotated[float, typer.Option(help="Learning rate of the gate logits (higher, so gates decide).")] = 2e-2,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Items per step.")] = 8,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the training items (ignored with --max-steps).")] = 1,
    max_steps: Annotated[
        Optional[int], typer.Option(min=1, help="Stop after this many steps (also sets the gate anneal length).")
    ] = None,
    max_minutes: Annotated[
        Optional[float], typer.Option(help="Stop training after this many minutes (caches excluded).")
    ] = None,
    warmup_steps: Annotated[int, typer.Option(help="Linear warm-up steps.")] = 10,
    grad_clip: Annotated[float, typer.Option(help="Clip the gradient norm (0: off).")] = 1.0,
    normalize_inputs: Annotated[
        bool, typer.Option(help="Scale fuser inputs by per-layer 1/RMS (folded into the saved weights).")
    ] = True,
    max_passages: Annotated[Optional[int], typer.Option(help="Cap the training passages.")] = None,
    max_val_passages: Annotated[int, typer.Option(help="Cap the validation passages.")] = 64,
    max_val_items: Annotated[int, typer.Option(help="Cap the validation items.")] = 128,
    max_passage_tokens: Annotated[int, typer.Option(help="Skip longer passages.")] = 256,
    lm_target_tokens: Annotated[int, typer.Option(help="lm: continuation tokens scored.")] = 48,
    passages_per_item: Annotated[
        str,
        typer.Option(help="qa: past = the answer's passage among K passages, K from this comma list in equal shares "
                          "(e.g. 1,3,5), assembled as `ask -k K` does."),
    ] = "1",
    distractors: Annotated[
        str, typer.Option(help="qa: the other passages: retrieved (BM25's top K for the question, as ask) or random.")
    ] = "retrieved",
    order: OrderOpt = DEFAULT_ORDER,
    recompute: RecomputeOpt = DEFAULT_RECOMPUTE,
    holdout: Annotated[
        Optional[list[str]],
        typer.Option("--holdout", help="An evaluate -B spec (name=FILE?articles=N&limit=Q) whose corpus is never "
                                       "trained on; repeatable."),
    ] = None,
    holdout_seed: Annotated[int, typer.Option(help="The evaluate --seed the --holdout specs are sampled with.")] = 0,
    val_every: Annotated[int, typer.Option(min=1, help="Validate every N steps.")] = 50,
    save_every: Annotated[int, typer.Option(min=1, help="Checkpoint every N steps.")] = 50,
    patience: Annotated[Optional[int], typer.Option(help="Stop after N validations without improvement.")] = 4,
    cache_dir: Annotated[
        Optional[str], typer.Option(help="Where the precomputed model caches live ('none': memory only).")
    ] = None,
    cache_dtype: Annotated[str, typer.Option(help="float32 or bfloat16 for the precomputed caches.")] = "bfloat16",
    save_dtype: Annotated[str, typer.Option(help="float32 or bfloat16 for the shipped fuser weights.")] = "float32",
    also_published: Annotated[bool, typer.Option(help="Also write the published C2C layout to OUT/published.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run in --out.")] = False,
    allow_eval_sets: Annotated[
        bool, typer.Option(help="Allow training on files named like the SQuAD dev (evaluation) set.")
    ] = False,
    model_dtype: Annotated[
        str, typer.Option("--dtype", help="Dtype of the frozen models (float32 recommended on CPU).")
    ] = "float32",
    sharer_dtype: Annotated[
        Optional[str], typer.Option(help="Dtype of the sharer while caching (default: --dtype).")
    ] = None,
    instruction: InstructionOpt = None,
    device: DeviceOpt = None,
    trust_remote_code: TrustOpt = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Train a C2C fuser for a (receiver, sharer) pair; both models stay frozen."""
    from cachegraft_cli.cli.output import showing_status
    from cachegraft_cli.session import ModelChoice
    from cachegraft_cli.training import TrainConfig, train_fuser as run

    choice = ModelChoice.resolve(preset, receiver, sharer, None)
    if not choice.sharer:
        from cachegraft_cli.errors import UsageError

        raise UsageError("train-fuser needs a sharer model.", "Pass --sharer (its geometry is needed even with "
                                                              "--sharer-input zero).")
    config = TrainConfig(
        receiver=choice.receiver,
        sharer=choice.sharer,
        data=list(data),
        out=out,
        objective=objective,
        sharer_input=sharer_input,
        sharer_notes=sharer_notes,
        val_data=list(val_data or []),
        seed=seed,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        num_layers=num_layers,
        dropout=dropout,
        lr=lr,
        gate_lr=gate_lr,
        batch_size=batch_size,
        epochs=epochs,
        max_steps=max_steps,
        max_minutes=max_minutes,
        warmup_steps=warmup_steps,
        grad_clip=grad_clip,
        normalize_inputs=normalize_inputs,
        val_fraction=val_fraction,
        max_passages=max_passages,
        max_val_passages=max_val_passages,
        max_val_items=max_val_items,
        max_passage_tokens=max_passage_tokens,
        lm_target_tokens=lm_target_tokens,
        passages_per_item=_mix(passages_per_item),
        distractors=distractors,
        order=order,
        recompute=recompute,
        holdout=list(holdout or []),
        holdout_seed=holdout_seed,
        val_every=val_every,
        save_every=save_every,
        patience=patience,
        cache_dir=cache_dir,
        cache_dtype=cache_dtype,
        save_dtype=save_dtype,
        also_published=also_published,
        resume=resume,
        allow_eval_sets=allow_eval_sets,
        model_dtype=model_dtype,
        sharer_dtype=sharer_dtype,
        instruction=instruction,
        device=device,
        trust_remote_code=trust_remote_code,
    )
    import signal

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # `kill` checkpoints like Ctrl-C (background jobs ignore SIGINT)
    try:
        with showing_status(json_out or quiet):
            summary = run(config, progress=not quiet)
    except KeyboardInterrupt:
        log(f"interrupted: checkpoint saved; continue with the same command plus --resume (out: {out}).")
        raise SystemExit(130) from None
    if json_out:
        emit_json({k: v for k, v in summary.items() if k != "config"})
    else:
        _print(out, summary)


def _print(out: str, s: dict) -> None:
    g = s["gates"]
    typer.echo(
        f"{out}: {s['status']} after {s['steps']} steps ({s['train_seconds']:.0f} s); train loss "
        f"{s['final_train_loss']:.4f}; "
        f"val NLL {s['best_val_nll'] if s['best_val_nll'] is not None else float('nan'):.4f} (best, step "
        f"{s['best_step']}) vs "
        f"receiver's own cache {s['closed_val_nll'] if s['closed_val_nll'] is not None else float('nan'):.4f}; "
        f"gates open {g['open']}/{g['total']}; {s['parameters']:,} parameters, {s['weights_bytes']:,} bytes."
    )


def _mix(text: str) -> list[int]:
    from cachegraft_cli.errors import UsageError

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--passages-per-item takes a comma list of integers, got {text!r}.",
                         "Example: 1,3,5") from None
