
"""Encode throughput: the local runner vs the Ray runner with 1 and 2 actors, and what
encoding 1 billion tokens with Qwen3-4B -> Qwen3-0.6B would take on N H200s.

Real offline pair (receiver Qwen2.5-Coder-0.5B, sharer 1.5B) with the shipped fuser
`builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135`, N SQuAD paragraphs. Conditions,
each in a fresh process (models load in each; the order rotates every repeat):

- local:    `encode_corpus`, torch with 2 threads (the default runner)
- local-1t: the same with 1 thread (the compute one Ray actor gets)
- ray-1:    `encode_on_ray`, a local Ray runtime, 1 actor (1 CPU, 1 thread)
- ray-2:    the same with 2 actors (2 CPUs: all this machine has)

Per condition: end-to-end seconds (models load inside; Ray adds its runtime and the
actors' start-up) and steady tokens/s, measured between the end of the first round of
windows (one per actor) and the last window. Ray's overhead is shown two ways: fixed
start-up (end-to-end minus tokens / steady rate), and per-token cost at equal compute
(ray-1 vs local-1t, both one thread). With 2 cores, ray-2 can at best match local:
the local runner already uses both cores through torch's threads.

The projection: matmul FLOPs per token of the receiver, the sharer and the fuser (from
the model configs, built on torch's meta device: no weights), plus attention at the
passage length; the offline pair's FLOPs and the measured CPU rate give this machine's
achieved FLOP/s; for Qwen3-0.6B + Qwen3-4B + fuser (hidden 1024) on an H200, tokens/s
= utilisation x peak / FLOPs per token, with the H200's dense bf16 peak of 989 TFLOP/s.
Utilisation 0.4 by default (hours also shown at 0.25 and 0.6): encode is prefill only,
large batches of passages (thousands of tokens per forward) through GEMMs 1024 to 9728
wide, which cuBLAS runs at well over half of peak; the 0.6B receiver's narrow GEMMs, the
28 small per-layer fuser MLPs, attention, norms and the per-passage cache copies to the
host pull the whole below that. It is an assumption, not a measurement (no GPU here;
`gpu_encode.py` measures fuse against prefill on a GPU). The store writer's CPU cost per
token (codec, checksums, compression, shard files; measured here on the Qwen3-0.6B
geometry) gives the CPU cores a GPU node needs to keep up, and the store size follows
from bytes per token.

    python benchmarks/ray_encode.py [--n 24] [--commit-every 4] [--batch-size 4] [--repeats 1]
        [--conditions local,local-1t,ray-1,ray-2] [--max-tokens 0] [--data SQUAD_JSON]
        [--utilisation 0.4] [--gpus 1,8,64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import bench_common as bc  # first: sets OMP_WAIT_POLICY=PASSIVE before anything imports torch

FUSER = "builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135"
CONDITIONS = ("local", "local-1t", "ray-1", "ray-2")
H200_BF16_PEAK = 989.4e12  # dense bf16 tensor-core FLOP/s, H200 SXM (same tensor cores as H100 SXM; 2x with sparsity)
TOKENS_GOAL = 1e9
SENSITIVITY = (0.25, 0.6)  # the hours also shown at these utilisations
QWEN3_0_6B = {"vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072}  # the published configs
QWEN3_4B = {"vocab_size": 151936, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24, help="SQuAD paragraphs")
    ap.add_argument("--commit-every", type=int, default=4, help="passages per window (one segment, one Ray task)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--max-tokens", type=int, default=0, help="cut passages to this many words (0: whole; smoke runs)")
    ap.add_argument("--data", default=bc.SQUAD)
    ap.add_argument("--utilisation", type=float, default=0.4, help="assumed fraction of H200 bf16 peak")
    ap.add_argument("--gpus", default="1,8,64")
    ap.add_argument("--condition", help=argparse.SUPPRESS)  # internal: run one condition, print one JSON line
    ap.add_argument("--store", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------- one condition (a child process)


def passages(args):
    items, _ = bc.squad_sample(10**9, 0, path=args.data)
    items = items[: args.n]
    if args.max_tokens:
        for p in items:
            p.text = " ".join(p.text.split()[: args.max_tokens])
    return items


def run_condition(args) -> dict:
    """Encode into a fresh store; (time, tokens) at every finished window, for the steady rate."""
    import torch

    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.session import ModelChoice, ModelSession
    from cachegraft_cli.store.target import Target

    name = args.condition
    torch.set_num_threads(1 if name != "local" else 2)
    choice = ModelChoice(bc.RECEIVER, bc.SHARER, FUSER, device="cpu", dtype=bc.DTYPE)
    options = EncodeOptions(codec="bf16", batch_size=args.batch_size, commit_every=args.commit_every)
    items = passages(args)
    start = time.perf_counter()
    if name.startswith("local"):
        summary = encode_corpus(items, Target.open(args.store), ModelSession(choice), options)
        actors = 1
    else:
        from cachegraft_cli.encoding.ray.driver import RayOptions, encode_on_ray
        from cachegraft_cli.store.target import Target

        actors = int(name.split("-")[1])
        summary = encode_on_ray(items, Target.open(args.store),
                                choice, options, RayOptions(actors=actors, commit_seconds=0))
    total = time.perf_counter() - start
    return {"condition": name, "seconds": total, "tokens": summary.tokens, "passages": summary.added,
            "windows": window_marks(args.store), "actors": actors, "machine": bc.machine()}


def window_marks(url: str) -> list[tuple[float, int]]:
    """(commit time, tokens) per segment: when each window finished, in the worker that wrote it
    (the Ray driver receives results in bursts). Whole seconds: fine for windows of a minute or
    more; in smoke runs the steady rate is rough."""
    import datetime as dt

    from cachegraft_cli.store import CacheStore

    return [(dt.datetime.fromisoformat(e["committed"]).timestamp(), e["tokens"]) for e in CacheStore.open(url).segments]


def steady_rate(result: dict) -> float | None:
    """Tokens/s between the end of the first round of windows (one per actor) and the last window
    (the first round carries the start-up: model loads, Ray's runtime and actors)."""
    marks = sorted(result["windows"])
    first = result["actors"]
    if len(marks) <= first:
        return None
    span = marks[-1][0] - marks[first - 1][0]
    return sum(t for _, t in marks[first:]) / span if span > 0 else None


# ---------------------------------------------------------------- the parent


def run_child(args, condition: str, store: Path) -> dict:
    cmd = [sys.executable, __file__, "--condition", condition, "--store", str(store), "--n", str(args.n),
           "--commit-every", str(args.commit_every), "--batch-size", str(args.batch_size),
           "--max-tokens", str(args.max_tokens), "--data", args.data]
    bc.log(f"{condition}: {args.n} passages")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{condition} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_store(a: str, b: str) -> bool:
    import numpy as np

    from cachegraft_cli.store import CacheStore

    x, y = CacheStore.open(a), CacheStore.open(b)
    ids = sorted(x.ids())
    return ids == sorted(y.ids()) and all(np.array_equal(p, q) for p, q in zip(x.read(ids), y.read(ids)))


def matmul_flops(config_cls, shape: dict) -> float:
    """2 x the weights of every linear layer a passage token goes through (no LM head: encode
    keeps one logit per passage), from a model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_cls(**shape))
    return 2.0 * sum(m.weight.numel() for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"))


def attention_flops(layers: int, heads: int, head_dim: int, context: float) -> float:
    return 4.0 * layers * heads * head_dim * context  # QK^T and AV per token over `context` keys


def fuser_flops(rgeo: dict, sgeo: dict, spec: str | None = None) -> float:
    """2 x the fuser's linear weights (each projector runs once per token of its layer): the
    fuser `spec` as shipped, or a fresh one at the published width (hidden 1024) on the meta device."""
    import torch

    from cachegraft_cli.fuser import load_fuser
    from cachegraft_cli.fuser.fuser import Fuser
    from cachegraft_cli.lm.kvcache import Geometry

    if spec is not None:
        fuser = load_fuser(spec)
    else:
        with torch.device("meta"):
            fuser = Fuser.create("r", "s", Geometry(**rgeo), Geometry(**sgeo))
    return 2.0 * sum(m.weight.numel() for m in fuser.modules() if isinstance(m, torch.nn.Linear))


def _geometry(shape: dict) -> dict:
    return {"layers": shape["num_hidden_layers"], "kv_heads": shape["num_key_value_heads"],
            "head_dim": shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]}


def flops_per_token(receiver: tuple, sharer: tuple, fuser: str | None, context: float) -> dict:
    (rcls, rshape), (scls, sshape) = receiver, sharer
    geo = _geometry
    r = matmul_flops(rcls, rshape) + attention_flops(rshape["num_hidden_layers"], rshape["num_attention_heads"],
                                                     geo(rshape)["head_dim"], context)
    s = matmul_flops(scls, sshape) + attention_flops(sshape["num_hidden_layers"], sshape["num_attention_heads"],
                                                     geo(sshape)["head_dim"], context)
    f = fuser_flops(geo(rshape), geo(sshape), fuser)
    return {"receiver": r, "sharer": s, "fuser": f, "total": r + s + f, "geometry": geo(rshape)}


def offline_shapes() -> tuple[tuple, tuple]:
    from transformers import AutoConfig

    def shape(path):
        cfg = AutoConfig.from_pretrained(path)
        return type(cfg), {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                          "num_attention_heads", "num_key_value_heads",
                                                          "intermediate_size")}

    return shape(bc.RECEIVER), shape(bc.SHARER)


def writer_cost(geometry: dict, tokens: int = 2048) -> dict:
    """CPU seconds per token of the store writer (bf16 codec, default compressor, local disk)
    on synthetic bf16 caches of `geometry`; and stored bytes per token."""
    import tempfile

    import numpy as np

    from cachegraft_cli.store import CacheStore, PassageRow
    from cachegraft_cli.store.codecs import from_bf16_words, to_bf16_words

    rng = np.random.default_rng(0)
    g = geometry
    ident = {"receiver": {"name": "bench"}, "sharer": None, "fuser": None, "template": {}, "prefix_token_ids": [1],
             "position_scheme": "canonical", "dtype": "bfloat16", "codec": "bf16", "geometry": g}
    shape = (g["layers"], 2, g["kv_heads"], g["head_dim"])
    caches = [from_bf16_words(to_bf16_words(rng.normal(0, 1, (256,) + shape).astype(np.float32)))
              for _ in range(tokens // 256)]
    with tempfile.TemporaryDirectory() as tmp:
        store = CacheStore.create(f"{tmp}/s", ident, caches[0][:1])
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with store.writer() as w:
            for i, c in enumerate(caches):
                w.add(PassageRow(id=f"p{i}", text="x"), {"fused": c})
            entry = w.commit()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_s_per_token": cpu / tokens, "wall_s_per_token": wall / tokens,
            "stored_bytes_per_token": entry["bytes"]["fused"] / tokens}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.condition:
        print(json.dumps(run_condition(args)))
        return
    conditions = args.conditions.split(",")
    root = bc.WORK_DIR / "ray-encode"
    shutil.rmtree(root, ignore_errors=True)
    start_load = os.getloadavg()
    results: dict[str, list[dict]] = {c: [] for c in conditions}
    stores: dict[str, str] = {}
    for r in range(args.repeats):
        for c in bc.rotated(conditions, r):
            store = root / f"{c}-{r}"
            results[c].append(run_child(args, c, store))
            stores.setdefault(c, str(store))
    identical = {c: same_store(stores[conditions[0]], stores[c]) for c in conditions[1:]}
    report(args, results, identical, start_load)
    shutil.rmtree(root, ignore_errors=True)


def report(args, results: dict, identical: dict, start_load) -> None:
    rows, figures = [], {}
    for c, runs in results.items():
        secs = bc.median(r["seconds"] for r in runs)
        tokens = runs[0]["tokens"]
        rate = bc.median(x for x in (steady_rate(r) for r in runs) if x is not None)
        fixed = secs - tokens / rate if rate > 0 else float("nan")  # nan (no steady rate) compares False
        figures[c] = {"seconds": secs, "tokens": tokens, "end_to_end_tok_s": tokens / secs, "steady_tok_s": rate,
                      "fixed_s": fixed}
        rows.append([c, tokens, round(secs, 1), round(tokens / secs, 2), round(rate, 2), round(fixed, 1),
                     "ref" if c not in identical else ("yes" if identical[c] else "NO")])
    bc.print_table(f"encode, offline pair + {FUSER}, {args.n} paragraphs, windows of {args.commit_every}",
                   ["condition", "tokens", "end-to-end s", "end-to-end tok/s", "steady tok/s", "start-up s",
                    "same store"], rows)
    overhead = {}
    if "ray-1" in figures and "local-1t" in figures:
        overhead["per_token_ray1_vs_local1t"] = figures["local-1t"]["steady_tok_s"] / figures["ray-1"]["steady_tok_s"]
    if "ray-2" in figures and "local" in figures:
        overhead["ray2_vs_local_steady"] = figures["ray-2"]["steady_tok_s"] / figures["local"]["steady_tok_s"]
    for k, v in overhead.items():
        print(f"{k}: {v:.3f}")
    projection = project(args, figures)
    bc.emit({"benchmark": "ray_encode", "n": args.n, "conditions": figures, "identical_to_first": identical,
             "overhead": overhead, "projection": projection, "loadavg_start": start_load,
             "loadavg_end": os.getloadavg()})


def project(args, figures: dict) -> dict:
    from transformers import Qwen3Config

    mean_tokens = figures[next(iter(figures))]["tokens"] / args.n
    context = 32 + mean_tokens / 2  # prefix + half the passage, on average
    offline = flops_per_token(*offline_shapes(), FUSER, context)
    target = flops_per_token((Qwen3Config, QWEN3_0_6B), (Qwen3Config, QWEN3_4B), None, context)
    best = max((f["steady_tok_s"] for f in figures.values() if f["steady_tok_s"] == f["steady_tok_s"]), default=0)
    cpu_flops = best * offline["total"]
    per_gpu = args.utilisation * H200_BF16_PEAK / target["total"]
    writer = writer_cost(target["geometry"])
    bc.print_table("FLOPs per passage token (matmuls + attention at the mean passage length)",
                   ["pair", "receiver G", "sharer G", "fuser G", "total G"],
                   [[name, f["receiver"] / 1e9, f["sharer"] / 1e9, f["fuser"] / 1e9, f["total"] / 1e9]
                    for name, f in (("offline 0.5B+1.5B", offline), ("Qwen3-0.6B+4B, fuser 1024", target))])
    print(f"this CPU: best steady {best:.1f} tok/s x {offline['total'] / 1e9:.2f} GFLOP "
          f"= {cpu_flops / 1e9:.1f} GFLOP/s; "
          f"1e9 tokens of the offline pair here: {TOKENS_GOAL / best / 86400 / 365:.1f} years" if best else "")
    print(f"H200: {args.utilisation:.0%} of {H200_BF16_PEAK / 1e12:.0f} TFLOP/s bf16 / {target['total'] / 1e9:.2f} "
          f"GFLOP per token = {per_gpu:,.0f} tok/s per GPU")
    print(f"store writer here: {writer['cpu_s_per_token'] * 1e6:.1f} CPU-us per token "
          f"({writer['stored_bytes_per_token']:,.0f} stored B/token, bf16) -> "
          f"{per_gpu * writer['cpu_s_per_token']:.1f} "
          f"cores per GPU to keep up; 1e9 tokens = {TOKENS_GOAL * writer['stored_bytes_per_token'] / 1e12:.0f} TB "
          f"(int8 about half, int4 about a quarter)")
    rows = []
    for n in (int(x) for x in args.gpus.split(",")):
        hours = TOKENS_GOAL / (n * per_gpu) / 3600
        gbps = n * per_gpu * writer["stored_bytes_per_token"] / 1e9
        low, high = (hours * args.utilisation / u for u in SENSITIVITY)
        rows.append([n, round(hours, 2), round(hours * n, 1), f"{low:.2f}-{high:.2f}", round(gbps, 1),
                     round(n * per_gpu * writer["cpu_s_per_token"], 0)])
    bc.print_table(f"1e9 tokens, Qwen3-4B -> Qwen3-0.6B, H200 at {args.utilisation:.0%} of bf16 peak "
                   "(compute only; model load and stragglers not included)",
                   ["GPUs", "hours", "GPU-hours", f"hours at {SENSITIVITY[0]:.0%}-{SENSITIVITY[1]:.0%}",
                    "write GB/s (bf16)", "writer cores"], rows)
    return {"flops_offline": offline, "flops_target": target, "cpu_gflops": cpu_flops / 1e9, "h200_tok_s": per_gpu,
            "writer": writer, "table": rows, "utilisation": args.utilisation, "h200_peak": H200_BF16_PEAK}


if __name__ == "__main__":
    main()
