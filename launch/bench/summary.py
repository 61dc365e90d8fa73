"""Turn the benchmark workers' raw measurements into medians, ratios and targets (:func:`summarize`), the data
that performance.json holds and :mod:`launch.bench.report` renders.

Targets (from the benchmark issues; reported, never asserted by tests):

- P1: (b) - (a) <= 1.05 x ((f) - (a)): syncbn_dist costs at most 5% more than plain BatchNorm plus the same
  collectives (the in-step synchronization floor), judged on the compute-bound config and listed for every run.
- P2: retired. It asked (b) <= 0.8 x (c), but the naive SyncBN pays the same synchronization points, which
  dominate a step at small per-rank batches; P1 against the in-step floor measures what P2 was after.
- P3: peak memory (b) <= 1.05 x (a) (peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA).
- P4: bytes per collective identical at every world size; no all_gather-type collective.
- P5: SyncBN on DDP's group no slower than on a dedicated group (if the dedicated group wins, it should be the
  default).
- P6: single-layer forward+backward of the sync path <= 1.5 x ``F.batch_norm`` at every shape and dtype.
- P7: compiled syncbn_dist step <= eager syncbn_dist step (``torch.compile`` of the DDP model, inductor).
- P8: single-layer forward+backward of the sync path moves at most the bytes per activation element of
  torch.nn.SyncBatchNorm's CUDA kernel sequence (32 for float32), at every shape, dtype and layout of the
  microbenchmark (bytes at the op interface, :class:`launch.common.counting.BytesCounter`).
- K2: P1 on the compute scenario <= 1.0.
"""

from __future__ import annotations

import json
import random
import statistics
from typing import Any, Optional

from launch.bench.models import COMPILED_SUFFIX, LABELS

P1_BOUND = 1.05
P3_BOUND = 1.05
P5_BOUND = 1.02  # (b) on DDP's group / (b') on a dedicated group; above this the dedicated group wins
P6_BOUND = 1.5
P7_BOUND = 1.0
K2_BOUND = 1.0
_ALL_GATHER_OPS = ("all_gather", "all_gather_into_tensor", "all_to_all")
# The variants whose collectives must be syncbn_dist's design (the floor sends the same ones, dummy payloads).
_SYNCBN_VARIANTS = ("syncbn_dist", "syncbn_dist_dedicated", "floor", "syncbn_dist_compiled", "floor_compiled")
_BOOTSTRAP_SAMPLES = 2000


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, statistics.median(values), q3


def _paired_difference(first: list[float], second: list[float]) -> dict[str, float]:
    """Median of the per-round differences ``second - first`` with a 95% bootstrap interval (fixed seed).

    Both lists come from the same interleaved rounds, so pairing by round cancels drift common to a round.
    """
    diffs = [b - a for a, b in zip(first, second)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(_BOOTSTRAP_SAMPLES))
    return {
        "median": statistics.median(diffs),
        "ci95_low": medians[int(0.025 * _BOOTSTRAP_SAMPLES)],
        "ci95_high": medians[int(0.975 * _BOOTSTRAP_SAMPLES) - 1],
    }


def _collective_summary(calls: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for phase in ("forward", "backward"):
        mine = [c for c in calls if c["phase"] == phase]
        summary[phase] = {
            "count": len(mine),
            "bytes": sorted({c["bytes"] for c in mine}),
            "ops": sorted({c["op"] for c in mine}),
            "dtypes": sorted({str(c["dtype"]) for c in mine}),
            "groups": sorted({c["group"] for c in mine}),
        }
    summary["all_gather_calls"] = sum(c["op"] in _ALL_GATHER_OPS for c in calls)
    summary["sequence"] = [[c["phase"], c["op"], c["bytes"]] for c in calls]
    return summary


def batchnorm_channels(scenario: dict[str, Any]) -> list[int]:
    """The channel count of every BatchNorm layer of the scenario's network, in forward order."""
    width = scenario["width"]
    if scenario["model"] == "convbn":
        return [width] * scenario["num_layers"]
    channels = [width]  # resnet18: the stem, then per stage two blocks of two BNs, a shortcut BN where it downsamples
    for stage in range(4):
        out = width * 2**stage
        channels += [out, out] + ([out] if stage > 0 else []) + [out, out]
    return channels


def _expected_collectives(scenario: dict[str, Any]) -> dict[str, Any]:
    """syncbn_dist's design: per layer one all_reduce of 2C + 6 float64 values in each direction (the statistics, the
    backward's padded to the forward's size, then the collective's tag)."""
    channels = batchnorm_channels(scenario)
    sizes = sorted({(2 * c + 6) * 8 for c in channels})
    return {"forward": {"count": len(channels), "bytes": sizes}, "backward": {"count": len(channels), "bytes": sizes}}


def _matches(counted: dict[str, Any], expected: dict[str, Any]) -> bool:
    return all(
        counted[phase]["count"] == expected[phase]["count"]
        and counted[phase]["bytes"] == expected[phase]["bytes"]
        and counted[phase]["ops"] == ["all_reduce"]
        and counted[phase]["dtypes"] == ["float64"]
        for phase in ("forward", "backward")
    )


def _summarize_run(run: dict[str, Any], scenario: dict[str, Any]) -> dict[str, Any]:
    variants: dict[str, Any] = {}
    medians: dict[str, float] = {}
    for name in run["variants"]:
        seconds = run["step_seconds"][name]
        q1, median, q3 = _quantiles(seconds)
        medians[name] = median
        variants[name] = {
            "label": LABELS[name],
            "median_ms": 1e3 * median,
            "q1_ms": 1e3 * q1,
            "q3_ms": 1e3 * q3,
            "rounds": len(seconds),
            "memory": run["memory"][name],
            "collectives": _collective_summary(run["collectives"][name]),
            "ops_per_step": run["ops_per_step"][name],
            "compile_seconds": run["compile_seconds"].get(name),
            "graph_breaks": run["graph_breaks"].get(name),
        }
    for name, entry in variants.items():
        entry["ratio_to_bn"] = medians[name] / medians["bn"] if "bn" in medians else None

    floor_s = None
    floor_detail = []
    for probe in run["floor_probes"]:
        latency = statistics.median(probe["seconds"])
        floor_detail.append({**{k: probe[k] for k in ("bytes", "dtype", "per_step")}, "median_us": 1e6 * latency})
        floor_s = (floor_s or 0.0) + latency * probe["per_step"]
    result: dict[str, Any] = {
        "world_size": run["world_size"],
        "wall_seconds": run.get("wall_seconds"),
        "stage_seconds": run["stage_seconds"],
        "backend": run["backend"],
        "device": run["device"],
        "skipped_variants": run["skipped_variants"],
        "variants": variants,
        "floor_ms": None if floor_s is None else 1e3 * floor_s,
        "floor_detail": floor_detail,
        "expected_collectives": _expected_collectives(scenario),
        "profiles": run["profiles"],
        "step_ms_by_round": {name: [1e3 * s for s in run["step_seconds"][name]] for name in run["variants"]},
    }
    for name in _SYNCBN_VARIANTS:
        if name in variants:
            variants[name]["collectives_match_expected"] = _matches(
                variants[name]["collectives"], result["expected_collectives"]
            )
    if "syncbn_dist" in medians and "syncbn_dist_dedicated" in medians:
        paired = _paired_difference(run["step_seconds"]["syncbn_dist_dedicated"], run["step_seconds"]["syncbn_dist"])
        result["shared_minus_dedicated_paired_ms"] = {key: 1e3 * value for key, value in paired.items()}
    if "bn" in medians and "syncbn_dist" in medians:
        result["overhead_ms"] = 1e3 * (medians["syncbn_dist"] - medians["bn"])
        paired = _paired_difference(run["step_seconds"]["bn"], run["step_seconds"]["syncbn_dist"])
        result["overhead_paired_ms"] = {key: 1e3 * value for key, value in paired.items()}
        result["overhead_over_floor"] = result["overhead_ms"] / result["floor_ms"] if result["floor_ms"] else None
    if {"bn", "syncbn_dist", "floor"} <= set(medians):
        result["in_step_floor_ms"] = 1e3 * (medians["floor"] - medians["bn"])
        paired = _paired_difference(run["step_seconds"]["bn"], run["step_seconds"]["floor"])
        result["in_step_floor_paired_ms"] = {key: 1e3 * value for key, value in paired.items()}
        # P1's ratio; above 0 only if the collectives cost anything (they do: W >= 2, every layer waits)
        result["overhead_over_in_step_floor"] = (
            result["overhead_ms"] / result["in_step_floor_ms"] if result["in_step_floor_ms"] > 0 else None
        )
        # The step against plain BatchNorm plus the same collectives: what syncbn_dist adds beyond its collectives
        # (the statistics, the collective tags and their checks), paired by round.
        result["over_same_collectives"] = medians["syncbn_dist"] / medians["floor"]
        paired = _paired_difference(run["step_seconds"]["floor"], run["step_seconds"]["syncbn_dist"])
        result["minus_same_collectives_paired_ms"] = {key: 1e3 * value for key, value in paired.items()}
    if {"syncbn_dist", "syncbn_dist_debug"} <= set(medians):
        # What checking every collective (debug mode) costs a step: the price of catching any later mismatch.
        result["debug_over_default"] = medians["syncbn_dist_debug"] / medians["syncbn_dist"]
        paired = _paired_difference(run["step_seconds"]["syncbn_dist"], run["step_seconds"]["syncbn_dist_debug"])
        result["debug_minus_default_paired_ms"] = {key: 1e3 * value for key, value in paired.items()}
    if {"syncbn_dist", "syncbn_dist" + COMPILED_SUFFIX} <= set(medians):
        result["compiled_over_eager"] = medians["syncbn_dist" + COMPILED_SUFFIX] / medians["syncbn_dist"]
    return result


def _target(
    tid: str, description: str, measured: Optional[float], bound: Optional[float], passed: Optional[bool], detail: str
) -> dict[str, Any]:
    return {
        "id": tid,
        "description": description,
        "measured": measured,
        "bound": bound,
        "passed": passed,
        "detail": detail,
    }


def _targets(scenarios: dict[str, Any], micro: Optional[dict[str, Any]], compute: str) -> list[dict[str, Any]]:
    targets = []
    compute_run = scenarios[compute]["runs"][0] if compute in scenarios and scenarios[compute]["runs"] else None
    where = f"{compute}, W={compute_run['world_size']}" if compute_run else compute

    ratio = compute_run.get("overhead_over_in_step_floor") if compute_run else None
    compute_p1 = ratio
    details = []
    for name, scenario in scenarios.items():
        for run in scenario["runs"]:
            if run.get("in_step_floor_ms") is not None:
                value = run.get("overhead_over_in_step_floor")
                details.append(
                    f"{name} W={run['world_size']}: (b)-(a) {run['overhead_ms']:.2f} ms, (f)-(a) "
                    f"{run['in_step_floor_ms']:.2f} ms, ratio {fmt(value, '.2f')}"
                )
    targets.append(
        _target(
            "P1",
            f"(b)-(a) <= 1.05 x ((f)-(a)), the in-step floor ({where})",
            ratio,
            P1_BOUND,
            _le(ratio, P1_BOUND),
            "; ".join(details) or "not measured",
        )
    )
    targets.append(
        _target(
            "P2",
            "retired: (b) <= 0.8 x (c) compared two variants that pay the same synchronization points",
            None,
            None,
            None,
            "see P1; (b)/(c) is still in the step-time table",
        )
    )

    worst, detail, strict = None, "not measured", []
    for name, scenario in scenarios.items():
        for run in scenario["runs"]:
            variants = run["variants"]
            if not {"bn", "syncbn_dist"} <= set(variants):
                continue
            a, b = variants["bn"]["memory"], variants["syncbn_dist"]["memory"]
            key = "cuda_max_allocated_mib" if a.get("cuda_max_allocated_mib") is not None else "rss_peak_mib"
            ratio = b[key] / a[key]
            if worst is None or ratio > worst:
                worst, detail = ratio, f"{name}, W={run['world_size']}: {key} (b) {b[key]:.1f} / (a) {a[key]:.1f} MiB"
            if a.get("alloc_step_mib"):
                strict.append(f"{name} W={run['world_size']} {b['alloc_step_mib'] / a['alloc_step_mib']:.3f}")
    if strict:
        detail += "; tensor memory allocated within a step, (b)/(a): " + ", ".join(strict)
    targets.append(_target("P3", "peak memory (b) <= 1.05 x (a)", worst, P3_BOUND, _le(worst, P3_BOUND), detail))

    sequences: dict[str, dict[int, str]] = {}
    all_gathers = 0
    for name, scenario in scenarios.items():
        for run in scenario["runs"]:
            if "syncbn_dist" in run["variants"]:
                counted = run["variants"]["syncbn_dist"]["collectives"]
                sequences.setdefault(name, {})[run["world_size"]] = json.dumps(counted["sequence"])
                all_gathers += counted["all_gather_calls"]
    multi = {name: seqs for name, seqs in sequences.items() if len(seqs) > 1}
    distinct = max((len(set(seqs.values())) for seqs in multi.values()), default=None)
    detail = "; ".join(
        f"{name} W={sorted(seqs)}: {len(set(seqs.values()))} distinct sequence(s) of (phase, op, bytes)"
        for name, seqs in multi.items()
    )
    detail = (detail or "needs more than one world size") + f"; all_gather-type calls: {all_gathers}"
    passed = None if distinct is None else distinct == 1 and all_gathers == 0
    targets.append(
        _target(
            "P4",
            "bytes per collective identical at every W (distinct patterns), no all_gather",
            distinct,
            1,
            passed,
            detail,
        )
    )

    ratios = []
    for name, scenario in scenarios.items():
        for run in scenario["runs"]:
            if {"syncbn_dist", "syncbn_dist_dedicated"} <= set(run["variants"]):
                shared = run["variants"]["syncbn_dist"]["median_ms"]
                dedicated = run["variants"]["syncbn_dist_dedicated"]["median_ms"]
                paired = run["shared_minus_dedicated_paired_ms"]
                ratios.append((name, run["world_size"], shared / dedicated, paired))
    compute_ratio = next((r for n, w, r, _ in ratios if n == compute), None)
    detail = (
        "; ".join(
            f"{n} W={w}: {r:.3f} (paired (b)-(b') {p['median']:.3f} ms, 95% CI [{p['ci95_low']:.3f}, "
            f"{p['ci95_high']:.3f}])"
            for n, w, r, p in ratios
        )
        or "not measured"
    )
    targets.append(
        _target(
            "P5",
            "(b) on DDP's group / (b') on a dedicated group <= 1.02 (else the dedicated group should be the default)",
            compute_ratio,
            P5_BOUND,
            _le(compute_ratio, P5_BOUND),
            detail,
        )
    )

    worst, detail = None, "not measured"
    if micro and micro["cases"]:
        case = max(micro["cases"], key=lambda c: c["ratio"])
        worst = case["ratio"]
        detail = f"worst: {tuple(case['shape'])} {case['dtype']} {case['memory_format']} on {micro['device']}"
    targets.append(
        _target(
            "P6",
            "sync path fwd+bwd <= 1.5 x F.batch_norm, every shape and dtype",
            worst,
            P6_BOUND,
            _le(worst, P6_BOUND),
            detail,
        )
    )

    worst, details = None, []
    for name, scenario in scenarios.items():
        for run in scenario["runs"]:
            value = run.get("compiled_over_eager")
            if value is not None:
                details.append(f"{name} W={run['world_size']}: {value:.2f}")
                worst = value if worst is None else max(worst, value)
    targets.append(
        _target(
            "P7",
            "compiled syncbn_dist step <= eager syncbn_dist step (worst run)",
            worst,
            P7_BOUND,
            _le(worst, P7_BOUND),
            "; ".join(details) or "not measured",
        )
    )

    worst, detail = None, "not measured"
    if micro and micro["cases"]:
        case = max(micro["cases"], key=_bytes_over_model)
        worst = _bytes_over_model(case)
        mine = case["bytes_per_element"]["syncbn_dist"]
        detail = (
            f"worst: {tuple(case['shape'])} {case['dtype']} {case['memory_format']}: {mine:g} B/elem "
            f"(F.batch_norm {case['bytes_per_element']['F.batch_norm']:g}, model {_model_bytes(case):g})"
        )
    targets.append(
        _target(
            "P8",
            "sync path fwd+bwd bytes/elem / torch.nn.SyncBatchNorm's CUDA sequence (32 B float32) <= 1, every case",
            worst,
            1.0,
            _le(worst, 1.0),
            detail,
        )
    )

    targets.append(
        _target(
            "K2",
            "P1 <= 1.0 (compute-heavy step against the in-step floor)",
            compute_p1,
            K2_BOUND,
            _le(compute_p1, K2_BOUND),
            where,
        )
    )
    return targets


def _model_bytes(case: dict[str, Any]) -> float:
    return next(v for k, v in case["bytes_per_element"].items() if k.startswith("torch SyncBatchNorm CUDA"))


def _bytes_over_model(case: dict[str, Any]) -> float:
    """syncbn_dist's bytes per element over the modelled torch.nn.SyncBatchNorm CUDA sequence's (P8)."""
    return case["bytes_per_element"]["syncbn_dist"] / _model_bytes(case)


def _le(value: Optional[float], bound: float) -> Optional[bool]:
    return None if value is None else value <= bound


def summarize(
    raw_scenarios: list[dict[str, Any]],
    micro: Optional[dict[str, Any]],
    machine: dict[str, Any],
    command: str,
    config: dict[str, Any],
    compute_scenario: str,
) -> dict[str, Any]:
    """Everything the report shows, as JSON-ready data (see the module docstring for the targets)."""
    scenarios = {}
    for raw in raw_scenarios:
        scenario = raw["config"]
        scenarios[scenario["name"]] = {
            "config": scenario,
            "runs": [_summarize_run(run, scenario) for run in raw["runs"]],
            "skipped_world_sizes": raw.get("skipped_world_sizes", []),
        }
    return {
        "command": command,
        "machine": machine,
        "config": config,
        "scenarios": scenarios,
        "micro": micro,
        "targets": _targets(scenarios, micro, compute_scenario),
    }


def fmt(value: Optional[float], spec: str = ".3f") -> str:
    """``value`` formatted with ``spec``, or an en dash for a value not measured."""
    return "–" if value is None else format(value, spec)
