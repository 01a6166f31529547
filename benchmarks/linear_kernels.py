"""float32 CPU linear layers: torch's default path vs oneDNN (cachegraft_cli/lm/onednn.py).

Times `F.linear` and `OneDnnLinear` side by side, interleaved, at the row
counts that matter (1: decoding a token; ~20: a question's prefill; 128-700:
passages and a text prompt) for the receiver's layer shapes (Qwen2.5-0.5B:
hidden 896, MLP 4864, 2 KV heads x 64), then one forward of the real receiver
over a question-sized and a prompt-sized input with each path.

    python benchmarks/linear_kernels.py [--rows 1,21,128,700] [--repeats 20] [--no-model]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import bench_common as bc

SHAPES = {"q/o 896x896": (896, 896), "k/v 896x128": (896, 128), "gate/up 896x4864": (896, 4864),
          "down 4864x896": (4864, 896)}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,21,128,700")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-model", action="store_true", help="skip the real receiver's forwards")
    return ap.parse_args(argv)


def timed(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def layer_rows(rows: list[int], repeats: int) -> list[list]:
    import torch

    from cachegraft_cli.lm.onednn import route_linears

    out = []
    for name, (fan_in, fan_out) in SHAPES.items():
        plain = torch.nn.Linear(fan_in, fan_out, bias=False)
        routed = torch.nn.Linear(fan_in, fan_out, bias=False)
        routed.load_state_dict(plain.state_dict())
        route_linears(routed, min_weights=0)
        for m in rows:
            x = torch.randn(m, fan_in)
            with torch.inference_mode():
                t = {"torch": [], "onednn": []}
                for r in range(3):  # interleaved, order rotating
                    for key in bc.rotated(list(t), r):
                        layer = plain if key == "torch" else routed
                        t[key].append(timed(functools.partial(layer, x), repeats))
            a, b = bc.median(t["torch"]), bc.median(t["onednn"])
            out.append([name, m, a * 1e3, b * 1e3, a / b])
    return out


def model_rows(lengths=(21, 700)) -> list[list]:
    import torch

    from cachegraft_cli.lm.models import load_causal_lm
    from cachegraft_cli.lm.onednn import OneDnnLinear

    model = load_causal_lm(bc.RECEIVER, device="cpu", dtype="float32").model
    routed = [m for m in model.modules() if type(m) is OneDnnLinear]
    out = []
    for n in lengths:
        ids = torch.randint(100, 10_000, (1, n))
        t = {"torch": [], "onednn": []}
        with torch.inference_mode():
            for r in range(3):
                for key in bc.rotated(list(t), r):
                    for m in routed:
                        m.__class__ = torch.nn.Linear if key == "torch" else OneDnnLinear
                    t[key].append(timed(functools.partial(model, ids, logits_to_keep=1), 1))
        a, b = bc.median(t["torch"]), bc.median(t["onednn"])
        out.append([f"receiver forward ({len(routed)} linears)", n, a * 1e3, b * 1e3, a / b])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    from cachegraft_cli.lm import onednn

    if not onednn.available():
        print("oneDNN linear is not available in this torch build (or CACHEGRAFT_ONEDNN_LINEAR=0)")
        return 1
    start = bc.machine()
    rows = layer_rows([int(r) for r in args.rows.split(",")], args.repeats)
    if not args.no_model:
        rows += model_rows()
    bc.print_table("float32 linear on CPU: torch default vs oneDNN (median of 3 interleaved rounds)",
                   ["layer", "rows", "torch_ms", "onednn_ms", "speed-up"], rows)
    print(f"machine at start {start}; loadavg at end {bc.machine()['loadavg']}")
    bc.emit({"bench": "linear_kernels", "rows": [dict(zip(["layer", "rows", "torch_ms", "onednn_ms", "speedup"], r))
                                                 for r in rows], "machine_start": start, "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
