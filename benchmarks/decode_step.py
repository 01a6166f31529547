"""The receiver's decode step on CPU: where its time goes, and what each lever buys (real model).

One model load, then copies of it, each with a lever more, timed side by side and interleaved
(a variant that differs from another only in its step, `X-hf`, shares that one's copy):

- `before`: transformers' own SDPA attention (one-token GQA through `enable_gqa`) and its
  concatenating `DynamicCache`, as CacheGraft 0.2.0 decoded;
- `gqa`: one-token GQA packed per KV head (`cachegraft_cli/lm/gqa.py`), concatenating cache;
- `as-loaded`: what `load_causal_lm` and `generate` give now: packed GQA and the growing decode
  cache (`kvcache.to_decode_cache`);
- `int8`, `int4`: the same with weight-only int8 / int4 linears (`--weights`, `lm/weights.py`);
- `int8-f32`, `int4-f32`: a float32 model's decode steps fed to those kernels in float32, as
  before 2026-12-07 (they now enter in bf16: the kernels' float32 path is a scalar loop);
- `hf`, `int8-hf`, `int4-hf`: `as-loaded`, `int8`, `int4` with every step through transformers'
  forward instead of the lean step (`cachegraft_cli/lm/decoder.py`), as before 2026-12-07.
  `before`, `gqa` and the `-f32` variants step through transformers' forward too.

Each variant reads the same prompt (README text as a stand-in for retrieved passages, at each
--context length), then decodes --steps tokens one at a time as `generate` does; the median
step time is reported. A torch profile of each variant splits the step into its linears,
attention, KV-cache concatenation, other ops, and the Python between them (wall minus ops).

    python benchmarks/decode_step.py [--context 150,700] [--steps 32] [--rounds 3]
                                     [--variants before,gqa,hf,as-loaded,int8-hf,int8,int4-hf,int4,...]
                                     [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time

import bench_common as bc

GROUPS = {"linear": ("mm", "addmm", "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_linear_pointwise"),
          "attention": ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math", "bmm"),
          "cache cat": ("cat",)}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="150,700", help="prompt tokens before decoding (comma list)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="hf,as-loaded,int8-hf,int8,int4-hf,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true")
    return ap.parse_args(argv)


def variants(lm, names: list[str]) -> dict:
    """name -> (LoadedModel, its lean `Decoder` or None for transformers' forward, seconds its
    conversion took). `hf` and `X-hf` share the model of `as-loaded` and `X`: the same weights at
    the same addresses, so only the step differs (separate copies alone moved a variant by up to
    10% between runs on a 2-core VM)."""
    from dataclasses import replace

    from cachegraft_cli.lm import decoder
    from cachegraft_cli.lm.weights import quantize_linears

    copies: dict = {}
    out = {}
    for name in names:
        scheme, _, suffix = name.partition("-")
        base = "as-loaded" if name == "hf" else scheme if suffix == "hf" else name
        if base not in copies:
            model = copy.deepcopy(lm.model)
            t0 = time.perf_counter()
            if name == "before":
                model.set_attn_implementation("sdpa")
            elif scheme in ("int8", "int4"):
                quantize_linears(model, scheme)
                if suffix == "f32":
                    float32_kernels(model)
            copies[base] = (replace(lm, model=model), time.perf_counter() - t0)
        loaded, seconds = copies[base]
        forward = name in ("before", "gqa", "hf") or suffix in ("hf", "f32")
        out[name] = (loaded, None if forward else decoder.for_model(loaded.model), seconds)
    return out


def float32_kernels(model) -> None:
    """Feed `model`'s quantised kernels the activations in float32 (how they ran before bf16)."""
    import torch

    from cachegraft_cli.lm.weights import QuantisedLinear

    for layer in model.modules():
        if isinstance(layer, QuantisedLinear) and layer.dense.weight.dtype == torch.float32:
            layer.kernel_dtype = torch.float32
            for name in ("scales", "scales_zeros"):
                if hasattr(layer, name):
                    setattr(layer, name, getattr(layer, name).float())


@contextlib.contextmanager
def cache_of(variant: str):
    """`before` and `gqa` decode into transformers' concatenating cache, the others into ours."""
    from cachegraft_cli.lm import kvcache

    real = kvcache.to_decode_cache
    if variant in ("before", "gqa"):
        kvcache.to_decode_cache = lambda kv, config: kvcache.to_model_cache(kv, config) if kv else None
    try:
        yield
    finally:
        kvcache.to_decode_cache = real


def use(lm, lean) -> None:
    """Step `lm` with `lean` (a Decoder), or with transformers' forward (None)."""
    from cachegraft_cli.lm import decoder

    setattr(lm.model, decoder.ATTRIBUTE, lean)


def steps(lm, lean, ids: list[int], n: int, variant: str) -> list[float]:
    """Seconds of each of `n` one-token decode steps after reading `ids`."""
    import torch

    from cachegraft_cli.lm.generation import Prompt, Stepper

    use(lm, lean)
    times = []
    with torch.inference_mode(), cache_of(variant):
        step = Stepper(lm, Prompt.plain(None, ids, 0))
        step.first()
        for i in range(n):
            t0 = time.perf_counter()
            step([1000 + i])
            times.append(time.perf_counter() - t0)
    return times


def profile(lm, lean, ids: list[int], n: int, variant: str) -> dict:
    """Milliseconds per step by op group, and the Python between ops (wall minus ops)."""
    import torch
    from torch.profiler import profile as torch_profile

    from cachegraft_cli.lm.generation import Prompt, Stepper

    use(lm, lean)
    with torch.inference_mode(), cache_of(variant):
        step = Stepper(lm, Prompt.plain(None, ids, 0))
        step.first()
        with torch_profile() as prof:
            t0 = time.perf_counter()
            for i in range(n):
                step([1000 + i])
            wall = time.perf_counter() - t0
    out = dict.fromkeys([*GROUPS, "other ops"], 0.0)
    total = 0.0
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / n
        total += ms
        group = next((g for g, ops in GROUPS.items() if event.key.split("::")[-1] in ops), "other ops")
        out[group] += ms
    out["python"] = max(wall * 1e3 / n - total, 0.0)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    from cachegraft_cli.lm.models import load_causal_lm

    start = bc.machine()
    lm = load_causal_lm(bc.RECEIVER, dtype=bc.DTYPE)
    names = [v for v in args.variants.split(",") if v]
    models = variants(lm, names)
    text = (bc.REPO / "README.md").read_text()
    contexts = [int(c) for c in args.context.split(",")]
    all_ids = lm.tokenizer(text)["input_ids"]
    timings: dict = {(v, c): [] for v in names for c in contexts}
    for _ in range(args.rounds):
        for c in contexts:
            for v in names:  # interleaved: every variant sees the same machine state
                timings[(v, c)] += steps(models[v][0], models[v][1], all_ids[:c], args.steps, v)
    rows, figures = [], {}
    for c in contexts:
        base = statistics.median(timings[(names[0], c)])
        for v in names:
            ms = statistics.median(timings[(v, c)]) * 1e3
            figures[f"{v}@{c}"] = {"step_ms": ms, "tokens_per_s": 1e3 / ms, "convert_s": models[v][2]}
            rows.append([c, v, f"{ms:.1f}", f"{1e3 / ms:.1f}", f"{base * 1e3 / ms:.2f}x", f"{models[v][2]:.1f}"])
    bc.print_table(f"Decode step, median of {args.rounds} x {args.steps} steps, {lm.dtype}, {args.threads} threads",
                   ["context", "variant", "ms/step", "tok/s", f"vs {names[0]}", "convert s"], rows)
    if not args.no_profile:
        prof_rows = []
        for v in names:
            split = profile(models[v][0], models[v][1], all_ids[: contexts[-1]], args.steps, v)
            figures[f"{v}@{contexts[-1]}"]["profile_ms"] = split
            prof_rows.append([v, *(f"{split[g]:.1f}" for g in split)])
        bc.print_table(f"Where a step goes at context {contexts[-1]} (ms/step, under the profiler)",
                       ["variant", *GROUPS, "other ops", "python"], prof_rows)
    print(f"machine at start: {start}; at end: loadavg {bc.machine()['loadavg']}")
    bc.emit({"bench": "decode_step", "dtype": str(lm.dtype), "figures": figures, "machine_start": start,
             "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
