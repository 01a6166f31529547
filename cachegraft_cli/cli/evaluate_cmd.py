from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cachegraft_cli.answering.assembly import DEFAULT_ORDER, DEFAULT_RECOMPUTE, AssemblyOptions
from cachegraft_cli.cli.options import (
    BlendLayerOpt,
    BlendOpt,
    DeviceOpt,
    DtypeOpt,
    FuserOpt,
    JsonOpt,
    OrderOpt,
    PresetOpt,
    ReceiverOpt,
    RecomputeOpt,
    SchemeOpt,
    SharerOpt,
)
from cachegraft_cli.cli.output import emit_json
from cachegraft_cli.encoding.keep import DEFAULT_KEEP_BY


def evaluate(
    benchmark: Annotated[
        list[str],
        typer.Option(
            "--benchmark",
            "-B",
            help="[name=]squad.json | [name=]qa.jsonl | [name=]hf:DATASET[:SPLIT][?col=field]. Repeatable.",
        ),
    ],
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Run directory (re-run to resume; judges may be added or dropped on resume)."),
    ],
    systems: Annotated[
        str,
        typer.Option(help="Comma list of graft, text, cache, closed, sharer-text, adapter; SYSTEM@key=value "
                          "overrides the assembly for one entry, e.g. text@order=retrieval (keys: order, recompute, "
                          "blend, blend_layer, scheme; store keys codec, keep, keep_by)."),
    ] = "graft,text,cache,closed",
    ks: Annotated[str, typer.Option("--k", help="Comma list of k values.")] = "1,3,5",
    judge: Annotated[
        Optional[list[str]], typer.Option("--judge", "-J", help="Judge model (hub id, local dir, .gguf). Repeatable.")
    ] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Questions per benchmark (sampled with --seed).")] = None,
    seed: Annotated[int, typer.Option(help="Sampling and bootstrap seed.")] = 0,
    corpus: Annotated[
        str, typer.Option(help="articles (paragraphs of the sampled questions' articles) or full.")
    ] = "articles",
    articles: Annotated[
        Optional[int], typer.Option(min=1, help="Sample questions from this many articles only (small corpus).")
    ] = None,
    pairwise: Annotated[bool, typer.Option(help="Also judge graft vs text pairwise (order swapped).")] = False,
    judge_limit: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="Judge only N seeded-random questions of each benchmark (all their systems and k; saves CPU time).",
        ),
    ] = None,
    preset: PresetOpt = None,
    receiver: ReceiverOpt = None,
    sharer: SharerOpt = None,
    fuser: FuserOpt = None,
    adapter_fuser: Annotated[
        Optional[str], typer.Option(help="Fuser trained with --sharer-input zero, for the adapter system.")
    ] = None,
    codec: Annotated[Optional[str], typer.Option(
        help="Store codec: bf16, int8, int4, k8v4, k2v4, int2 or tc (the fuser's shipped calibration) (default: "
             "encode's: tc where the fuser ships a calibration, else int8).")] = None,
    keep: Annotated[float, typer.Option(help="Share of each passage's tokens the stores keep (encode --keep); "
                                             "SYSTEM@keep=R, @codec=C, @keep_by=M answer one entry from such a store.")
                    ] = 1.0,
    keep_by: Annotated[str, typer.Option(help="How a pruned store chooses its tokens: attention, norm or even.")
                       ] = DEFAULT_KEEP_BY,
    scheme: SchemeOpt = "rotate",
    order: OrderOpt = DEFAULT_ORDER,
    recompute: RecomputeOpt = DEFAULT_RECOMPUTE,
    blend: BlendOpt = 0.0,
    blend_layer: BlendLayerOpt = 1,
    stores: Annotated[Path, typer.Option(help="Where benchmark stores are kept and reused "
                                                  "(one per corpus sample, models and codec).")] = Path("stores"),
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 32,
    answer_batch: Annotated[
        int,
        typer.Option(min=1, max=64, help="Questions decoded together (1: one at a time; more is faster, and the "
                     "timings become the batch's)."),
    ] = 1,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the paper's protocol: systems x benchmarks x k, EM/F1, judges, paired tests, report."""
    from cachegraft_cli.cli.output import showing_status
    from cachegraft_cli.config import preset_adapter
    from cachegraft_cli.encoding.calibration import default_codec
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.evaluation.answerer import AnswererConfig, StoreAnswerer
    from cachegraft_cli.evaluation.protocol import RunConfig, run_evaluation
    from cachegraft_cli.evaluation.variants import base_system
    from cachegraft_cli.fuser import check_fuser_spec
    from cachegraft_cli.session import ModelChoice

    AssemblyOptions(order, scheme, recompute, blend, blend_layer).check()  # before anything loads
    EncodeOptions(codec, keep=keep, keep_by=keep_by)
    choice = ModelChoice.resolve(preset, receiver, sharer, fuser, device=device, dtype=dtype).check()
    codec = codec or default_codec(choice.fuser)[0]  # encode's: tc where the fuser ships a calibration
    system_list = [s.strip() for s in systems.split(",") if s.strip()]
    _check_blend_layers(choice.receiver, AssemblyOptions(order, scheme, recompute, blend, blend_layer), system_list)
    if adapter_fuser is None and any(base_system(s) == "adapter" for s in system_list):
        adapter_fuser = preset_adapter(preset, fuser)  # a preset knows its own control
    check_fuser_spec(adapter_fuser)
    acfg = AnswererConfig(
        choice.receiver,
        choice.sharer,
        choice.fuser,
        adapter_fuser,
        codec,
        keep,
        keep_by,
        scheme,
        order,
        recompute,
        blend,
        blend_layer,
        max_new_tokens=max_new_tokens,
        answer_batch=answer_batch,
        device=device,
        dtype=dtype,
        stores_dir=str(stores),
    )
    config = RunConfig(
        benchmark,
        system_list,
        out,
        _ints(ks),
        list(judge or []),
        limit,
        seed,
        corpus,
        articles,
        pairwise,
        answerer_config=acfg.results_key(),
        judge_limit=judge_limit,
    )
    with showing_status(json_out):
        summary = run_evaluation(config, StoreAnswerer(acfg, system_list))
    if json_out:
        emit_json(summary)
        return
    for line in summary["headlines"].values():
        typer.echo(line)
    typer.echo(f"report: {out / 'report.md'}")


def _check_blend_layers(receiver: str, run: AssemblyOptions, systems: list[str]) -> None:
    """The run's --blend-layer and each system's `@blend_layer=` against the receiver's layers, from
    its config.json before any model loads (answering refuses a layer past the last: found only
    then, it would stop the run after its stores were encoded). Skipped where no config is readable."""
    from dataclasses import replace

    from cachegraft_cli.answering.assembly import check_blend_layer
    from cachegraft_cli.answering.systems import CACHE_KIND
    from cachegraft_cli.evaluation.variants import parse_variant
    from cachegraft_cli.lm.models import configured_count

    layers = configured_count(receiver, "num_hidden_layers")
    if layers is None:
        return
    for label in systems:
        variant = parse_variant(label)
        if variant.system in CACHE_KIND:  # the systems that blend stored caches
            check_blend_layer(replace(run, **variant.assembly), layers)


def _ints(text: str) -> list[int]:
    from cachegraft_cli.errors import UsageError

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--k takes a comma list of integers, got {text!r}.", "Example: --k 1,3,5") from None
