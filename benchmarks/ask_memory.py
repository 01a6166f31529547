"""Peak memory of one ask, graft vs text (receiver only), each in a fresh process.

Every measurement is a new Python process (so nothing is shared or cached):
it opens the shared real-pair store (see ttft.py; built if missing),
loads the receiver and the index (`Asker.warm`), then answers one question.
It reports, from /proc/self/status:
- load peak: VmHWM after loading (models, index, store);
- ask peak: VmHWM of the ask alone (the high-water mark is reset through
  /proc/self/clear_refs just before asking), and the ask's increment over the
  RSS it started from;
and the parent cross-checks the process peak with os.wait4's ru_maxrss.
Processes for the two systems alternate (graft, text, graft, text, ...).

    python benchmarks/ask_memory.py [--repeats 2] [--k 5] [--passages 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import bench_common as bc

SYSTEMS = ("graft", "text")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--passages", type=int, default=bc.REAL_PASSAGES)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--use-store", default=None,
                    help="use this existing store of SQuAD paragraphs (e.g. one codec_quality.py made)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--question", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(args) -> int:
    """One ask in this (fresh) process; prints one JSON line of memory figures (MiB)."""
    bc.set_threads(args.threads)
    from cachegraft_cli.answering.ask import Asker, AskOptions
    from cachegraft_cli.lm.generation import GenerationOptions

    asker = Asker(args.store)
    asker.warm(args.child)
    load_peak, before = status_kb("VmHWM"), status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak RSS to the current RSS
        fh.write("5")
    res = asker.ask(args.question, AskOptions(args.child, args.k, generation=GenerationOptions(args.max_new_tokens)))
    ask_peak = status_kb("VmHWM")
    print(json.dumps({"system": args.child, "load_peak_mib": load_peak / 1024, "rss_before_ask_mib": before / 1024,
                      "ask_peak_mib": ask_peak / 1024, "ask_increment_mib": (ask_peak - before) / 1024,
                      "prompt_tokens": res["tokens"]["prompt"], "first_token_s": res["timings"]["first_token"]}))
    return 0


def run_child(system: str, store: str, question: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", system, "--store", store, "--question", question,
           "--k", str(args.k), "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{system} child failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1]) | {"ru_maxrss_mib": usage.ru_maxrss / 1024}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    url = args.use_store or bc.real_store_url(args.passages, args.seed)
    _, questions = bc.store_data(url) if args.use_store else bc.real_data(args.passages, args.seed)
    if not os.path.exists(url):
        bc.real_store(args.passages, args.seed)
    start_machine = bc.machine()
    runs = {s: [] for s in SYSTEMS}
    for r in range(args.repeats):
        for system in bc.rotated(list(SYSTEMS), r):
            runs[system].append(run_child(system, url, questions[r % len(questions)].question, args))
            bc.log(f"{system}: {runs[system][-1]}")
    keys = ("load_peak_mib", "rss_before_ask_mib", "ask_peak_mib", "ask_increment_mib", "ru_maxrss_mib",
            "prompt_tokens")
    med = {s: {k: bc.median(x[k] for x in rs) for k in keys} for s, rs in runs.items()}
    bc.print_table(f"Memory of one ask, k={args.k}, receiver only, fresh process each, "
                   f"median of {args.repeats} (MiB)",
                   ["system", *keys], [[s, *(med[s][k] for k in keys)] for s in SYSTEMS])
    ratio = {"ask_peak graft/text": med["graft"]["ask_peak_mib"] / med["text"]["ask_peak_mib"],
             "ask_increment graft/text":
                 med["graft"]["ask_increment_mib"] / max(med["text"]["ask_increment_mib"], 1e-9),
             "process_peak graft/text": med["graft"]["ru_maxrss_mib"] / med["text"]["ru_maxrss_mib"]}
    for name, value in ratio.items():
        print(f"{name}: {value:.3f} (reported; no target)")
    print(f"machine at start: {start_machine}; loadavg at end {bc.machine()['loadavg']}")
    bc.emit({"bench": "ask_memory", "k": args.k, "median": med, "ratios": ratio, "runs": runs,
             "machine_start": start_machine, "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
