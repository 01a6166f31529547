"""PNG plots of a run summary (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _err(value: float | None, ci) -> tuple[float, float]:
    if value is None or not ci or ci[0] is None:
        return (0.0, 0.0)
    return (max(0.0, value - ci[0]) * 100, max(0.0, ci[1] - value) * 100)


def plot_scores(summary: dict, bench: str, path: Path) -> None:
    """EM and F1 with 95% CIs per system (and k) on one benchmark."""
    plt = _pyplot()
    rows = [s for s in summary["systems"] if s["benchmark"] == bench]
    labels = [s["system"] if s["k"] == 0 else f"{s['system']}@{s['k']}" for s in rows]
    xs, width = range(len(rows)), 0.4
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(rows) + 2), 3.5))
    for offset, metric in ((-width / 2, "em"), (width / 2, "f1")):
        values = [100 * (s[metric] or 0.0) for s in rows]
        errors = [list(e) for e in zip(*[_err(s[metric], s[f"{metric}_ci"]) for s in rows])] or [[], []]
        ax.bar([x + offset for x in xs], values, width, yerr=errors, capsize=3, label=metric.upper())
    ax.set_xticks(list(xs), labels, rotation=45, ha="right")
    ax.set_ylabel("score (%)")
    ax.set_title(bench)
    ax.legend()
    _save(fig, path)


def plot_comparison_grid(summary: dict, path: Path) -> None:
    """Heatmap of mean differences (points); * p<0.05, ** after Holm."""
    plt = _pyplot()
    rows = summary["comparisons"]
    row_keys = sorted({(c["benchmark"], c["judge"]) for c in rows})
    col_keys = sorted({(c["a"], c["b"], c["k"]) for c in rows})
    grid = [[None] * len(col_keys) for _ in row_keys]
    for c in rows:
        grid[row_keys.index((c["benchmark"], c["judge"]))][col_keys.index((c["a"], c["b"], c["k"]))] = c
    fig, ax = plt.subplots(figsize=(1.2 * len(col_keys) + 3, 0.5 * len(row_keys) + 1.5))
    values = [[100 * c["mean_diff"] if c else float("nan") for c in row] for row in grid]
    limit = max([abs(v) for row in values for v in row if v == v] + [1.0])
    image = ax.imshow(values, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    _annotate(ax, grid, limit)
    ax.set_xticks(range(len(col_keys)), [f"{a}-{b}\nk={k}" for a, b, k in col_keys])
    ax.set_yticks(range(len(row_keys)), [f"{b} / {j}" for b, j in row_keys])
    fig.colorbar(image, ax=ax, label="mean difference (points)")
    _save(fig, path)


def _annotate(ax, grid, limit: float) -> None:
    for i, row in enumerate(grid):
        for j, c in enumerate(row):
            if c:
                mark = "**" if c["significant_holm"] else "*" if c["significant"] else ""
                color = "white" if abs(100 * c["mean_diff"]) > 0.6 * limit else "black"
                ax.text(j, i, f"{100 * c['mean_diff']:+.1f}{mark}", ha="center", va="center", fontsize=8, color=color)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)


def write_plots(summary: dict, run_dir: Path) -> list[str]:
    """All plots under run_dir/plots; returns their paths relative to run_dir."""
    (run_dir / "plots").mkdir(exist_ok=True)
    written = []
    for i, bench in enumerate(b["name"] for b in summary["config"]["benchmarks"]):
        rel = f"plots/scores_{i}_{_safe(bench)}.png"
        plot_scores(summary, bench, run_dir / rel)
        written.append(rel)
    if summary["comparisons"]:
        plot_comparison_grid(summary, run_dir / "plots/comparisons.png")
        written.append("plots/comparisons.png")
    return written


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
