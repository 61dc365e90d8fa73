"""compare.png: final test accuracy and training loss against the per-rank batch, and the step-by-step check."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from launch.compare.config import MODES
from launch.compare.report import point_label

LABELS = {
    "plain_bn": "plain BatchNorm, {w} ranks",
    "sync_bn": "syncbn_dist, {w} ranks",
    "single_bn": "BatchNorm, 1 process, same global batch",
}


STYLES = {
    "plain_bn": {"color": "tab:red", "marker": "o"},
    "sync_bn": {"color": "tab:blue", "marker": "s"},
    "single_bn": {"color": "black", "linestyle": "--", "marker": "x"},
}


def _plot_sweep(ax: Any, result: dict[str, Any], key: str, scale: float, names: dict[str, str]) -> None:
    """Mean over seeds (line), min-max over seeds (error bar) and every seed (faint dots) against the batch."""
    points = result["points"]
    xs = [p["batch_size"] for p in points]
    for i, mode in enumerate(MODES):
        shift = 2 ** (0.04 * (i - 1))  # side by side on the log axis, so that the bars do not hide each other
        x = [v * shift for v in xs]
        stats = [p[key][mode] for p in points]
        mean = [scale * s["mean"] for s in stats]
        below = [scale * (s["mean"] - s["min"]) for s in stats]
        above = [scale * (s["max"] - s["mean"]) for s in stats]
        ax.errorbar(x, mean, yerr=[below, above], capsize=3, label=names[mode], **STYLES[mode])
        for xi, p in zip(x, points):
            seeds = [scale * r[key] for r in p["runs"][mode]]
            ax.scatter([xi] * len(seeds), seeds, color=STYLES[mode]["color"], alpha=0.3, s=12)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [point_label(result["config"], p) for p in points])
    ax.grid(alpha=0.3)
    ax.legend()


def _plot_equivalence(eq_ax: Any, diff_ax: Any, result: dict[str, Any]) -> None:
    """The step-by-step check: the two loss curves, and the differences after each step."""
    f32, f64 = result["equivalence"]["float32"], result["equivalence"]["float64"]
    w, b = f32["world_size"], f32["batch_size"]
    steps = range(1, len(f32["loss_ranks"]) + 1)
    eq_ax.plot(steps, f32["loss_ranks"], color="tab:blue", linewidth=4, alpha=0.45, label=f"syncbn_dist, {w} x {b}")
    eq_ax.plot(steps, f32["loss_single"], color="black", linestyle="--", linewidth=1, label=f"BatchNorm, 1 x {w * b}")
    eq_ax.set(
        title=f"equivalence: loss per SGD step, same global batches (float32)\n"
        f"max |difference| {max(f32['loss']):.1g} (float32), {max(f64['loss']):.1g} (float64)",
        xlabel="step",
        ylabel="training loss of the global batch",
    )
    eq_ax.legend()
    eq_ax.grid(alpha=0.3)

    def positive(values: list[float]) -> list[float]:
        return [v if v > 0 else math.nan for v in values]  # exactly equal: no point on a log axis

    lines = (
        (f32, "", "tab:blue", f"syncbn_dist {w}x{b} vs BatchNorm 1x{w * b}, float32"),
        (f32, "control_", "tab:gray", f"BatchNorm 1x{w * b} vs itself with the batch reversed, float32"),
        (f64, "", "tab:green", f"syncbn_dist {w}x{b} vs BatchNorm 1x{w * b}, float64"),
    )
    for eq, prefix, color, label in lines:
        params, stats = eq[f"{prefix}params"], eq[f"{prefix}running_stats"]
        label += f" (max {max(params):.1g} / {max(stats):.1g})"
        diff_ax.plot(steps, positive(params), color=color, label=label)
        diff_ax.plot(steps, positive(stats), color=color, linestyle=":")
    diff_ax.set_yscale("log")
    diff_ax.set_ylim(top=1e6)  # room for the legend above the curves
    diff_ax.set(
        title="max absolute difference after each step\n(solid: parameters, dotted: running statistics)",
        xlabel="step",
        ylabel="max |difference|",
    )
    diff_ax.legend(fontsize="x-small", loc="upper left")
    diff_ax.grid(alpha=0.3)


def plot(result: dict[str, Any], path: Path) -> None:
    """compare.png: final test accuracy and training loss against the per-rank batch (mean, min-max and every
    seed), above the step-by-step equivalence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    w, n = cfg["nproc"], len(cfg["seeds"])
    names = {mode: LABELS[mode].format(w=w) for mode in MODES}
    star = "; *: no BatchNorm1d head" if any(cfg["head_bn"] and not p["head_bn"] for p in result["points"]) else ""
    fig, ((acc_ax, loss_ax), (eq_ax, diff_ax)) = plt.subplots(2, 2, figsize=(13, 9.5))
    _plot_sweep(acc_ax, result, "final_test_acc", 100.0, names)
    acc_ax.set(
        title=f"final test accuracy: mean, bars min-max over {n} seeds",
        xlabel=f"images per rank (global batch {w} x that{star})",
        ylabel="test accuracy (%)",
    )
    _plot_sweep(loss_ax, result, "final_loss", 1.0, names)
    loss_ax.set_yscale("log")
    loss_ax.set(
        title=f"final training loss (last epoch): mean, bars min-max over {n} seeds",
        xlabel=f"images per rank (global batch {w} x that{star})",
        ylabel="cross-entropy",
    )
    _plot_equivalence(eq_ax, diff_ax, result)
    fig.suptitle(
        f"digits, {cfg['epochs']} epochs, {result['lr_rule']}: BatchNorm statistics over each rank's images "
        f"vs the global batch"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
