"""compare.md: the figure, the sweep's means and spreads, and the step-by-step check, as markdown."""

from __future__ import annotations

import os
from typing import Any

from launch.compare.config import MODES
from launch.compare.report import point_label


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def mean_pm(s: dict[str, float], percent: bool) -> str:
    """``mean ± std`` of a :func:`launch.compare.report.spread`, in percent or to 4 decimals."""
    if percent:
        return f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f} %"
    return f"{s['mean']:.4f} ± {s['std']:.4f}"


def accuracy_table(result: dict[str, Any]) -> list[str]:
    """The final test accuracy per point and mode, mean ± std over the seeds: a markdown table (compare.md's first,
    and the README's generated ``compare table`` section)."""
    lines = [
        "| images per rank | plain BatchNorm | syncbn_dist | one process, same global batch |",
        "|---|---|---|---|",
    ]
    for p in result["points"]:
        acc = p["final_test_acc"]
        lines.append(
            f"| {point_label(result['config'], p)} | " + " | ".join(mean_pm(acc[m], True) for m in MODES) + " |"
        )
    return lines


def summary(result: dict[str, Any], figure: str) -> str:
    """compare.md: the figure, the sweep's means and spreads, and the step-by-step check, as markdown."""
    cfg, points = result["config"], result["points"]
    f32, f64 = result["equivalence"]["float32"], result["equivalence"]["float64"]
    w, seeds = cfg["nproc"], cfg["seeds"]
    times = result["wall_time_s"]
    total = times.get("total")
    took = f"took {total / 60:.1f} min" if total is not None else "(wall time not recorded)"
    if cfg["head_bn"]:
        head = (
            "the digits job's (three conv-BatchNorm2d blocks and a Linear-BatchNorm1d head) at 2 images per rank and "
            "more; at 1 image per rank (marked *) its head has no BatchNorm1d (`model.head_bn=false`) in all three "
            "runs, because plain BatchNorm1d cannot train on the one value per channel it would see: that point "
            "compares the conv layers' BatchNorm2d alone"
        )
    else:
        head = (
            "the digits job's with a head without BatchNorm1d (`model.head_bn=false`) at every point; the three conv "
            "layers keep BatchNorm2d"
        )
    lines = [
        "# Plain vs synchronized BatchNorm as the per-rank batch shrinks",
        "",
        f"Digits (`{cfg['train_config']}`) on {w} ranks with {', '.join(map(str, cfg['batch_sizes']))} images per "
        f"rank; at each point plain per-rank BatchNorm, syncbn_dist, and BatchNorm in one process at the same "
        f"global batch, seeds {', '.join(map(str, seeds))}. Every run: {cfg['epochs']} epochs, dropout "
        f"{cfg['dropout']}, SGD with Nesterov momentum and a cosine schedule from the digits job, learning rate "
        f"{result['lr_rule']}, the same at every point for the three. The model is {head}. "
        f"`make compare` (`python -m launch.compare.run --config configs/compare.yaml`) {took} (wall time, every "
        f"process's start-up included; {_cpu_count()} CPU cores, {w} processes).",
        "",
        f"![compare]({figure})",
        "",
        f"Final test accuracy, mean ± standard deviation over the {len(seeds)} seeds (min–max in the figure, every "
        f"run in compare.json):",
        "",
        *accuracy_table(result),
    ]
    lines += [
        "",
        "Final training loss (mean over the last epoch), and the run settings:",
        "",
        "| images per rank | global batch | learning rate | steps per epoch | plain BatchNorm | syncbn_dist "
        "| one process |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        loss = p["final_loss"]
        steps = p["runs"]["sync_bn"][0]["steps_per_epoch"]
        lines.append(
            f"| {point_label(cfg, p)} | {p['global_batch_size']} | {p['lr']:.4g} | {steps} | "
            + " | ".join(mean_pm(loss[m], False) for m in MODES)
            + " |"
        )
    worst = max(points, key=lambda p: p["sync_vs_single"]["final_test_acc"])
    same = all(p["same_global_batches"] for p in points)
    lines += [
        "",
        "**syncbn_dist against one process.** "
        + (
            f"The digits job gives the one process the same global batches as the {w} ranks at every point, so the two "
            "runs are the same computation up to float32 rounding, which training amplifies (see the step-by-step "
            "check below): "
            if same
            else f"The digits job does not give the one process the same global batches as the {w} ranks at every "
            "point (same_global_batches in compare.json), so the two agree only statistically: "
        )
        + f"the largest final test accuracy difference of a seed is "
        f"{100 * worst['sync_vs_single']['final_test_acc']:.2f} points (at {point_label(cfg, worst)} images per rank).",
    ]

    def maxima(eq: dict[str, Any], prefix: str = "") -> str:
        return ", ".join(
            f"{name} {max(eq[prefix + key]):.1g}"
            for key, name in (("loss", "loss"), ("params", "parameters"), ("running_stats", "running statistics"))
        )

    lines += [
        "",
        f"**Equivalence, step by step.** {f32['steps']} SGD steps of the digits job's model (the sweep's) and "
        f"optimizer (constant learning rate {result['equivalence_lr']:.4g}) on the same global batches (the job's "
        f"`DistributedSampler` shards): syncbn_dist on {f32['world_size']} gloo processes x {f32['batch_size']} "
        f"images against plain `nn.BatchNorm` in one process on all {f32['world_size'] * f32['batch_size']}. Max "
        "absolute difference over the steps:",
        "",
        f"- float64: {maxima(f64)}; test logits after the last step {f64['test_logits']:.1g}.",
        f"- float32 (as trained): {maxima(f32)}; test logits {f32['test_logits']:.1g}, test accuracy "
        f"{_pct(f32['test_acc_ranks'])} vs {_pct(f32['test_acc_single'])}.",
        f"- float32 yardstick, the one-process model against itself with each batch in reverse order (the same "
        f"step in exact arithmetic): {maxima(f32, 'control_')}.",
        f"- `num_batches_tracked` equal after every step: "
        f"{'yes' if all(f32['num_batches_tracked_equal'] + f64['num_batches_tracked_equal']) else 'NO'}.",
        "",
        _float32_story(f32, f64),
        "",
    ]
    return "\n".join(lines)


def first_jump(values: list[float], factor: float = 10.0) -> int | None:
    """The first step (1-based) after which ``values`` grew more than ``factor``-fold in one step, or None."""
    for step in range(1, len(values)):
        if values[step] > factor * max(values[step - 1], 1e-300):
            return step + 1
    return None


def _float32_story(f32: dict[str, Any], f64: dict[str, Any]) -> str:
    """What the float32 differences do, from the numbers: rounding level throughout, or a jump and where."""
    steps = len(f32["params"])
    text = f"In float64 the two agree to rounding over all {steps} steps (parameters {max(f64['params']):.1g}). "
    jump, control = first_jump(f32["params"]), first_jump(f32["control_params"])
    if jump is None:
        return text + f"In float32 they stay at rounding level too (parameters {max(f32['params']):.1g})."
    before, after = f32["params"][jump - 2], f32["params"][jump - 1]
    text += (
        f"In float32 they agree to rounding until step {jump}, where the parameters' difference jumps from "
        f"{before:.1g} to {after:.1g} in one step, most likely a rounding-level difference tipping a discrete "
        "choice (a ReLU or a max-pool) the other way; training carries the difference on from there. "
    )
    if control is None:
        return text + (
            f"The yardstick has no such jump within these {steps} steps (parameters "
            f"{max(f32['control_params']):.1g}); where such a branch falls is a matter of luck."
        )
    return text + (
        f"The yardstick, in which only the order of summation changes, jumps the same way at step {control} "
        f"({f32['control_params'][control - 2]:.1g} to {f32['control_params'][control - 1]:.1g})."
    )
