"""GPU encode throughput of `PassageFusion.fuse` vs. the receiver's and sharer's own prefill.

Self-contained: Qwen3-0.6B-shaped receiver and Qwen3-4B-shaped sharer with
random weights (built from configs on the device, bf16, nothing downloaded),
a random fuser (default hidden 1024, bf16, gates open), random token passages.
Both models get the same stub tokenizer object, so the aligner is the identity.

Per batch size it times, interleaved (the order rotates every repeat):
receiver prefill, sharer prefill, full fuse, and the fuser alone on
precomputed caches; each after a warm-up pass, with the device synchronised
around every timing. Fused throughput is reported as a fraction of
1/(1/r + 1/s): the throughput of running receiver and sharer back to back,
the best a fuse (which must run both) can hope for without the fuser's cost.
By matmul FLOPs per token (receiver 0.88 G, sharer 7.27 G, fuser at hidden
1024: 1.06 G) a compute-bound fuse reaches about 0.88 of it; lower means
overhead (small kernels, casts, per-passage clones): `fuser_only` isolates
the fuser's part.
One table, then one JSON line.

    python benchmarks/gpu_encode.py [--n 32] [--tokens 256] [--batch-sizes 8,32] [--repeats 3]
    python benchmarks/gpu_encode.py --tiny     # tiny shapes on CPU: a smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch

from cachegraft_cli.fuser.fuser import Fuser
from cachegraft_cli.fuser.fusion import PassageFusion
from cachegraft_cli.lm.models import LoadedModel

VOCAB = 151936
RECEIVER_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, intermediate_size=3072)
SHARER_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, intermediate_size=9728)
TINY_RECEIVER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, intermediate_size=128)
TINY_SHARER = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=160)


@dataclass
class StubTokenizer:
    """All PassageFusion needs of a tokenizer when both models share one: a pad id,
    and a vocabulary that compares equal (so `align.same_vocabulary` holds)."""

    pad_token_id: int = 0

    def get_vocab(self) -> dict:
        return {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32, help="passages")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per passage")
    ap.add_argument("--prefix-tokens", type=int, default=32, help="shared prefix (chat start + instruction)")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the passages per condition")
    ap.add_argument("--fuser-hidden", type=int, default=1024)
    ap.add_argument("--target", type=float, default=0.7, help="wanted fuse / (1/(1/r + 1/s))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.n, args.tokens, args.prefix_tokens, args.batch_sizes, args.repeats = 4, 16, 8, "2,4", 1
        args.fuser_hidden = 64
    return args


def build_model(shape: dict, vocab: int, device: str, dtype: torch.dtype, name: str) -> LoadedModel:
    """A random-weight Qwen3 of the given shape, initialised directly on the device."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=40960,
                         rope_theta=1000000.0, **shape)
    with torch.device(device):  # init on the GPU: building a 4B model on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return LoadedModel(name, model.eval(), StubTokenizer())


def build_fuser(receiver: LoadedModel, sharer: LoadedModel, hidden: int, device: str, dtype: torch.dtype) -> Fuser:
    fuser = Fuser.create(receiver.spec, sharer.spec, receiver.geometry, sharer.geometry,
                         hidden_dim=hidden, intermediate_dim=hidden, dtype=str(dtype).removeprefix("torch."))
    # Not `fuser.to(device)`: `Fuser._apply` (its fusing helper) shadows the
    # `nn.Module._apply` that `.to()` relies on, so move the projectors instead.
    fuser.projectors.to(device)
    fuser.set_gates(1.0)  # positive logits: hard gates open
    return fuser.eval()  # a fresh module is in training mode (Gumbel gates, dropout)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def conditions_for(receiver, sharer, fuser, prefix: list[int], batches: list) -> dict:
    """Condition name -> callable running it over all batches."""
    engines = {
        "receiver": PassageFusion(receiver, prefix),
        "sharer": PassageFusion(sharer, prefix),
        "fuse": PassageFusion(receiver, prefix, sharer, fuser),
    }
    conds = {name: (lambda e=e: [e.fuse(b) for b in batches]) for name, e in engines.items()}
    conds["fuser_only"] = fuser_only(engines["fuse"], batches)
    return conds


def fuser_only(engine: PassageFusion, batches: list):
    """The fuser's share of a fuse: `Fuser.fuse` on caches computed once up front."""
    with torch.inference_mode():
        inputs = [(engine.passage_pass("receiver", b), engine.passage_pass("sharer", b)) for b in batches]

    @torch.inference_mode()
    def run():
        return [engine.fuser.fuse(own, shared) for own, shared in inputs]

    return run


def measure(conds: dict, repeats: int, device: str) -> dict[str, float]:
    """Mean seconds per pass for each condition after one warm-up pass each."""
    names = list(conds)
    for name in names:
        timed(conds[name], device)
    totals = dict.fromkeys(names, 0.0)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            totals[name] += timed(conds[name], device)
    return {name: secs / repeats for name, secs in totals.items()}


def summarise(seconds: dict[str, float], tokens: int, target: float) -> dict:
    tps = {name: tokens / s for name, s in seconds.items()}
    both = 1 / (1 / tps["receiver"] + 1 / tps["sharer"])
    frac = tps["fuse"] / both
    return {"tokens_per_s": tps, "receiver_then_sharer_tps": both, "fuse_fraction": frac,
            "fuser_share_of_fuse_time": seconds["fuser_only"] / seconds["fuse"], "meets_target": frac >= target}


def print_table(results: dict[int, dict], target: float) -> None:
    cols = ["receiver", "sharer", "fuse", "fuser_only"]
    head = "  ".join(f"{c:>11}" for c in cols)
    print(f"{'batch':>5}  {head}  {'1/(1/r+1/s)':>11}  fraction (target {target})")
    for bs, res in results.items():
        cells = "  ".join(f"{res['tokens_per_s'][c]:11.0f}" for c in cols)
        mark = "ok" if res["meets_target"] else "BELOW"
        print(f"{bs:>5}  {cells}  {res['receiver_then_sharer_tps']:11.0f}  {res['fuse_fraction']:.3f} {mark}")
    print("(passage tokens per second)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    dtype, vocab = torch.bfloat16, 512 if args.tiny else VOCAB
    torch.manual_seed(args.seed)
    receiver = build_model(TINY_RECEIVER if args.tiny else RECEIVER_0_6B, vocab, device, dtype, "qwen3-0.6b-shape")
    sharer = build_model(TINY_SHARER if args.tiny else SHARER_4B, vocab, device, dtype, "qwen3-4b-shape")
    fuser = build_fuser(receiver, sharer, args.fuser_hidden, device, dtype)
    prefix = torch.randint(1, vocab, (args.prefix_tokens,)).tolist()
    passages = torch.randint(1, vocab, (args.n, args.tokens)).tolist()
    results = {}
    for bs in (int(s) for s in args.batch_sizes.split(",")):
        batches = [passages[i : i + bs] for i in range(0, len(passages), bs)]
        seconds = measure(conditions_for(receiver, sharer, fuser, prefix, batches), args.repeats, device)
        results[bs] = summarise(seconds, args.n * args.tokens, args.target)
    print_table(results, args.target)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tiny": args.tiny,
                      "n": args.n, "tokens": args.tokens, "fuser_hidden": args.fuser_hidden, "peak_gib": peak,
                      "target": args.target, "results": {str(bs): r for bs, r in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
