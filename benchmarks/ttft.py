"""Time to first token at k passages, graft vs text vs sharer-text (real offline pair).

Builds (once, reused later) a store of N SQuAD paragraphs encoded by the real
receiver with the closed fuser (`--fuser random`: the real pair and a
random-initialised fuser with open gates; `graft`'s ask path and timing are
the same either way, since it reads caches of the same geometry and codec and
never runs the sharer), then asks questions about those paragraphs with each
system. Conditions are interleaved: every (repeat,
question) runs all systems back to back, the order rotating each time.
`first_token` (Asker timings) runs from the start of the request - retrieval
and cache loading included - to the first generated token.

`graft` runs with the library's default assembly (best passage last, no
boundary recompute); `--variants` adds graft under other assemblies side by
side (default: `recompute=0`, which repeats the default, and `blend=0.15`,
selective recompute; e.g. `recompute=16` times boundary recompute), so what
recompute costs shows in the same run. The text/graft target is checked on
the default `graft`.

Also records the store-scale benchmark's "bytes read by one ask / stored bytes of its k passages"
on this real store (graft asks).

`--compare LABEL=STORE,...` times graft from other stores of the same passages (another
codec, a pruned store) side by side, as `graft[LABEL]`, in the same rotation.

    python benchmarks/ttft.py [--passages 20] [--questions 6] [--repeats 2] [--k 5] [--fuser closed|random]
        [--variants recompute=0,blend=0.15] [--store DIR] [--compare k2v4=DIR2,keep0.5=DIR3]
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
    ap.add_argument("--store", default=None, help="use this existing store (e.g. one codec_quality.py made)")
    ap.add_argument("--compare", default="", help="comma list LABEL=STORE: graft from these stores of the same "
                    "passages, timed beside the main store's")
    ap.add_argument("--variants", default="recompute=0,blend=0.15",
                    help="comma list of graft assemblies timed beside the default (key=value[+key=value])")
    return ap.parse_args(argv)


def conditions(k: int, variants: str) -> dict:
    """{label: AskOptions}: the systems at the library defaults, plus graft variants `graft@key=value...`."""
    from cachegraft_cli.answering.ask import AskOptions
    from cachegraft_cli.evaluation.variants import parse_variant
    from cachegraft_cli.lm.generation import GenerationOptions

    labels = list(SYSTEMS) + ["graft@" + v.replace("+", "@") for v in variants.split(",") if v.strip()]
    out = {}
    for label in labels:
        variant = parse_variant(label)
        out[label] = AskOptions(variant.system, k, generation=GenerationOptions(max_new_tokens=1), **variant.overrides)
    return out


def compared(asker, spec: str) -> tuple[dict, dict]:
    """({label: Asker}, {label: AskOptions}) of `--compare`'s stores: graft at the main graft's options,
    sharing the main asker's loaded models."""
    from cachegraft_cli.answering.ask import Asker

    askers, options = {}, {}
    for item in filter(None, spec.split(",")):
        name, _, url = item.partition("=")
        label = f"graft[{name}]"
        askers[label] = Asker(url, session=asker.session)
        options[label] = None
    return askers, options


def measure(asker, questions, options: dict, repeats: int, others: dict | None = None) -> tuple[dict, list[float]]:
    """{label: [timings dict, ...]} over repeats x questions, conditions rotated; plus graft read ratios.
    `others`: {label: Asker} answering graft (at options["graft"]) from other stores."""
    others = others or {}
    out = {s: [] for s in options}
    ratios = []
    turn = 0
    for r in range(repeats):
        for q in questions:
            for system in bc.rotated(list(options), turn):
                before = asker.store.stats.bytes
                who, how = (others[system], options["graft"]) if system in others else (asker, options[system])
                res = who.ask(q.question, how)
                out[system].append(res["timings"] | {"prompt_tokens": res["tokens"]["prompt"],
                                                     "recomputed": res["tokens"]["recomputed"]})
                if system == "graft":
                    ids = [p["id"] for p in res["passages"]]
                    ratios.append((asker.store.stats.bytes - before) / bc.stored_bytes(asker.store, ids))
            turn += 1
        bc.log(f"repeat {r + 1}/{repeats} done")
    return out, ratios


def summarise(runs: dict) -> dict:
    keys = ("retrieve", "load", "prefill", "first_token", "prompt_tokens", "recomputed")
    return {s: {key: bc.median(t[key] for t in ts) for key in keys} for s, ts in runs.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    from cachegraft_cli.answering.ask import Asker

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
    options = conditions(args.k, args.variants)
    others, extra = compared(asker, args.compare)
    options.update(extra)
    for other in others.values():
        other.warm("graft")
    runs, read_ratios = measure(asker, questions, options, args.repeats, others)
    med = summarise(runs)
    ttft = {s: med[s]["first_token"] for s in options}
    ratios = {f"{s}/graft": ttft[s] / ttft["graft"] for s in SYSTEMS if s != "graft"}
    variants = {f"text/{s}": ttft["text"] / ttft[s] for s in options if s.startswith(("graft@", "graft["))}
    rows = [[s, med[s]["prompt_tokens"], med[s]["recomputed"], med[s]["retrieve"], med[s]["load"], med[s]["prefill"],
             ttft[s]] for s in options]
    bc.print_table(f"Time to first token, k={args.k}, "
                   f"median of {len(questions)} questions x {args.repeats} repeats (s)",
                   ["system", "question_tok", "recomputed_tok", "retrieve", "load", "prefill", "first_token"], rows)
    for name, value in ratios.items():
        print(f"{name}: {value:.1f}x  -> {bc.verdict(value, TARGETS[name], at_most=False)}")
    for name, value in variants.items():
        print(f"{name}: {value:.1f}x (floor for a default: 6x)")
    read = bc.median(read_ratios)
    print(f"Real store: bytes read by one graft ask / stored bytes of its k passages: median {read:.3f}, "
          f"max {max(read_ratios):.3f} -> {bc.verdict(read, 1.5)}")
    print(f"machine at start: {start_machine}; at end: loadavg {bc.machine()['loadavg']}")
    bc.emit({"bench": "ttft", "k": args.k, "questions": len(questions), "repeats": args.repeats,
             "passages": len(passages), "median": med, "ratios": ratios, "variant_ratios": variants, "targets": TARGETS,
             "read_ratio_real": {"median": read, "max": max(read_ratios)},
             "machine_start": start_machine, "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
