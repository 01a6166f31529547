"""Run the whole benchmark suite with small sizes and print one combined table + JSON line.

Each benchmark runs in its own process (its table goes to stdout as it
finishes); this script keeps each one's final JSON line and checks the
targets. Sizes are chosen to fit in 15 minutes on a 2-core machine, the
first run included (it encodes the small real stores and generates the
synthetic 100k-passage one, ~2.5 min in all; later runs reuse what they can);
the individual scripts take larger sizes for tighter figures.

    python benchmarks/run_all.py [--only ttft,fuse_speed,codec_quality,store_scale,ask_memory,batch] [--skip ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import bench_common as bc

HERE = Path(__file__).resolve().parent

# (key, script, small-size arguments)
SUITE = [
    ("ttft", "ttft.py", ["--questions", "3", "--repeats", "1"]),
    ("fuse_speed", "fuse_speed.py", ["--n", "4", "--batch-sizes", "4", "--no-bf16-fuser",
                                   "--fuser", "builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135"]),
    ("codec_quality", "codec_quality.py", ["--questions", "16", "--codecs", "int8,int4"]),
    ("store_scale", "store_scale.py", ["--repeats", "30", "--append-repeats", "3"]),
    ("ask_memory", "ask_memory.py", ["--repeats", "1"]),
    ("batch", "batch_throughput.py", ["--questions", "32", "--max-new-tokens", "8"]),
]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--skip", default="")
    return ap.parse_args(argv)


def run(script: str, extra: list[str]) -> tuple[dict | None, float, int]:
    """(last JSON line or None, seconds, exit code); the child's table passes through to stdout."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE / script), *extra], stdout=subprocess.PIPE, text=True)
    print(proc.stdout, end="", flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), time.perf_counter() - t0, proc.returncode


def figures(key: str, out: dict) -> list[tuple[str, float | str, str, str]]:
    """(figure, value, target, verdict) rows of one benchmark's JSON."""
    if key == "ttft":
        r = out["ratios"]
        return [("TTFT text/graft", r["text/graft"], ">= 12", _v(r["text/graft"] >= 12)),
                ("TTFT sharer-text/graft", r["sharer-text/graft"], ">= 40", _v(r["sharer-text/graft"] >= 40)),
                ("read/stored bytes (real store)", out["read_ratio_real"]["median"], "<= 1.5",
                 _v(out["read_ratio_real"]["median"] <= 1.5))]
    if key == "fuse_speed":
        rows = []
        for bs, res in out["results"].items():
            for name, value in res["ratio"].items():
                rows.append((f"fused encode / prefills {name} batch {bs}", value, "<= 1.10", _v(value <= 1.10)))
        return rows
    if key == "codec_quality":
        rows = []
        for c, t in out["targets"].items():
            ratio, drop = out["sizes"][c]["ratio"], -out["deltas"][c]["delta_pts"]
            rows.append((f"codec {c} bytes/raw bf16", ratio, f"<= {t['bytes_ratio']}", _v(ratio <= t["bytes_ratio"])))
            rows.append((f"codec {c} F1 drop (pts, {out['questions']} q)", drop, f"<= {t['f1_drop_pts']}",
                         _v(drop <= t["f1_drop_pts"])))
        return rows
    if key == "store_scale":
        r = out["ratios"]
        return [("read/stored bytes (synthetic 100k)", r["read_ratio"], "<= 1.5", _v(r["read_ratio"] <= 1.5)),
                ("ask-like latency 100k/1k", r["ask_like_big/small"], "<= 1.1",
                 _v(r["ask_like_big/small"] <= 1.1)),
                ("ask-like latency, page cache evicted before each read", r["disk_ask_like_big/small"], "<= 1.1",
                 _v(r["disk_ask_like_big/small"] <= 1.1)),
                ("append 1k: 100k/empty", r["append_big/empty"], "<= 1.1", _v(r["append_big/empty"] <= 1.1)),
                ("index update after append: 100k/empty", r["index_update_big/empty"], "-", "reported")]
    if key == "ask_memory":
        m = out["median"]
        return [(f"ask peak RSS {s} (MiB)", m[s]["ask_peak_mib"], "-", "reported") for s in m] + \
               [(f"ask memory {k}", v, "-", "reported") for k, v in out["ratios"].items()]
    if key == "batch":
        return [(f"batch {b} questions/s", v, "-", "reported") for b, v in out["qps"].items()]
    return []


def safe_figures(key: str, out: dict) -> list[tuple[str, float | str, str, str]]:
    """`figures`, or one FAILED row when a script's JSON lacks a field: a renamed
    key must not throw away a quarter of an hour of measurements."""
    try:
        return figures(key, out)
    except (KeyError, TypeError) as exc:
        return [(f"{key}: figures unreadable ({type(exc).__name__}: {exc})", "-", "-", "FAILED")]


def _v(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def main(argv=None) -> int:
    args = parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    skip = set(filter(None, args.skip.split(",")))
    results, rows, seconds = {}, [], {}
    for key, script, extra in SUITE:
        if (only and key not in only) or key in skip:
            continue
        if not (HERE / script).exists():
            rows.append((f"{key}: {script}", "missing", "-", "not run"))
            continue
        bc.log(f"running {script} {' '.join(extra)}")
        out, seconds[key], rc = run(script, extra)
        results[key] = out
        if rc or out is None:
            rows.append((f"{key}: {script}", f"exit {rc}", "-", "FAILED"))
            continue
        rows += safe_figures(key, out)
    total = round(sum(seconds.values()))
    per_bench = {k: round(v) for k, v in seconds.items()}
    bc.print_table(f"CacheGraft benchmark suite ({total} s; per benchmark: {per_bench})",
                   ["figure", "value", "target", "verdict"], [list(r) for r in rows])
    figures = [{"figure": f, "value": v, "target": t, "verdict": d} for f, v, t, d in rows]
    bc.emit({"bench": "run_all", "figures": figures,
             "seconds": seconds, "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
