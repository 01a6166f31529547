"""Copied drafts (`lm/drafting.py`) against one token per step, side by side: the same answers,
how much faster.

The questions and stores are `peer_llamacpp.py`'s (int8 stores of the three QA sets' paragraphs,
`codec_fidelity.py`'s, built here if absent). Each question is answered twice per system and k,
in turn (the order rotating): greedy with each `draft_tokens` setting of `--drafts` (the default's
against 0, one token per step), through the library as `cachegraft ask` and a lone `serve`
request run it.

Reported per system, k and setting: how many answers are the last setting's, EM/F1,
decode tokens/s (tokens after the first over the time after it, summed over answers), the
whole answer (p50), and forwards per answer after the first token (counted at
`generation.row_step`) with the drafted tokens they kept.

    python benchmarks/copy_drafts.py [--per-set 20] [--k 1,3,5] [--systems graft,text]
        [--drafts 3,2,0] [--weights as-loaded|int8|int4] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
from types import SimpleNamespace

import bench_common as bc

from cachegraft_cli.lm.drafting import DRAFT_TOKENS


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-set", type=int, default=20, help="questions from each of the three sets")
    ap.add_argument("--k", default="1,3,5")
    ap.add_argument("--systems", default="graft,text")
    ap.add_argument("--drafts", default=f"{DRAFT_TOKENS},0",
                    help="draft_tokens settings compared (the first against the last; 0: one token per step)")
    ap.add_argument("--weights", default="as-loaded", help="as-loaded, int8 or int4 (`ask --weights`)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every answer here")
    return ap.parse_args(argv)


class Counter:
    """Forwards after the first token and the tokens each fed, counted at `generation.row_step`."""

    def __init__(self):
        from cachegraft_cli.lm import generation

        self.real = generation.row_step
        self.forwards = self.fed = 0
        generation.row_step = self

    def __call__(self, lm, cache, ids, positions, mask):
        self.forwards, self.fed = self.forwards + 1, self.fed + len(ids)
        return self.real(lm, cache, ids, positions, mask)

    def take(self) -> tuple[int, int]:
        out, self.forwards, self.fed = (self.forwards, self.fed), 0, 0
        return out


def answer(store, item: dict, system: str, k: int, drafts: int, max_tokens: int, counter: Counter) -> dict:
    counter.take()
    got = store.ask(item["question"], system=system, k=k, max_new_tokens=max_tokens, draft_tokens=drafts)
    forwards, fed = counter.take()
    t = got.timings
    return {"text": got.text, "first": t["first_token"], "end": t["total"], "tokens": got.tokens["generated"],
            "forwards": forwards, "fed": fed}


def cell(answers: list[dict], golds: list[list[str]]) -> dict:
    from cachegraft_cli.evaluation.metrics import exact_match, f1_score

    after = [(a["tokens"] - 1, a["end"] - a["first"]) for a in answers if a["tokens"] > 1]
    return {
        "em": 100 * statistics.mean(exact_match(a["text"], g) for a, g in zip(answers, golds)),
        "f1": 100 * statistics.mean(f1_score(a["text"], g) for a, g in zip(answers, golds)),
        "decode_tok_s": sum(t for t, _ in after) / max(sum(s for _, s in after), 1e-9),
        "whole_p50": statistics.median(a["end"] for a in answers),
        "forwards": statistics.mean(a["forwards"] for a in answers),
        "tokens": statistics.mean(a["tokens"] for a in answers),
    }


def missing() -> str | None:
    """Why the benchmark cannot run here, or None."""
    from pathlib import Path

    from peer_llamacpp import SETS

    if not (Path(bc.RECEIVER) / "config.json").is_file():
        return "the offline pair is not pulled (cachegraft models pull offline)"
    absent = [f for f in SETS.values() if not (bc.QA_DATA / f).is_file()]
    return f"QA data missing in {bc.QA_DATA}: {', '.join(absent)}" if absent else None


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    why = missing()
    if why:
        print(f"copy_drafts: not run: {why}.")
        print(json.dumps({"bench": "copy_drafts", "run": False, "why": why}))
        return 0
    from peer_llamacpp import inputs

    import cachegraft_cli as cg

    start = bc.machine()
    ks, systems = [int(k) for k in args.k.split(",")], args.systems.split(",")
    stores, items = inputs(SimpleNamespace(k=args.k, four_k=args.k, per_set=args.per_set, seed=args.seed))
    weights = None if args.weights == "as-loaded" else args.weights
    opened = {name: cg.open_store(url, weights=weights) for name, url in stores.items()}
    warm, items = items[args.per_set], items[: args.per_set] + items[args.per_set + 1:]  # squad's extra one
    modes = [int(d) for d in args.drafts.split(",")]
    counter = Counter()
    for system in systems:  # lazy set-up (models, weights, tables) out of the figures
        answer(opened[warm["set"]], warm, system, ks[0], modes[0], args.max_tokens, counter)
    runs: dict = {}
    for i, item in enumerate(items):
        for k in ks:
            for system in systems:
                for mode in bc.rotated(modes, i):
                    got = answer(opened[item["set"]], item, system, k, mode, args.max_tokens, counter)
                    runs.setdefault((system, k, mode), []).append(got)
    golds = [item["answers"] for item in items]
    rows, figures = [], {}
    base = modes[-1]
    for system in systems:
        for k in ks:
            b = cell(runs[(system, k, base)], golds)
            figures[f"{system}@{k}"] = {f"drafts{base}": b}
            for mode in modes:
                on = runs[(system, k, mode)]
                same = sum(x["text"] == y["text"] for x, y in zip(on, runs[(system, k, base)]))
                a = cell(on, golds)
                figures[f"{system}@{k}"][f"drafts{mode}"] = {**a, "same": same}
                rows.append([system, k, mode, f"{same}/{len(on)}", f"{a['em']:.1f}/{a['f1']:.1f}",
                             f"{a['decode_tok_s']:.1f}", f"{a['decode_tok_s'] / max(b['decode_tok_s'], 1e-9):.2f}x",
                             f"{a['whole_p50']:.3f}", f"{a['forwards']:.2f}", f"{a['tokens']:.1f}"])
    bc.print_table(f"Copied drafts against one token per step: {len(items)} questions, greedy, "
                   f"{args.max_tokens} new tokens, weights {args.weights}",
                   ["system", "k", "draft_tokens", f"same answers as {base}", "EM/F1", "decode tok/s",
                    f"vs {base}", "whole p50 s", "forwards/answer", "tokens/answer"], rows)
    print(f"machine at start: {start}; at end: loadavg {bc.machine()['loadavg']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "runs": {"|".join(map(str, key)): v for key, v in runs.items()}}, f)
    bc.emit(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
