"""The syncbn_dist benchmark: DDP training-step time per BatchNorm variant against the in-step synchronization
floor, compiled variants, aten ops and collectives per step, memory, and the one-layer microbenchmark.

Commands::

    make bench                                               # = the line below, CPU, under 10 minutes
    .venv/bin/python -m launch.bench.run --config configs/bench.yaml
    .venv/bin/python -m launch.bench.run --config configs/bench.yaml scenario.rounds=5 micro.enabled=false
    .venv/bin/python -m launch.bench.run --config configs/bench.yaml scenarios=[bench_compute.yaml]
    .venv/bin/python -m launch.bench.run --config configs/bench.yaml device=cuda output_dir=outputs/bench_gpu

``key=value`` overrides set config keys (dotted for nested ones; values are YAML); ``scenario.KEY=value``
sets KEY in every scenario file; ``device=cuda`` (or ``cpu``) sets the device of every scenario and of the
microbenchmark. It spawns its own worker processes (gloo on CPU, nccl when every rank has its own GPU) for
each scenario and world size; on CUDA, world sizes above the GPU count are skipped and listed as skipped. It
writes ``performance.json`` (every measurement and the resolved config), ``performance.md`` (also printed)
and ``performance.png`` to ``output_dir`` (``docs/`` for ``make bench``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import yaml

from launch.bench.micro import micro_worker
from launch.bench.models import COMPILED_SUFFIX, MODELS, VARIANTS
from launch.bench.spawn import launch, pick_backend
from launch.bench.step import step_worker
from launch.bench.summary import markdown, plot, summarize, write_json


@dataclass
class ScenarioConfig:
    """One model/batch setting, measured at each of ``world_sizes`` (a bench_*.yaml scenario file)."""

    name: str = "latency"
    model: str = "convbn"  # "convbn": BenchNet (num_layers x conv->BN->ReLU); "resnet18": ResNetBench
    world_sizes: list[int] = field(default_factory=lambda: [2, 4, 8])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    device: str = "auto"  # "auto": nccl if every rank gets a GPU, else gloo on CPU; "cpu"; "cuda"
    threads: int = 1  # intra-op threads per rank
    width: int = 16  # resnet18: the first stage's width (then 2x, 4x, 8x)
    num_layers: int = 4  # convbn only
    in_channels: int = 3
    image_size: int = 8
    batch_size: int = 8  # per rank
    num_classes: int = 10
    broadcast_buffers: bool = True  # DDP's default
    # DDP bucket size; None: DDP's default (1 MiB first bucket, then 25 MiB).
    bucket_cap_mb: Optional[float] = None
    seed: int = 0
    warmup_steps: int = 3
    rounds: int = 30  # at most; fewer if round_budget_s runs out first
    min_rounds: int = 5
    round_budget_s: float = 60.0  # per world size: no new round starts after this many seconds of rounds
    steps_per_round: int = 1
    # World sizes at which the ``_compiled`` variants run (compiling takes minutes on a small CPU); [] for all.
    compile_world_sizes: list[int] = field(default_factory=list)
    compile_backend: str = "inductor"  # torch.compile backend of the _compiled variants
    floor_repeats: int = 20
    memory_steps: int = 2
    profile: bool = True
    profile_top: int = 10
    timeout_s: float = 300.0


@dataclass
class MicroConfig:
    """The single-layer microbenchmark (forward+backward, one-member group)."""

    enabled: bool = True
    device: str = "auto"
    threads: int = 1
    shapes: list[list[int]] = field(default_factory=lambda: [[32, 64, 28, 28], [8, 256, 14, 14], [256, 512]])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    memory_formats: list[str] = field(default_factory=lambda: ["contiguous", "channels_last"])
    warmup: int = 3
    repeats: int = 30
    profile: bool = True
    profile_top: int = 10
    timeout_s: float = 300.0


@dataclass
class BenchConfig:
    """The whole benchmark (configs/bench.yaml)."""

    output_dir: str = "outputs/bench"
    device: str = "auto"  # not "auto": overrides every scenario's and the microbenchmark's device
    # Scenario files, relative to this config file's directory (or to the working directory).
    scenarios: list[str] = field(default_factory=lambda: ["bench_latency.yaml", "bench_compute.yaml"])
    compute_scenario: str = "compute"  # the scenario P1 is judged on
    micro: MicroConfig = field(default_factory=MicroConfig)
    plot: bool = True


def _check_type(value: Any, default: Any, key: str) -> Any:
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, (str, list)):
        ok = isinstance(value, type(default))
    else:
        ok = True
    if not ok:
        raise TypeError(f"config key {key!r}: expected {type(default).__name__} (got {value!r})")
    return value


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, type-checking each value against its default.

    Raises:
        KeyError: naming the first unknown key.
        TypeError: naming the first key whose value has the wrong type.
    """
    if not isinstance(data, dict):
        raise TypeError(f"config {where or 'file'}: expected a mapping (got {data!r})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise KeyError(f"unknown config key {where + unknown[0]!r} (known: {sorted(fields)})")
    defaults = cls()
    values = {}
    for name, value in data.items():
        default = getattr(defaults, name)
        if dataclasses.is_dataclass(default):
            values[name] = from_dict(type(default), value, f"{where}{name}.")
        else:
            values[name] = _check_type(value, default, where + name)
    return cls(**values)


def _apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value


def _parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected an override of the form key=value (got {item!r})")
        parsed.append((key, yaml.safe_load(text)))
    return parsed


def _resolve(path: str, config_dir: str) -> str:
    if os.path.isabs(path):
        return path
    candidate = os.path.join(config_dir, path)
    return candidate if os.path.exists(candidate) else path


def load_config(path: str, overrides: Optional[list[str]] = None) -> tuple[BenchConfig, list[ScenarioConfig]]:
    """Read the bench config at ``path`` and its scenario files, apply ``key=value`` overrides, validate.

    Raises:
        KeyError: on an unknown key (in the file or an override).
        TypeError: on a value of the wrong type.
        ValueError: on a malformed override, an unknown variant, or duplicate scenario names.
    """
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    scenario_overrides = []
    for key, value in _parse_overrides(overrides or []):
        if key.startswith("scenario."):
            scenario_overrides.append((key[len("scenario.") :], value))
        else:
            _apply_override(raw, key, value)
    cfg = from_dict(BenchConfig, raw)
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"expected device 'auto', 'cpu' or 'cuda' (got {cfg.device!r})")
    if cfg.device != "auto":
        cfg.micro.device = cfg.device
        scenario_overrides.append(("device", cfg.device))
    scenarios = []
    for scenario_path in cfg.scenarios:
        resolved = _resolve(scenario_path, os.path.dirname(os.path.abspath(path)))
        with open(resolved) as f:
            scenario_raw = yaml.safe_load(f) or {}
        for key, value in scenario_overrides:
            _apply_override(scenario_raw, key, value)
        scenario = from_dict(ScenarioConfig, scenario_raw, f"{os.path.basename(resolved)}:")
        cap = scenario.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise TypeError(f"config key 'bucket_cap_mb': expected null or a positive number (got {cap!r})")
        compiled = [v for v in scenario.variants if v.endswith(COMPILED_SUFFIX)]
        if compiled and cap is not None and cap < 1.0:
            # dynamo's DDP optimizer asserts that DDP's first bucket (1 MiB) is no larger than the others.
            raise ValueError(
                f"scenario {scenario.name!r}: compiled variants {compiled} need bucket_cap_mb null or >= 1 (got {cap})"
            )
        if scenario.model not in MODELS:
            raise ValueError(f"scenario {scenario.name!r}: unknown model {scenario.model!r} (expected one of {MODELS})")
        bad = [v for v in scenario.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"scenario {scenario.name!r}: unknown variant {bad[0]!r} (expected one of {VARIANTS})")
        scenarios.append(scenario)
    names = [s.name for s in scenarios]
    if len(set(names)) != len(names):
        raise ValueError(f"expected distinct scenario names (got {names})")
    return cfg, scenarios


def _machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": model,
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = list(os.getloadavg())
    return info


def run(cfg: BenchConfig, scenarios: list[ScenarioConfig], command: str) -> dict[str, Any]:
    """Run every scenario at every world size and the microbenchmark; write and return the summary."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    resolved = {**dataclasses.asdict(cfg), "scenario_configs": [dataclasses.asdict(s) for s in scenarios]}

    started = time.perf_counter()
    machine = _machine()
    raw_scenarios = []
    for scenario in scenarios:
        runs = []
        skipped = []
        for world_size in scenario.world_sizes:
            if scenario.device == "cuda" and torch.cuda.device_count() < world_size:
                skipped.append(world_size)  # nccl needs one GPU per rank
                continue
            backend = pick_backend(world_size, scenario.device)
            variants = [
                v
                for v in scenario.variants
                if not v.endswith(COMPILED_SUFFIX)
                or not scenario.compile_world_sizes
                or world_size in scenario.compile_world_sizes
            ]
            print(f"[bench] {scenario.name}: world size {world_size} ({backend}) ...", flush=True)
            launched = time.perf_counter()
            result = launch(
                step_worker,
                world_size,
                {**dataclasses.asdict(scenario), "variants": variants},
                backend=backend,
                threads=scenario.threads,
                timeout_s=scenario.timeout_s,
            )
            runs.append({**result, "wall_seconds": round(time.perf_counter() - launched, 1)})
        raw_scenarios.append({"config": dataclasses.asdict(scenario), "runs": runs, "skipped_world_sizes": skipped})
    micro = None
    if cfg.micro.enabled:
        print("[bench] microbenchmark ...", flush=True)
        micro = launch(
            micro_worker,
            1,
            dataclasses.asdict(cfg.micro),
            backend=pick_backend(1, cfg.micro.device),
            threads=cfg.micro.threads,
            timeout_s=cfg.micro.timeout_s,
        )
    if hasattr(os, "getloadavg"):
        machine["loadavg_end"] = list(os.getloadavg())
    machine["bench_seconds"] = round(time.perf_counter() - started, 1)

    summary = summarize(raw_scenarios, micro, machine, command, resolved, cfg.compute_scenario)
    table = markdown(summary)
    write_json(summary, os.path.join(cfg.output_dir, "performance.json"))
    with open(os.path.join(cfg.output_dir, "performance.md"), "w") as f:
        f.write(table)
    if cfg.plot:
        plot(summary, os.path.join(cfg.output_dir, "performance.png"))
    print(table)
    print(
        f"[bench] wrote {cfg.output_dir}/performance.json, performance.md" + (", performance.png" if cfg.plot else "")
    )
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.yaml", help="the bench YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (scenario.KEY=value for every scenario)")
    args = parser.parse_args(argv)
    cfg, scenarios = load_config(args.config, args.overrides)
    command = " ".join(["python", "-m", "launch.bench.run", "--config", args.config, *args.overrides])
    run(cfg, scenarios, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
