"""P1: time to first token at k passages, graft vs text vs sharer-text (real offline pair).

Builds (once, reused later) a store of N SQuAD paragraphs encoded by the real
receiver with the closed fuser (`--fuser random`: the real pair and a
random-initialised fuser with open gates; `graft`'s ask path and timing are
the same either way, since it reads caches of the same geometry and codec and
never runs the sharer), then asks questions about those paragraphs with each
system. Conditions are interleaved: every (repeat,
question) runs all systems back to back, the order rotating each time.
`first_token` (Asker timings) runs from the start of the request - retrieval
and cache loading included - to the first generated token.

Also records P4's "bytes read by one ask / stored bytes of its k passages"
on this real store (graft asks).

    python benchmarks/p1_ttft.py [--passages 20] [--questions 6] [--repeats 2] [--k 5] [--fuser closed|random]
"""

from __future__ import annotations

import argparse
import sys

import bench_common as bc

SYSTEMS = ("graft", "text", "sharer-text")
TARGETS = {"text/graft": 12.0, "sharer-text/graft": 40.0}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passages", type=int, default=bc.REAL_PASSAGES)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fuser", default=bc.REAL_FUSER, help="closed: the receiver's own caches | random: the pair "
                    "with a random open fuser (slower to encode); graft's ask path is the same")
    ap.add_argument("--store", default=None, help="use this existing store (e.g. one p3_codecs.py made)")
    return ap.parse_args(argv)


def measure(asker, questions, k: int, repeats: int) -> tuple[dict, list[float]]:
    """{system: [timings dict, ...]} over repeats x questions, systems rotated; plus graft read ratios."""
    from cachegraft_cli.ask import AskOptions
    from cachegraft_cli.generation import GenerationConfig

    options = {s: AskOptions(s, k, generation=GenerationConfig(max_new_tokens=1)) for s in SYSTEMS}
    out = {s: [] for s in SYSTEMS}
    ratios = []
    turn = 0
    for r in range(repeats):
        for q in questions:
            for system in bc.rotated(list(SYSTEMS), turn):
                before = asker.store.stats.bytes
                res = asker.ask(q.question, options[system])
                out[system].append(res["timings"] | {"prompt_tokens": res["tokens"]["prompt"]})
                if system == "graft":
                    ids = [p["id"] for p in res["passages"]]
                    ratios.append((asker.store.stats.bytes - before) / bc.stored_bytes(asker.store, ids))
            turn += 1
        bc.log(f"repeat {r + 1}/{repeats} done")
    return out, ratios


def summarise(runs: dict) -> dict:
    keys = ("retrieve", "load", "prefill", "first_token", "prompt_tokens")
    return {s: {key: bc.median(t[key] for t in ts) for key in keys} for s, ts in runs.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    from cachegraft_cli.ask import Asker

    if args.store:  # the models the store names (e.g. `pulled:` ones), never the fuser: asking needs none
        url, session = args.store, None
        passages, questions = bc.store_data(url)
    else:
        url, session, passages, questions = bc.real_store(args.passages, args.seed, args.fuser)
    questions = questions[: args.questions]
    asker = Asker(url, session=session)
    for s in SYSTEMS:
        asker.warm(s)
    start_machine = bc.machine()
    runs, read_ratios = measure(asker, questions, args.k, args.repeats)
    med = summarise(runs)
    ttft = {s: med[s]["first_token"] for s in SYSTEMS}
    ratios = {f"{s}/graft": ttft[s] / ttft["graft"] for s in SYSTEMS if s != "graft"}
    rows = [[s, med[s]["prompt_tokens"], med[s]["retrieve"], med[s]["load"], med[s]["prefill"], ttft[s]] for s in SYSTEMS]
    bc.print_table(f"P1 time to first token, k={args.k}, median of {len(questions)} questions x {args.repeats} repeats (s)",
                   ["system", "prompt_tok", "retrieve", "load", "prefill", "first_token"], rows)
    for name, value in ratios.items():
        print(f"{name}: {value:.1f}x  -> {bc.verdict(value, TARGETS[name], at_most=False)}")
    read = bc.median(read_ratios)
    print(f"P4a (real store) bytes read by one graft ask / stored bytes of its k passages: median {read:.3f}, "
          f"max {max(read_ratios):.3f} -> {bc.verdict(read, 1.5)}")
    print(f"machine at start: {start_machine}; at end: loadavg {bc.machine()['loadavg']}")
    bc.emit({"bench": "p1_ttft", "k": args.k, "questions": len(questions), "repeats": args.repeats,
             "passages": len(passages), "median": med, "ratios": ratios, "targets": TARGETS,
             "p4_read_ratio_real": {"median": read, "max": max(read_ratios)},
             "machine_start": start_machine, "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
