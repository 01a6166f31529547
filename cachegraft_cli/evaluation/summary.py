"""The run summary: a pure function of the config and the JSONL records.

Records are taken in canonical key order and every bootstrap is seeded from
the run seed and the group it describes, so a resumed run and an
uninterrupted one give the same summary.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

from cachegraft_cli.evaluation.kinds import kind_shares
from cachegraft_cli.evaluation.metrics import mean
from cachegraft_cli.evaluation.stats import ALPHA, bootstrap_ci, cohen_kappa, holm, paired_comparison, rank_auc
from cachegraft_cli.evaluation.variants import BEST_TEXT, base_system

COMPARISON_PAIRS = (("graft", "text"), ("graft", "cache"), ("graft", "adapter"), ("graft", "mismatched"))
EM_JUDGE = "em"


def group_seed(seed: int, *parts) -> int:
    return (seed * 1_000_003 + zlib.crc32("/".join(map(str, parts)).encode())) % 2**32


def clean(value):
    """NaN -> None, recursively, so the summary is plain, comparable JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def _group(records: Sequence[dict], fields: Sequence[str]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault(tuple(record[f] for f in fields), []).append(record)
    return groups


def _numeric_means(rows: list[dict], field: str) -> dict:
    keys = sorted({k for r in rows for k, v in (r.get(field) or {}).items() if isinstance(v, (int, float))})
    # over the rows that have the figure (a question that retrieved nothing has no timings)
    return {k: mean(v for r in rows if isinstance(v := (r.get(field) or {}).get(k), (int, float))) for k in keys}


def system_scores(answers: list[dict], config: dict) -> list[dict]:
    seed, samples = config["seed"], config["bootstrap_samples"]
    out = []
    for (bench, system, k), rows in _group(answers, ("benchmark", "system", "k")).items():
        em, f1 = [r["em"] for r in rows], [r["f1"] for r in rows]
        out.append({
            "benchmark": bench, "system": system, "k": k, "n": len(rows),
            "em": mean(em), "em_ci": bootstrap_ci(em, group_seed(seed, bench, system, k, "em"), samples),
            "f1": mean(f1), "f1_ci": bootstrap_ci(f1, group_seed(seed, bench, system, k, "f1"), samples),
            "recall": mean(r.get("recall") for r in rows),
            "timings": _numeric_means(rows, "timings"), "stats": _numeric_means(rows, "stats"),
        })
    return out


def answer_kinds(answers: list[dict]) -> list[dict]:
    """Per (benchmark, system, k): the share of answers of each kind (`kinds.KINDS`)."""
    return [{"benchmark": bench, "system": system, "k": k, "n": len(rows), "kinds": kind_shares(rows)}
            for (bench, system, k), rows in _group(answers, ("benchmark", "system", "k")).items()]


def judge_scores(verdicts: list[dict], config: dict) -> list[dict]:
    seed, samples = config["seed"], config["bootstrap_samples"]
    out = []
    for (bench, system, k, judge), rows in _group(verdicts, ("benchmark", "system", "k", "judge")).items():
        values = [r["verdict"] for r in rows]
        ci = bootstrap_ci(values, group_seed(seed, bench, system, k, judge), samples)
        out.append({"benchmark": bench, "system": system, "k": k, "judge": judge, "n": len(rows),
                    "accuracy": mean(values), "ci": ci, "probability": mean(r["probability"] for r in rows)})
    return out


def judge_agreement(answers: list[dict], verdicts: list[dict]) -> list[dict]:
    """Cohen's kappa of each judge's verdicts vs EM labels and vs F1>=0.5 labels, same answers;
    and the AUC of its probability vs EM labels (signal a miscalibrated threshold can hide)."""
    by_key = {(a["benchmark"], a["id"], a["system"], a["k"]): a for a in answers}
    out = []
    for (judge,), rows in _group(verdicts, ("judge",)).items():
        pairs = [(r, by_key[_answer_key(r)]) for r in rows if _answer_key(r) in by_key]
        labels = [r["verdict"] for r, _ in pairs]
        em = [int(a["em"] >= 1.0) for _, a in pairs]
        out.append({"judge": judge, "n": len(pairs), "kappa_em": cohen_kappa(labels, em),
                    "kappa_f1": cohen_kappa(labels, [int(a["f1"] >= 0.5) for _, a in pairs]),
                    "auc_em": rank_auc([r["probability"] for r, _ in pairs], em)})
    return out


def _answer_key(record: dict) -> tuple:
    return (record["benchmark"], record["id"], record["system"], record["k"])


def _verdict_table(answers: list[dict], verdicts: list[dict]) -> dict[tuple, dict[str, float]]:
    """(benchmark, system, k, judge) -> {question id: verdict}; judge 'em' from EM."""
    table: dict[tuple, dict[str, float]] = {}
    for a in answers:
        table.setdefault((a["benchmark"], a["system"], a["k"], EM_JUDGE), {})[a["id"]] = float(a["em"] >= 1.0)
    for v in verdicts:
        table.setdefault((v["benchmark"], v["system"], v["k"], v["judge"]), {})[v["id"]] = float(v["verdict"])
    return table


def best_text(answers: list[dict], config: dict) -> dict[tuple, str]:
    """(benchmark, k) -> the text variant with the highest mean EM (then F1), when the run
    answered text in more than one assembly (e.g. `text` and `text@order=retrieval`)."""
    labels = [s for s in config["systems"] if base_system(s) == "text"]
    if len(labels) < 2:
        return {}
    groups = _group([a for a in answers if a["system"] in labels], ("benchmark", "k", "system"))
    best: dict[tuple, tuple] = {}
    for (bench, k, label), rows in groups.items():
        score = (mean(r["em"] for r in rows), mean(r["f1"] for r in rows), -labels.index(label))
        if (bench, k) not in best or score > best[(bench, k)][0]:
            best[(bench, k)] = (score, label)
    return {key: label for key, (_, label) in best.items()}


def _comparison_pairs(config: dict, best: dict) -> list[tuple[str, str]]:
    pairs = [(a, b) for a, b in COMPARISON_PAIRS if a in config["systems"] and b in config["systems"]]
    return pairs + ([("graft", BEST_TEXT)] if best and "graft" in config["systems"] else [])


def comparisons(answers: list[dict], verdicts: list[dict], config: dict) -> list[dict]:
    """Per (pair, benchmark, judge, k): paired test; Holm within each pair's family.
    `text (best order)` stands for the best text variant of each (benchmark, k)."""
    table = _verdict_table(answers, verdicts)
    best = best_text(answers, config)
    for (bench, k), label in best.items():
        for judge in judge_labels(config):
            table[(bench, BEST_TEXT, k, judge)] = table.get((bench, label, k, judge), {})
    out = []
    for a, b in _comparison_pairs(config, best):
        compared = [_compare(table, a, b, key, config) for key in _comparison_keys(config, a, b)]
        family = [c for c in compared if c is not None]
        for c, p_holm in zip(family, holm([c["p_value"] for c in family])):
            c.update(p_holm=p_holm, significant=_sig(c, c["p_value"]), significant_holm=_sig(c, p_holm))
        out += family
    return out


def _sig(comparison: dict, p: float) -> bool:
    return p < ALPHA and comparison["mean_diff"] > 0


def judge_labels(config: dict) -> list[str]:
    return [EM_JUDGE] + [j["name"] for j in config["judges"]]


def _comparison_keys(config: dict, a: str, b: str) -> list[tuple]:
    return [(bench["name"], judge, k) for bench in config["benchmarks"]
            for judge in judge_labels(config) for k in config["ks"]]


def _compare(table: dict, a: str, b: str, key: tuple, config: dict) -> dict | None:
    bench, judge, k = key
    va, vb = table.get((bench, a, k, judge), {}), table.get((bench, b, k, judge), {})
    ids = sorted(set(va) & set(vb))
    if not ids:
        return None
    seed = group_seed(config["seed"], bench, judge, k, a, b)
    result = paired_comparison([va[i] for i in ids], [vb[i] for i in ids], seed, config["bootstrap_samples"])
    return {"a": a, "b": b, "benchmark": bench, "judge": judge, "k": k, **result.to_dict()}


def headlines(comparison_rows: list[dict]) -> dict[str, str]:
    out = {}
    for a, b in dict.fromkeys((c["a"], c["b"]) for c in comparison_rows):
        rows = [c for c in comparison_rows if c["a"] == a and c["b"] == b]
        if rows:
            better = sum(c["mean_diff"] > 0 for c in rows)
            sig = sum(c["significant"] for c in rows)
            sig_holm = sum(c["significant_holm"] for c in rows)
            out[f"{a} vs {b}"] = (f"{a} better than {b} in {better} of {len(rows)} comparisons, "
                                  f"{sig} significant ({sig_holm} after Holm)")
    return out


def pairwise_scores(pairs: list[dict]) -> list[dict]:
    out = []
    for (bench, a, b, k, judge), rows in _group(pairs, ("benchmark", "a", "b", "k", "judge")).items():
        verdicts = [r["verdict"] for r in rows]
        out.append({"benchmark": bench, "a": a, "b": b, "k": k, "judge": judge, "n": len(rows),
                    "a_better": verdicts.count("a"), "ties": verdicts.count("tie"),
                    "b_better": verdicts.count("b"), "prob_a": mean(r["prob_a"] for r in rows)})
    return out


def _config_order(config: dict):
    """Sort key: benchmark, then system in config order, then k."""
    benches = {b["name"]: i for i, b in enumerate(config["benchmarks"])}
    systems = {s: i for i, s in enumerate(config["systems"])}
    return lambda row: (benches.get(row["benchmark"], 1 << 30), systems.get(row["system"], 1 << 30), row["k"])


def summarize(config: dict, answers: list[dict], verdicts: list[dict], pairs: list[dict]) -> dict:
    """Everything the report shows, from canonical-order records."""
    rows = comparisons(answers, verdicts, config)
    order = _config_order(config)
    return clean({
        "headlines": headlines(rows),
        "best_text": [{"benchmark": b, "k": k, "system": label}
                      for (b, k), label in sorted(best_text(answers, config).items())],
        "systems": sorted(system_scores(answers, config), key=order),
        "kinds": sorted(answer_kinds(answers), key=order),
        "judge_scores": sorted(judge_scores(verdicts, config), key=lambda r: (order(r), r["judge"])),
        "judge_agreement": judge_agreement(answers, verdicts),
        "comparisons": rows,
        "pairwise": pairwise_scores(pairs),
        "counts": {"answers": len(answers), "verdicts": len(verdicts), "pairwise": len(pairs)},
        "config": config,
    })
