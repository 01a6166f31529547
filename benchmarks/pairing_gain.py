"""What the sharer adds, from an `evaluate` run's answers: every system's EM / F1 per set and k,
then graft minus each control (`mismatched`: the pairing gain; `adapter`; or any `--pairs A:B`,
e.g. `graft@notes=48:text@notes=48` for the sharer's notes), paired per question,
with a bootstrap 95% interval, an exact McNemar (EM) or sign (F1) test and Holm's correction over
the run's (set, k) cells, and the count of cells where graft also stays at or above text.
With `sharer-text` answers in the run, the *hard subset* too: the questions that the receiver
reading the text gets wrong (EM 0) and the sharer reading the same text gets right (EM 1), pooled
over the sets per k, with every system's score on them.

    python benchmarks/pairing_gain.py RUN_DIR [TAG=RUN_DIR ...] [--pairs graft:mismatched,graft:adapter] [--seed 0]

Several runs of the same settings (one with the controls, one with `sharer-text`, say) are read
as one: a (set, k, system, question) answered in two of them is taken from the last. A run given
as TAG=RUN_DIR (another fuser, say) names its systems TAG/SYSTEM (`--pairs nf/graft:graft`).

Prints markdown tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachegraft_cli.evaluation.stats import holm, paired_comparison

ALPHA = 0.05


def load(runs: list[str]) -> dict[tuple, dict[str, dict]]:
    """(benchmark, k, system) -> question id -> record, over every run (TAG=DIR: systems TAG/SYSTEM)."""
    by: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for run in runs:
        tag, _, folder = run.rpartition("=") if "=" in run and not Path(run).exists() else ("", "", run)
        for line in (Path(folder) / "answers.jsonl").read_text().splitlines():
            r = json.loads(line)
            by[(r["benchmark"], r["k"], f"{tag}/{r['system']}" if tag else r["system"])][r["id"]] = r
    return by


def pct(rows: dict[str, dict], metric: str, ids=None) -> float:
    ids = list(rows) if ids is None else ids
    return 100 * sum(rows[i][metric] for i in ids) / len(ids) if ids else float("nan")


def compare(by, cells, a: str, b: str, seed: int) -> list[dict]:
    """a minus b per cell, EM and F1, Holm over the cells both answered, for each metric."""
    out = []
    for bench, k in cells:
        ra, rb = by.get((bench, k, a)), by.get((bench, k, b))
        if not ra or not rb:
            continue
        ids = sorted(set(ra) & set(rb))
        row = {"benchmark": bench, "k": k, "n": len(ids)}
        for metric in ("em", "f1"):
            result = paired_comparison([ra[i][metric] for i in ids], [rb[i][metric] for i in ids], seed)
            row[metric] = {key: (round(100 * v, 2) if key in ("mean_diff", "ci_low", "ci_high") else v)
                           for key, v in result.to_dict().items()}
        out.append(row)
    for metric in ("em", "f1"):
        for row, p in zip(out, holm([r[metric]["p_value"] for r in out])):
            row[metric]["p_holm"] = p
            row[metric]["significant_holm"] = p < ALPHA and row[metric]["mean_diff"] > 0
    return out


def hard_subset(by, benches, ks, systems, pairs: list[tuple[str, str]], seed: int) -> list[dict]:
    """Per k, the questions text gets wrong and sharer-text right (pooled over the sets): every
    system's scores on them, and each pair's paired comparison there (neither system of a pair
    chose the subset, so the comparison is fair; both regress to the mean alike)."""
    out = []
    for k in ks:
        picked = []
        for bench in benches:
            text, sharer = by.get((bench, k, "text")), by.get((bench, k, "sharer-text"))
            if text and sharer:
                picked += [(bench, i) for i in sorted(set(text) & set(sharer)) if text[i]["em"] == 0
                           and sharer[i]["em"] == 1]
        if not picked:
            continue
        row: dict = {"k": k, "n": len(picked), "systems": {}, "pairs": {}}
        answered = {}
        for system in systems:
            values = [by[(b, k, system)][i] for b, i in picked if i in by.get((b, k, system), {})]
            if len(values) == len(picked):
                answered[system] = values
                row["systems"][system] = {"em": round(100 * sum(v["em"] for v in values) / len(values), 1),
                                          "f1": round(100 * sum(v["f1"] for v in values) / len(values), 1)}
        for a, b in pairs:
            if a in answered and b in answered:
                row["pairs"][f"{a} - {b}"] = {
                    metric: paired_comparison([v[metric] for v in answered[a]], [v[metric] for v in answered[b]],
                                              seed).to_dict() for metric in ("em", "f1")}
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="evaluate --out folders; TAG=DIR names a run's systems TAG/SYSTEM")
    ap.add_argument("--pairs", default="graft:mismatched,graft:adapter", help="A:B,... compared as A minus B")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    by = load(args.runs)
    benches = list(dict.fromkeys(b for b, _, _ in by))
    ks = sorted({k for _, k, _ in by})
    systems = list(dict.fromkeys(s for _, _, s in sorted(by, key=lambda key: key[2])))
    cells = [(b, k) for b in benches for k in ks]
    print("| set | k | " + " | ".join(systems) + " |")
    print("|---|---|" + "---|" * len(systems))
    for bench, k in cells:
        shown = [f"{pct(by[(bench, k, s)], 'em'):.0f} / {pct(by[(bench, k, s)], 'f1'):.1f}"
                 if (bench, k, s) in by else "-" for s in systems]
        print(f"| {bench} | {k} | " + " | ".join(shown) + " |")
    report: dict = {"benchmark": "pairing_gain", "runs": [str(r) for r in args.runs], "comparisons": {}}
    for a, b in (tuple(pair.split(":")) for pair in args.pairs.split(",")):
        if a not in systems or b not in systems:
            continue
        rows = compare(by, cells, a, b, args.seed)
        report["comparisons"][f"{a} - {b}"] = rows
        print(f"\n{a} - {b} (points; paired, bootstrap 95% interval; p after Holm over {len(rows)} cells)\n")
        print("| set | k | n | EM diff [95% CI] | p (Holm) | F1 diff [95% CI] | p (Holm) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            em, f1 = r["em"], r["f1"]
            print(f"| {r['benchmark']} | {r['k']} | {r['n']} | {em['mean_diff']:+.1f} [{em['ci_low']:+.1f}, "
                  f"{em['ci_high']:+.1f}] | {em['p_holm']:.3f} | {f1['mean_diff']:+.1f} [{f1['ci_low']:+.1f}, "
                  f"{f1['ci_high']:+.1f}] | {f1['p_holm']:.3f} |")
        sig = {m: sum(r[m]["significant_holm"] for r in rows) for m in ("em", "f1")}
        print(f"\n{a} above {b} after Holm: EM in {sig['em']}, F1 in {sig['f1']} of {len(rows)} cells")
    if "text" in systems:
        above = [(b, k) for b, k in cells if (b, k, "graft") in by and (b, k, "text") in by
                 and pct(by[(b, k, "graft")], "em") >= pct(by[(b, k, "text")], "em")
                 and pct(by[(b, k, "graft")], "f1") >= pct(by[(b, k, "text")], "f1")]
        report["graft_at_or_above_text"] = len(above)
        print(f"graft at or above text in EM and F1: {len(above)} of {len(cells)} cells")
    pairs = [tuple(pair.split(":")) for pair in args.pairs.split(",")]
    hard = hard_subset(by, benches, ks, systems, pairs, args.seed)
    if hard:
        report["hard_subset"] = hard
        print("\nHard subset (text EM 0, sharer-text EM 1; pooled over the sets): EM / F1\n")
        print("| k | questions | " + " | ".join(systems) + " |")
        print("|---|---|" + "---|" * len(systems))
        for row in hard:
            cells_ = [f"{row['systems'][s]['em']:.0f} / {row['systems'][s]['f1']:.1f}" if s in row["systems"] else "-"
                      for s in systems]
            print(f"| {row['k']} | {row['n']} | " + " | ".join(cells_) + " |")
        for row in hard:
            for name, result in row["pairs"].items():
                em, f1 = result["em"], result["f1"]
                print(f"k={row['k']}: {name} on the hard subset: EM {100 * em['mean_diff']:+.1f} "
                      f"[{100 * em['ci_low']:+.1f}, {100 * em['ci_high']:+.1f}] (wins {em['wins']}, losses "
                      f"{em['losses']}, p {em['p_value']:.3f}); F1 {100 * f1['mean_diff']:+.1f} "
                      f"[{100 * f1['ci_low']:+.1f}, {100 * f1['ci_high']:+.1f}] (p {f1['p_value']:.3f})")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
