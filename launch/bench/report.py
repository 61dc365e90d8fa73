"""Render the benchmark's summary (:func:`launch.bench.summary.summarize`): the markdown report
(performance.md, also printed), the step-time plot (performance.png) and the README's tables per device, in a
user's words (the target codes stay in the report).
"""

from __future__ import annotations

from typing import Any, Optional

from launch.bench.models import COMPILED_SUFFIX, LABELS
from launch.bench.summary import batchnorm_channels, fmt
from launch.common.io import atomic_write

# The rows' order of dtypes in the README's GPU step table, and the microbenchmark's name of torch's function.
STEP_DTYPE_ORDER = ("bfloat16", "float32")
TORCH_FUNCTION = "torch SyncBatchNorm fn"


def _ratio_with_paired_ci(ratio: Optional[float], paired: Optional[dict[str, float]]) -> str:
    if ratio is None or paired is None:
        return "–"
    return f"{ratio:.3f} [{paired['median']:+.3f}, {paired['ci95_low']:+.3f} to {paired['ci95_high']:+.3f}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _model_line(name: str, cfg: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    if cfg["model"] == "resnet18":
        net = f"ResNet-18 topology (BasicBlocks, 20 BatchNorm2d) at width {cfg['width']}"
    else:
        net = f"{cfg['num_layers']} × (conv3x3 → BatchNorm2d → ReLU) at width {cfg['width']}"
    walls = ", ".join(f"W={r['world_size']} {r['wall_seconds']} s" for r in runs)
    rounds = "/".join(str(next(iter(r["variants"].values()))["rounds"]) for r in runs)
    bucket = f"{cfg['bucket_cap_mb']} MiB" if cfg["bucket_cap_mb"] else "default"
    return (
        f"- {name}: {net}, batch {cfg['batch_size']} per rank, {cfg['image_size']}×{cfg['image_size']} input, "
        f"DDP bucket cap {bucket}, {rounds} rounds × {_count(cfg['steps_per_round'], 'step')}, "
        f"{_count(cfg['threads'], 'intra-op thread')} per rank; wall time {walls}"
    )


def _count(n: int, noun: str) -> str:
    """``1 step``, ``3 steps``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def on_gpu(summary: dict[str, Any]) -> bool:
    """Whether the run measured CUDA (``device=cuda``: what ``make bench-gpu`` runs) rather than the CPU."""
    return summary["config"].get("device") == "cuda" or (summary["micro"] or {}).get("backend") == "nccl"


def shown_command(command: str) -> str:
    """The run's command without ``output_dir=...``: where the machine that ran it wrote its files, which says
    nothing about what was measured (a GPU machine's scratch path otherwise lands in the report)."""
    return " ".join(word for word in command.split(" ") if not word.startswith("output_dir="))


def _ratio(medians: dict[str, float], numerator: str, denominator: str) -> Optional[float]:
    """``medians[numerator] / medians[denominator]``, None where either variant did not run."""
    if numerator not in medians or denominator not in medians:
        return None
    return medians[numerator] / medians[denominator]


def _median(run: dict[str, Any], variant: str) -> Optional[float]:
    entry = run["variants"].get(variant)
    return None if entry is None else entry["median_ms"]


def _layer_name(case: dict[str, Any]) -> str:
    layout = " channels_last" if case["memory_format"] == "channels_last" else ""
    return f"{tuple(case['shape'])} {case['dtype']}{layout}"


def _times(value: Optional[float], over: Optional[float]) -> str:
    """``2.09 (0.59×)``: ms, and in brackets its ratio to ``over``."""
    if value is None:
        return "–"
    return fmt(value, ".2f") + ("" if over is None else f" ({value / over:.2f}×)")


def _span(values: list[float]) -> str:
    """``0.91–1.09×``, or ``1.02×`` for one value."""
    low, high = min(values), max(values)
    return f"{low:.2f}×" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}×"


_BASELINE = "F.batch_norm + collectives"


def readme_tables(summary: dict[str, Any]) -> str:
    """The README's generated ``performance table`` section, for CPU: one layer against plain BatchNorm plus the same
    two all_reduces (the cost any synchronized BatchNorm pays), the cases where syncbn_dist is slower, and the DDP
    step's range. The numbers are :func:`markdown`'s; the target codes stay there."""
    machine, micro = summary["machine"], summary["micro"]
    out = [
        f"**CPU** (`make bench`: {machine['cpu']}, {_count(machine['nproc'], 'CPU')}, torch {machine['torch']}, "
        "gloo, one intra-op thread per process; every number: [docs/performance.md](docs/performance.md)). "
        "One BatchNorm layer, forward + backward, median ms; in brackets the ratio to plain BatchNorm plus the same "
        "two all_reduces, the floor for any synchronized BatchNorm (below 1 is faster):",
        "",
    ]
    cases = [c for c in (micro or {}).get("cases", []) if _BASELINE in c["median_ms"]]
    if not cases:
        out += ["Not measured (the one-layer benchmark did not run)."]
    else:
        rows = [
            [_layer_name(c), fmt(c["median_ms"].get("F.batch_norm"), ".2f"), fmt(c["median_ms"][_BASELINE], ".2f"),
             _times(c["median_ms"].get("syncbn_dist"), c["median_ms"][_BASELINE])]
            for c in cases
        ]
        out += _table(["layer input", "plain BatchNorm", "plain BatchNorm + the same all_reduces", "syncbn_dist"], rows)
        slower = [
            f"{_layer_name(c)} ({c['median_ms']['syncbn_dist'] / c['median_ms'][_BASELINE]:.2f}×)"
            for c in cases
            if "syncbn_dist" in c["median_ms"] and c["median_ms"]["syncbn_dist"] > c["median_ms"][_BASELINE]
        ]
        if slower:
            where = "in every case" if len(slower) == len(cases) else "at " + ", ".join(slower)
            out += ["", f"syncbn_dist is slower than plain BatchNorm plus the same all_reduces {where}."]
    steps = [
        (run["world_size"], run["variants"])
        for scenario in summary["scenarios"].values()
        for run in scenario["runs"]
        if {"bn", "syncbn_dist", "floor"} <= set(run["variants"])
    ]
    if steps:
        over_floor = [v["syncbn_dist"]["median_ms"] / v["floor"]["median_ms"] for _, v in steps]
        over_plain = [v["syncbn_dist"]["median_ms"] / v["bn"]["median_ms"] for _, v in steps]
        sizes = " and ".join(str(w) for w in sorted({w for w, _ in steps}))
        out += [
            "",
            f"Whole DDP training steps ({_count(len(summary['scenarios']), 'model configuration')} on {sizes} "
            "processes): "
            f"syncbn_dist's step takes {_span(over_floor)} the step of plain BatchNorm plus the same all_reduces, "
            f"and {_span(over_plain)} plain BatchNorm's.",
        ]
    return "\n".join(out) + "\n"


# The ResNet-50 step's rows in the README: (how it runs, plain's variant, syncbn_dist's variant, torch's or None).
_STEP_ROWS = (
    ("eager, native kernels", "plain", "syncbn_dist_native", "torch_function"),
    ("torch.compile", "plain_compile", "syncbn_dist_compile", None),
    ('torch.compile "reduce-overhead" (CUDA graphs)', "plain_reduce_overhead", "syncbn_dist_reduce_overhead", None),
)


def readme_gpu_section(layer: Optional[dict[str, Any]], step: Optional[dict[str, Any]]) -> str:
    """The README's generated ``gpu table`` section: the ResNet-50 training step (the record of
    :mod:`launch.bench.resnet50_step`) against plain BatchNorm and torch.nn.SyncBatchNorm, or that no report of it
    exists; then one layer's range from ``make bench-gpu``'s benchmark summary (``layer``), if there is one."""
    out = []
    if step is None:
        out += [
            "**GPU**: the ResNet-50 training step against plain BatchNorm and torch.nn.SyncBatchNorm has **no "
            "generated report yet** (`make bench-gpu`, stage `step`, writes one); its one run, by hand on an H200, is "
            "in [docs/gpu.md](docs/gpu.md#the-resnet-50-training-step-on-an-h200).",
        ]
    else:
        cfg = step["config"]
        medians = {(row["variant"], row["dtype"]): row["median_ms"] for row in step["rows"]}
        rows = []
        for how, plain, ours, torch_fn in _STEP_ROWS:
            for dtype in STEP_DTYPE_ORDER:
                if (ours, dtype) not in medians:
                    continue
                mine, base = medians[(ours, dtype)], medians.get((plain, dtype))
                theirs = medians.get((torch_fn, dtype)) if torch_fn else None
                ratios = [None if over is None else mine / over for over in (base, theirs)]
                rows.append(
                    [f"{how}, {dtype}", fmt(base, ".1f"), fmt(theirs, ".1f"), fmt(mine, ".1f")]
                    + [fmt(ratio, ".2f") for ratio in ratios]
                )
        out += [
            f"**GPU** (`make bench-gpu`: {step['device']}, torch {step['torch']}; every number: "
            "[docs/performance_cuda_step.md](docs/performance_cuda_step.md)). A ResNet-50 training step ("
            + ("" if cfg["width"] == 64 else f"at width {cfg['width']}, ")
            + "batch "
            f"{cfg['batch_size']}, {cfg['image_size']}×{cfg['image_size']}, channels_last, SGD), ms per step, with "
            "each library's synchronization forced on a one-process NCCL group, as on several GPUs:",
            "",
            *_table(
                ["step", "plain BatchNorm", "torch.nn.SyncBatchNorm", "syncbn_dist", "syncbn_dist / plain",
                 "syncbn_dist / torch.nn.SyncBatchNorm"],
                rows,
            ),
        ]
    cases = [c for c in ((layer or {}).get("micro") or {}).get("cases", []) if _BASELINE in c["median_ms"]]
    if cases:
        machine = layer["machine"]
        over_base = [c["median_ms"]["syncbn_dist"] / c["median_ms"][_BASELINE] for c in cases]
        over_torch = [
            c["median_ms"]["syncbn_dist"] / c["median_ms"][TORCH_FUNCTION]
            for c in cases
            if TORCH_FUNCTION in c["median_ms"]
        ]
        out += [
            "",
            f"One BatchNorm layer, forward + backward, on one {', '.join(machine['cuda_devices'])} with torch "
            f"{machine['torch']} ([docs/performance_cuda.md](docs/performance_cuda.md), "
            f"{_count(len(cases), 'case')} of shape, dtype and layout): syncbn_dist takes {_span(over_base)} plain "
            "BatchNorm plus the same all_reduces"
            + (f" and {_span(over_torch)} torch.nn.SyncBatchNorm's function" if over_torch else "")
            + ".",
        ]
    return "\n".join(out) + "\n"


def _why_no_steps(summary: dict[str, Any], skipped: list[str]) -> str:
    """Why a report has no training-step table, in place of three empty ones."""
    if skipped:
        gpus = len(summary["machine"]["cuda_devices"])
        return (
            f"every scenario's world size was skipped ({', '.join(skipped)}): NCCL needs one GPU per rank, and "
            f"this machine has {_count(gpus, 'GPU')}."
        )
    why = "no training-step scenario was asked for (`scenarios=[]`)"
    if on_gpu(summary):
        why += (
            ": `make bench-gpu` runs the DDP scenarios nowhere, since NCCL needs one GPU per rank; its ResNet-50 "
            "training step is the report of `python -m launch.bench.resnet50_step` (stage step)"
        )
    return why + "."


def _step_sections(summary: dict[str, Any]) -> list[str]:
    """The DDP training-step sections: step times against the in-step floor, every variant's counts, peak memory."""
    out = [
        "## Training step: syncbn_dist against the in-step synchronization floor",
        "",
        "Median ms per DDP training step over interleaved rounds (slowest rank). (a) plain BatchNorm, (b) "
        "syncbn_dist, (f) plain BatchNorm plus the same two collectives per layer (dummy payloads, through "
        "autograd): the in-step floor, (c) naive SyncBN. P1 = ((b)-(a)) / ((f)-(a)). Back-to-back floor: Σ over "
        "(b)'s collectives of the median latency of back-to-back all_reduces of that payload, same group, same run. "
        "(b)/(f): syncbn_dist's step over the floor's, which sends the same collectives (tags included), with the "
        "median of the rounds' paired differences (b)-(f) and its 95% bootstrap interval: what syncbn_dist adds beyond "
        "its collectives (the statistics, the tags' checks).",
        "",
    ]
    rows = []
    for name, scenario in summary["scenarios"].items():
        for run in scenario["runs"]:
            a, b, f, c = (_median(run, v) for v in ("bn", "syncbn_dist", "floor", "naive"))
            b2b = run.get("floor_ms")
            rows.append(
                [name, str(run["world_size"]), run["backend"], fmt(a), fmt(b), fmt(f), fmt(c)]
                + [
                    fmt(run.get("overhead_ms")),
                    fmt(run.get("in_step_floor_ms")),
                    fmt(run.get("overhead_over_in_step_floor"), ".2f"),
                    fmt(b2b),
                    fmt(run.get("overhead_over_floor"), ".2f"),
                    fmt(None if b is None or c is None else b / c, ".2f"),
                    _ratio_with_paired_ci(
                        run.get("over_same_collectives"), run.get("minus_same_collectives_paired_ms")
                    ),
                ]
            )
    out += _table(
        [
            "config",
            "W",
            "backend",
            "(a)",
            "(b)",
            "(f)",
            "(c)",
            "(b)-(a)",
            "(f)-(a)",
            "P1",
            "b2b floor",
            "(b)-(a) / b2b",
            "(b)/(c)",
            "(b)/(f) [paired (b)-(f) ms, 95% CI]",
        ],
        rows,
    )
    out.append("")
    out += [_model_line(name, s["config"], s["runs"]) for name, s in summary["scenarios"].items()]
    skipped = [f"{name} W={w}" for name, s in summary["scenarios"].items() for w in s["skipped_world_sizes"]]
    if skipped:
        out += ["", f"Skipped (nccl needs one GPU per rank): {', '.join(skipped)}."]
    if not on_gpu(summary) and summary["config"].get("plot"):  # run.py writes the plot beside this report
        out += ["", "![median step time by variant and world size, one panel per scenario](performance.png)"]
    out += [
        "",
        "## Every variant: step time, aten ops, collectives, compilation",
        "",
        "aten ops: dispatched per training step (forward, backward, optimizer; launch/common/counting.py's OpCounter): "
        "on a GPU each is a kernel launch or host work. n/c: not counted for compiled variants: Dynamo skips a frame "
        "it meets under a dispatch mode (the counter) for good, so one counted step would leave the compiled model "
        "eager for the timed rounds. Compiled: `torch.compile` of the DDP model "
        "(the scenario's compile_backend, inductor in make bench), compiled in warm-up (compile s, slowest rank). "
        "Collectives: counted by wrapping "
        "torch.distributed (DDP's gradient buckets run in C++ and are not counted). Graph breaks: counted by dynamo "
        "during the variant's warm-up; a frame an earlier compiled variant already met (DDP's own) is not counted "
        "again, so a later variant shows only breaks in its own code. n/a: torch.nn.SyncBatchNorm needs CUDA "
        "tensors.",
        "",
    ]
    rows = []
    for name, scenario in summary["scenarios"].items():
        for run in scenario["runs"]:
            for variant, entry in run["variants"].items():
                c = entry["collectives"]
                match = entry.get("collectives_match_expected")
                rows.append(
                    [
                        name,
                        str(run["world_size"]),
                        LABELS[variant],
                        fmt(entry["median_ms"]),
                        f"{fmt(entry['q1_ms'])}–{fmt(entry['q3_ms'])}",
                        fmt(entry["ratio_to_bn"], ".2f"),
                        "n/c" if variant.endswith(COMPILED_SUFFIX) else str(entry["ops_per_step"]),
                        f"{c['forward']['count']} × {c['forward']['bytes']} {','.join(c['forward']['dtypes'])}",
                        f"{c['backward']['count']} × {c['backward']['bytes']} {','.join(c['backward']['dtypes'])}",
                        str(c["all_gather_calls"]),
                        "–" if match is None else ("yes" if match else "NO"),
                        fmt(entry["compile_seconds"], ".0f"),
                        "–" if entry["graph_breaks"] is None else str(entry["graph_breaks"]),
                    ]
                )
            for variant in run["skipped_variants"]:
                rows.append([name, str(run["world_size"]), LABELS[variant]] + ["n/a"] * 10)
    out += _table(
        [
            "config",
            "W",
            "variant",
            "median ms",
            "IQR ms",
            "/(a)",
            "aten ops",
            "forward: calls × bytes",
            "backward: calls × bytes",
            "all_gather",
            "= design (2C+6)·8 each way",
            "compile s",
            "graph breaks",
        ],
        rows,
    )
    out += ["", "## Peak memory (MiB, max over ranks)", ""]
    rows = []
    for name, scenario in summary["scenarios"].items():
        for run in scenario["runs"]:
            for variant, entry in run["variants"].items():
                m = entry["memory"]
                rows.append(
                    [
                        name,
                        str(run["world_size"]),
                        LABELS[variant],
                        fmt(m["rss_peak_mib"], ".1f"),
                        fmt(m["rss_step_mib"], ".1f"),
                        fmt(m["alloc_step_mib"], ".2f"),
                        fmt(m["cuda_max_allocated_mib"], ".2f"),
                    ]
                )
    out += _table(
        ["config", "W", "variant", "peak RSS", "RSS rise in step", "tensor peak in step", "cuda max allocated"], rows
    )
    out += [
        "",
        "peak RSS: VmHWM during the variant's steps after resetting it (/proc/self/clear_refs); tensor peak: the "
        "profiler's running total of bytes allocated during one step (CPU), or max_memory_allocated minus the "
        "bytes allocated before the step (CUDA).",
    ]
    return out


def markdown(summary: dict[str, Any]) -> str:
    """The report: step times, floors and overhead, ops, collectives, memory, microbenchmark, targets."""
    machine = summary["machine"]
    gpu = on_gpu(summary)
    devices = ", ".join(machine["cuda_devices"])
    out = [
        f"# syncbn_dist performance on a GPU ({devices})" if gpu else "# syncbn_dist performance on CPU",
        "",
        ("Generated by `make bench-gpu` (launch/bench/gpu.sh, stage micro)" if gpu else "Generated by `make bench`")
        + "; the only copy of these numbers. "
        f"`{shown_command(summary['command'])}` on {machine['cpu']} ({machine['nproc']} CPUs), "
        f"torch {machine['torch']}, Python {machine['python']}"
        + (f", GPUs: {', '.join(machine['cuda_devices'])}" if machine["cuda_devices"] else ", no GPU")
        + f". Load average at start {fmt(machine.get('loadavg_start', [None])[0], '.2f')}; "
        f"bench took {machine.get('bench_seconds')} s.",
        "",
        "## Targets",
        "",
    ]
    rows = [
        [
            t["id"],
            t["description"],
            fmt(t["measured"]),
            fmt(t["bound"], "g"),
            {True: "pass", False: "MISS", None: "–"}[t["passed"]],
            t["detail"],
        ]
        for t in summary["targets"]
    ]
    out += _table(["target", "what", "measured", "bound", "status", "detail"], rows)
    runs = [run for scenario in summary["scenarios"].values() for run in scenario["runs"]]
    skipped = [f"{name} W={w}" for name, s in summary["scenarios"].items() for w in s["skipped_world_sizes"]]
    if runs:
        out += [""] + _step_sections(summary)
    else:
        out += ["", "## Training steps", "", "Not measured in this run: " + _why_no_steps(summary, skipped)]
    micro = summary["micro"]
    if micro:
        fns = list(dict.fromkeys(f for c in micro["cases"] for f in c["median_ms"]))
        out += [
            "",
            f"## Microbenchmark: one layer forward+backward ({micro['device']}"
            + (")" if gpu else f", {_count(micro['threads'], 'intra-op thread')})"),
            "",
        ]
        moved = list(dict.fromkeys(f for c in micro["cases"] for f in c.get("bytes_per_element", {})))
        rows = [
            [str(tuple(c["shape"])), c["dtype"], c["memory_format"]]
            + [f"{fmt(c['median_ms'][f])} ({c['ops'].get(f, '–')})" if f in c["median_ms"] else "–" for f in fns]
            + [fmt(c["ratio"], ".2f")]
            + [fmt(c.get("bytes_per_element", {}).get(f), ".1f") for f in moved]
            for c in micro["cases"]
        ]
        out += _table(
            ["shape", "dtype", "format"]
            + [f"{f} ms (aten ops)" for f in fns]
            + ["syncbn_dist / F.batch_norm"]
            + [f"{f} B/elem" for f in moved],
            rows,
        )
        out += [
            "",
            "Median ms of one forward+backward; in brackets the aten ops it dispatches (OpCounter). syncbn_dist is "
            "forced through its synchronized path on a one-member process group. B/elem: bytes per activation "
            "element at the op interface for forward + backward (BytesCounter: the storage each tensor argument "
            "and result of every dispatched op spans; views 0; non-leaf input, autograd.grad for input, weight "
            "and bias); a kernel's internal passes are not seen (CPU native_batch_norm reads x twice). The torch "
            "SyncBatchNorm CUDA column is a model, not a measurement: its four kernels touch each element 8 times "
            "(launch/bench/micro.py). F.batch_norm + collectives: F.batch_norm plus syncbn_dist's two collectives "
            "(dummy payloads), the floor of any synchronized BatchNorm.",
        ]
        if micro.get("glibc_tunables"):
            out += [
                "",
                f"The worker ran with `GLIBC_TUNABLES={micro['glibc_tunables']}` (micro.glibc_tunables), so that no "
                "variant's outputs are refilled by page faults: with glibc's defaults the freed top of the heap goes "
                "back to the OS on some calls and not others, which swung F.batch_norm's time up to 2x between runs.",
            ]
        beside_torch = any(TORCH_FUNCTION in c["median_ms"] for c in micro["cases"])
        rows = [
            [str(tuple(c["shape"])), c["dtype"], c["memory_format"],
             fmt(_ratio(c["median_ms"], "syncbn_dist", _BASELINE), ".2f")]
            + ([fmt(_ratio(c["median_ms"], "syncbn_dist", TORCH_FUNCTION), ".2f")] if beside_torch else [])
            for c in micro["cases"] if _BASELINE in c["median_ms"]
        ]
        out += ["", "### syncbn_dist against F.batch_norm + the same collectives", ""]
        out += _table(
            ["shape", "dtype", "format", "syncbn_dist / (F.batch_norm + collectives)"]
            + (["syncbn_dist / torch SyncBatchNorm fn"] if beside_torch else []),
            rows,
        )
        if micro["device"] == "cpu":
            out += [
                "",
                "`make bench-gpu` runs this benchmark on CUDA with `device=cuda`, beside torch.nn.SyncBatchNorm's CUDA "
                "kernels, into docs/performance_cuda.md; what has run on a GPU, and when: docs/gpu.md.",
            ]
    return "\n".join(out) + "\n"


def plot(summary: dict[str, Any], path: str) -> None:
    """Bar chart of median step time by variant and world size (IQR whiskers), one panel per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = summary["scenarios"]
    fig, axes = plt.subplots(1, max(len(scenarios), 1), figsize=(6 * max(len(scenarios), 1), 4.2), squeeze=False)
    for ax, (name, scenario) in zip(axes[0], scenarios.items()):
        runs = scenario["runs"]
        names = [n for n in LABELS if any(n in r["variants"] for r in runs)]
        width = 0.8 / max(len(names), 1)
        for i, variant in enumerate(names):
            xs, ys, lo, hi = [], [], [], []
            for j, run in enumerate(runs):
                if variant in run["variants"]:
                    entry = run["variants"][variant]
                    xs.append(j + (i - (len(names) - 1) / 2) * width)
                    ys.append(entry["median_ms"])
                    lo.append(entry["median_ms"] - entry["q1_ms"])
                    hi.append(entry["q3_ms"] - entry["median_ms"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=LABELS[variant])
        for j, run in enumerate(runs):
            if run.get("floor_ms") is not None and "bn" in run["variants"]:
                base = run["variants"]["bn"]["median_ms"]
                ax.hlines(
                    base + run["floor_ms"],
                    j - 0.45,
                    j + 0.45,
                    colors="black",
                    linestyles="dashed",
                    label="(a) + back-to-back floor" if j == 0 else None,
                )
        cfg = scenario["config"]
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([f"W={r['world_size']}\n{r['backend']}" for r in runs])
        ax.set_ylabel("training step, median ms")
        layers = len(batchnorm_channels(cfg))
        ax.set_title(f"{name}: {cfg['model']} width {cfg['width']}, {layers} BN layers, batch {cfg['batch_size']}/rank")
        if names:
            ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)
