"""report.md from a run summary."""

from __future__ import annotations

from collections.abc import Sequence


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _ci(value, ci) -> str:
    if value is None:
        return "-"
    low, high = ci if ci else (None, None)
    return f"{_pct(value)} [{_pct(low)}, {_pct(high)}]"


def _p(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2e}" if value < 1e-3 else f"{value:.4f}"


def table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _k(k: int) -> str:
    return "-" if k == 0 else str(k)


def _scores_section(summary: dict, bench: str) -> list[str]:
    rows = [s for s in summary["systems"] if s["benchmark"] == bench]
    timing_keys = sorted({t for s in rows for t in s["timings"]})
    stat_keys = sorted({t for s in rows for t in s["stats"]})
    header = ["system", "k", "n", "EM [95% CI]", "F1 [95% CI]", "recall@k"] + \
        [f"{t} (s)" for t in timing_keys] + stat_keys
    body = [[s["system"], _k(s["k"]), s["n"], _ci(s["em"], s["em_ci"]), _ci(s["f1"], s["f1_ci"]),
             _pct(s["recall"])] + [_num(s["timings"].get(t)) for t in timing_keys]
            + [_num(s["stats"].get(t), 1) for t in stat_keys] for s in rows]
    return [f"## Scores: {bench}", "", *table(header, body), ""]


def _kinds_section(summary: dict, bench: str) -> list[str]:
    rows = [r for r in summary.get("kinds", []) if r["benchmark"] == bench]
    shown = [kind for kind in (rows[0]["kinds"] if rows else {}) if any(r["kinds"][kind] for r in rows)]
    if not shown:
        return []
    body = [[r["system"], _k(r["k"]), r["n"], *(_pct(r["kinds"][kind]) for kind in shown)] for r in rows]
    return [f"## What the answers are: {bench} (% of answers)", "", *table(["system", "k", "n", *shown], body), "",
            "Cut short / too long: the answer's words all within a gold answer's, or a gold answer's all "
            "within it; partly right: other overlap. The wrong ones by where their words occur: in a "
            "retrieved gold passage (wrong span), only in other retrieved passages, or in none.", ""]


def _judge_section(summary: dict) -> list[str]:
    if not summary["judge_scores"]:
        return []
    body = [[j["benchmark"], j["system"], _k(j["k"]), j["judge"], j["n"], _ci(j["accuracy"], j["ci"])]
            for j in summary["judge_scores"]]
    agree = [[a["judge"], a["n"], _num(a["kappa_em"]), _num(a["kappa_f1"]), _num(a.get("auc_em", float("nan")))]
             for a in summary["judge_agreement"]]
    return ["## Judge accuracy (% judged correct)", "",
            *table(["benchmark", "system", "k", "judge", "n", "correct [95% CI]"], body), "",
            "## Judge agreement (Cohen's kappa)", "",
            *table(["judge", "n", "kappa vs EM", "kappa vs F1>=0.5", "AUC of its probability vs EM"], agree), ""]


def _mark(c: dict) -> str:
    return "**" if c["significant_holm"] else "*" if c["significant"] else ""


def _comparison_section(summary: dict, a: str, b: str) -> list[str]:
    rows = [c for c in summary["comparisons"] if c["a"] == a and c["b"] == b]
    if not rows:
        return []
    body = [[c["benchmark"], c["judge"], c["k"], c["n"], f"{c['wins']}/{c['ties']}/{c['losses']}",
             f"{_ci(c['mean_diff'], (c['ci_low'], c['ci_high']))}{_mark(c)}", _p(c["p_value"]), _p(c["p_holm"])]
            for c in rows]
    header = ["benchmark", "judge", "k", "n", "W/T/L", "mean diff, points [95% CI]", "p (McNemar)", "p (Holm)"]
    return [f"## Comparison: {a} vs {b}", "", summary["headlines"][f"{a} vs {b}"], "",
            *table(header, body), "",
            "W/T/L: questions where only the first system is right / both or neither / only the second. "
            "`*` p < 0.05 in favour of the first, `**` also after Holm.", ""]


def _pairwise_section(summary: dict) -> list[str]:
    if not summary["pairwise"]:
        return []
    body = [[p["benchmark"], f"{p['a']} vs {p['b']}", p["k"], p["judge"], p["n"],
             f"{p['a_better']}/{p['ties']}/{p['b_better']}", _num(p["prob_a"])] for p in summary["pairwise"]]
    header = ["benchmark", "pair", "k", "judge", "n", "first better/tie/second better", "P(first better)"]
    return ["## Pairwise judge preferences (both orders averaged)", "", *table(header, body), ""]


def _settings(config: dict) -> list[str]:
    benches = ", ".join(f"{b['name']} ({b['source']})" for b in config["benchmarks"])
    judges = ", ".join(j["spec"] for j in config["judges"]) or "none (EM only)"
    return ["## Settings", "", f"- benchmarks: {benches}", f"- systems: {', '.join(config['systems'])}",
            f"- k: {', '.join(map(str, config['ks']))} (k '-' = answered without passages)",
            f"- judges: {judges}", f"- questions per benchmark: {config['limit'] or 'all'}, seed {config['seed']}, "
            f"corpus: {config['corpus']}", ""]


def render_report(summary: dict, plots: Sequence[str] = ()) -> str:
    config = summary["config"]
    lines = ["# CacheGraft evaluation", ""] + [h for h in summary["headlines"].values()] + [""]
    lines += _settings(config)
    for bench in config["benchmarks"]:
        lines += _scores_section(summary, bench["name"])
        lines += _kinds_section(summary, bench["name"])
    lines += _judge_section(summary)
    for key in summary["headlines"]:
        lines += _comparison_section(summary, *key.split(" vs "))
    lines += _pairwise_section(summary)
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)
