"""CPU speed of fusing passages vs. running the receiver and the sharer alone.

Loads the receiver and sharer (CPU, the library's dtype) and a random-initialised fuser with
open gates, tokenizes N SQuAD passages with the shared prompt template, and
times three conditions per batch size, interleaved batch by batch (the order
rotates every batch) so that drift in machine load hits all of them alike:

- receiver: `PassageFusion(receiver, prefix)` (no sharer) -> receiver prefill
- sharer:   `PassageFusion(sharer, prefix)` the same way -> sharer prefill
- fuse:     `PassageFusion(receiver, prefix, sharer, fuser)` -> full fuse,
            once with the fuser in float32 (its default) and once cast to bf16;
            `--fuser SPEC` adds a trained fuser (its own width and dtype)

Reports seconds per 1,000 real passage tokens (pads excluded: they are part of
the cost of batching) and fuse / (receiver + sharer), over all batches and as
the median of per-batch ratios (robust on a shared, noisy machine). Prints a
table, then one JSON line. `--profile` adds the time of each part of one fuse
(receiver pass, sharer pass, fuser per dtype, clones) and the fuser's top ops.

By matmul FLOPs per token (receiver 0.72 G, sharer 2.62 G, fuser at hidden
1024: 0.65 G, about the receiver's own cost) a fuse should take about 1.2x
receiver + sharer. `--max-tokens` and `--budget-s` bound the run on slow CPUs
(bf16 without AVX512-BF16/AMX runs several times slower than float32).

    python benchmarks/fuse_speed.py [--n 32] [--batch-sizes 1,8] [--threads 2] [--dtype float32|bfloat16]
        [--max-tokens 0] [--rounds 1] [--budget-s 0]
        [--receiver DIR] [--sharer DIR] [--data SQUAD_JSON] [--fuser SPEC] [--profile]
"""

from __future__ import annotations

import os

# Must be set before torch (its OpenMP runtime) is imported. By default idle
# OpenMP workers spin for a while after each parallel region; on a small
# machine shared with other jobs that spinning steals cores from everyone
# (ourselves included) and makes timings depend on the neighbours.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from cachegraft_cli.config import pulled_models_dir
from cachegraft_cli.fuser import fusion, load_fuser, place_fuser
from cachegraft_cli.fuser.fuser import Fuser
from cachegraft_cli.fuser.fusion import PassageFusion
from cachegraft_cli.lm.models import cpu_has_fast_bf16, load_causal_lm
from cachegraft_cli.lm.template import PromptTemplate

REPO = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("CACHEGRAFT_BENCH_MODELS") or pulled_models_dir())  # `cachegraft models pull offline`
DEFAULT_DATA = (Path(os.environ.get("CACHEGRAFT_QA_DATA") or REPO / ".." / "shared" / "data" / "qa")
                / "squad_v1.1_dev.json").resolve()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--receiver", default=str(MODELS / "qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--sharer", default=str(MODELS / "qwen2.5-coder-1.5b-instruct"))
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--n", type=int, default=32, help="passages")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None,
                    help="model dtype; default: the library's for the CPU (float32 unless it has fast bf16)")
    ap.add_argument("--max-tokens", type=int, default=0, help="truncate passages to this many tokens (0 = whole)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the passages per batch size")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="per batch size: stop after the first batch that ends past this many seconds (0 = all)")
    ap.add_argument("--seed", type=int, default=0, help="passage sample and fuser init")
    ap.add_argument("--no-bf16-fuser", action="store_true", help="skip the bf16-cast fuser condition")
    ap.add_argument("--fuser", default=None,
                    help="also time this trained fuser (builtin:NAME or a dir), as condition fuse_trained")
    ap.add_argument("--profile", action="store_true", help="time the parts of one fuse at the largest batch size")
    return ap.parse_args(argv)


def load_passages(path: str, n: int, seed: int) -> list[tuple[str, str]]:
    """A seeded sample of n (title, context) paragraphs."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
    paras = [(a.get("title", "").replace("_", " "), p["context"]) for a in data for p in a["paragraphs"]]
    return random.Random(seed).sample(paras, min(n, len(paras)))


def build_fusers(receiver, sharer, seed: int, with_bf16: bool) -> dict:
    """{'float32': fuser, 'bfloat16': fuser} with random weights and open gates."""
    torch.manual_seed(seed)
    fuser = Fuser.create(receiver.spec, sharer.spec, receiver.geometry, sharer.geometry)
    fuser.set_gates(1.0)
    fuser.eval()  # a new nn.Module trains: Gumbel gates + dropout; inference uses hard gates
    fuser = place_fuser(fuser, receiver.device)  # as encode places it (dtype, oneDNN linears)
    fusers = {"float32": fuser}
    if with_bf16:
        fusers["bfloat16"] = cast_fuser(copy.deepcopy(fuser), torch.bfloat16)
    return fusers


def cast_fuser(fuser: Fuser, dtype: torch.dtype) -> Fuser:
    """`fuser.to(dtype)`, or the same cast done on its projectors where that fails:
    `Fuser._apply` (its fusing helper) shadows `nn.Module._apply`, which `.to()` uses."""
    try:
        return fuser.to(dtype)
    except TypeError as exc:
        print(f"fuser.to({dtype}) failed ({exc}); casting fuser.projectors instead", file=sys.stderr)
        fuser.projectors.to(dtype)
        return fuser


def build_conditions(receiver, sharer, fusers: dict, prefix: list[int]) -> dict:
    """Condition name -> engine; every engine's `fuse(batch)` is what gets timed."""
    conditions = {
        "receiver": PassageFusion(receiver, prefix),
        "sharer": PassageFusion(sharer, prefix),  # same tokenizer: same ids
    }
    for dtype, fuser in fusers.items():
        conditions[f"fuse_{dtype}"] = PassageFusion(receiver, prefix, sharer, fuser)
    return conditions


def drop_failing(conditions: dict, probe: list[list[int]]) -> dict:
    """Run each condition once (warm-up); drop (and report) those that raise."""
    kept = {}
    for name, engine in conditions.items():
        try:
            engine.fuse(probe)
            kept[name] = engine
        except Exception as exc:  # noqa: BLE001 - e.g. a bf16 fuser op missing on this CPU
            print(f"condition {name} dropped: {type(exc).__name__}: {exc}", file=sys.stderr)
    return kept


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def time_interleaved(conditions: dict, batches: list, rounds: int, budget_s: float) -> list[dict]:
    """Seconds per condition for each (round, batch) unit measured, plus its token count.

    Within a unit the conditions run back to back, starting with a different
    one each unit, so a load spike hits them alike; a budget stop only ever
    falls between units, so every condition covers the same batches."""
    names, units, start = list(conditions), [], time.perf_counter()
    for r in range(rounds):
        for b, batch in enumerate(batches):
            shift = len(units) % len(names)
            unit = {"tokens": sum(map(len, batch)), "padded": len(batch) * max(map(len, batch))}
            for name in names[shift:] + names[:shift]:
                unit[name] = wall(lambda: conditions[name].fuse(batch))  # noqa: B023 - called at once
            units.append(unit)
            print(f"  round {r + 1} batch {b + 1}/{len(batches)}: "
                  + ", ".join(f"{n} {unit[n]:.1f}s" for n in names), file=sys.stderr)
            if budget_s and time.perf_counter() - start > budget_s:
                return units
    return units


def wall(fn) -> float:
    return timed(fn)[1]


def timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def summarise(units: list[dict], names: list[str]) -> dict:
    """s per 1,000 tokens over all units; fuse/(receiver+sharer) over all units and
    as the median of per-unit ratios (robust to a unit hit by a load spike)."""
    tokens = sum(u["tokens"] for u in units)
    row = {n: 1000 * sum(u[n] for u in units) / tokens for n in names}
    fuses = [n for n in names if n.startswith("fuse_")]
    ratios = {n: row[n] / (row["receiver"] + row["sharer"]) for n in fuses}
    medians = {n: statistics.median(u[n] / (u["receiver"] + u["sharer"]) for u in units) for n in fuses}
    return {"s_per_1k_tokens": row, "ratio": ratios, "median_unit_ratio": medians, "units": len(units),
            "tokens": tokens, "padded_tokens": sum(u["padded"] for u in units)}


def measure(conditions: dict, passages: list[list[int]], batch_size: int, rounds: int, budget_s: float) -> dict:
    # Longest-first order: batches of similar lengths waste less on padding, as an encoder would do.
    ordered = sorted(passages, key=len, reverse=True)
    print(f"batch size {batch_size}:", file=sys.stderr)
    units = time_interleaved(conditions, chunks(ordered, batch_size), rounds, budget_s)
    return summarise(units, list(conditions))


def print_table(results: dict[int, dict]) -> None:
    names = list(next(iter(results.values()))["s_per_1k_tokens"])
    print(f"{'batch':>5}  " + "  ".join(f"{n:>14}" for n in names) + "  fuse/(receiver+sharer): all (median of units)")
    for bs, res in results.items():
        cells = "  ".join(f"{res['s_per_1k_tokens'][n]:14.1f}" for n in names)
        ratios = "  ".join(f"{n}={v:.3f} ({res['median_unit_ratio'][n]:.3f})" for n, v in res["ratio"].items())
        print(f"{bs:>5}  {cells}  {ratios}  [{res['units']} units, {res['tokens']} tokens]")
    print("(seconds per 1,000 passage tokens)")


def profile_fuse(conditions: dict, batch: list[list[int]], repeats: int = 3) -> dict[str, float]:
    """Where a fuse's time goes, on one batch: the receiver and sharer passes once,
    then each fuser dtype on those same caches (median of `repeats`), the
    per-passage clones, and the top ops of one fuser pass per dtype."""
    fusers = {n.removeprefix("fuse_"): e.fuser for n, e in conditions.items() if n.startswith("fuse_")}
    engine = conditions[next(n for n in conditions if n.startswith("fuse_"))]
    parts = {}
    with torch.inference_mode():
        own, parts["receiver extend"] = timed(lambda: ext(engine, "receiver", batch))
        shared, parts["sharer extend"] = timed(lambda: ext(engine, "sharer", batch))
        for dtype, fuser in fusers.items():
            runs = [timed(lambda: fuser.fuse(own, shared)) for _ in range(repeats)]  # noqa: B023
            fused, parts[f"fuser {dtype}"] = runs[0][0], statistics.median(t for _, t in runs)
        parts["take (clones)"] = wall(lambda: [(fusion.take(fused, i, len(p)), fusion.take(own, i, len(p)))
                                               for i, p in enumerate(batch)])
        print(f"\n== fuse parts, batch {len(batch)} x <= {max(map(len, batch))} tokens ==")
        for part, secs in parts.items():
            print(f"{part:>24}: {secs:8.2f} s")
        for dtype, fuser in fusers.items():
            print_top_ops(lambda: fuser.fuse(own, shared), f"one fuser pass, {dtype}")  # noqa: B023
    return parts


def print_top_ops(fn, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    print(f"\n== top ops of {label} ==")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12))


def ext(engine: PassageFusion, role: str, batch: list[list[int]]):
    """The passage pass `PassageFusion.fuse` makes for one model."""
    return engine.passage_pass(role, batch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    receiver = load_causal_lm(args.receiver, device="cpu", dtype=args.dtype)
    sharer = load_causal_lm(args.sharer, device="cpu", dtype=args.dtype)
    template = PromptTemplate.for_tokenizer(receiver.tokenizer)
    passages = [template.passage_ids(t, c) for t, c in load_passages(args.data, args.n, args.seed)]
    passages = [p[: args.max_tokens or None] for p in passages]
    fusers = build_fusers(receiver, sharer, args.seed, not args.no_bf16_fuser)
    if args.fuser:  # placed as encode places it (ModelSession.fuser)
        fusers["trained"] = place_fuser(load_fuser(args.fuser), receiver.device).eval()
    conditions = build_conditions(receiver, sharer, fusers, template.prefix_ids())
    conditions = drop_failing(conditions, [passages[0][:4]])  # a short warm-up: one-time init only
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    print(f"{len(passages)} passages, {sum(map(len, passages))} tokens, threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", file=sys.stderr)
    results = {bs: measure(conditions, passages, bs, args.rounds, args.budget_s) for bs in sizes}
    print_table(results)
    parts = profile_fuse(conditions, sorted(passages, key=len, reverse=True)[: max(sizes)]) if args.profile else None
    print(json.dumps({"n": len(passages), "threads": torch.get_num_threads(), "dtype": str(receiver.dtype),
                      "max_tokens": args.max_tokens, "cpu_fast_bf16": cpu_has_fast_bf16(),
                      "results": {str(bs): r for bs, r in results.items()}, "profile_s": parts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
