"""The benchmark's typed config: the bench file (:class:`BenchConfig`), its scenario files (:class:`ScenarioConfig`)
and the one-layer microbenchmark (:class:`MicroConfig`), on :mod:`launch.common.config`.

:func:`load_bench` reads ``configs/bench.yaml``-style files and ``KEY=VALUE`` overrides: a dotted key sets a key
of the bench file (``micro.repeats=10``), ``scenario.KEY=VALUE`` sets KEY in every scenario file, and
``device=cpu|cuda`` sets the device of every scenario and of the microbenchmark. Every mistake raises
:class:`~launch.common.config.ConfigError` naming the key (and the scenario file), before any process starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from launch.bench.models import COMPILED_SUFFIX, MODELS, VARIANTS
from launch.common.config import ConfigError, distinct_ints, load_config, non_negative, one_of, positive, ruled
from launch.common.readme import check_readme_key

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float16", "bfloat16", "float32", "float64")
MEMORY_FORMATS = ("contiguous", "channels_last")
_SCENARIO = "scenario."


def _each_of(default: list[str], choices: Sequence[str]) -> Any:
    """A list of strings, each from ``choices``."""
    text = "listing only " + " | ".join(repr(c) for c in choices)
    return ruled(default, text, lambda v: all(item in choices for item in v))


# The README section a run rewrites when ``readme`` is set (launch.common.readme).
README_SECTION = "performance table"


@dataclass
class ScenarioConfig:
    """One model/batch setting, measured at each of ``world_sizes`` (a bench_*.yaml scenario file)."""

    name: str = "latency"
    model: str = one_of("convbn", *MODELS)  # "convbn": BenchNet (num_layers x conv->BN->ReLU); "resnet18": ResNetBench
    world_sizes: list[int] = distinct_ints([2, 4, 8], minimum=1)
    variants: list[str] = _each_of(list(VARIANTS), VARIANTS)
    device: str = one_of("auto", *DEVICES)  # "auto": nccl if every rank gets a GPU, else gloo on CPU; "cpu"; "cuda"
    threads: int = positive(1)  # intra-op threads per rank
    width: int = positive(16)  # resnet18: the first stage's width (then 2x, 4x, 8x)
    num_layers: int = positive(4)  # convbn only
    in_channels: int = positive(3)
    image_size: int = positive(8)
    batch_size: int = positive(8)  # per rank
    num_classes: int = positive(10)
    broadcast_buffers: bool = True  # DDP's default
    # DDP bucket size; None: DDP's default (1 MiB first bucket, then 25 MiB).
    bucket_cap_mb: Optional[float] = ruled(None, "null or > 0", lambda v: v is None or v > 0)
    seed: int = 0
    warmup_steps: int = non_negative(3)
    rounds: int = positive(30)  # at most; fewer if round_budget_s runs out first
    min_rounds: int = positive(5)
    round_budget_s: float = positive(60.0)  # per world size: no new round starts after this many seconds of rounds
    steps_per_round: int = positive(1)
    # World sizes at which the ``_compiled`` variants run (compiling takes minutes on a small CPU); [] for all.
    compile_world_sizes: list[int] = ruled([], "a list of ints >= 1", lambda v: all(w >= 1 for w in v))
    compile_backend: str = "inductor"  # torch.compile backend of the _compiled variants
    floor_repeats: int = positive(20)
    memory_steps: int = positive(2)
    profile: bool = True
    profile_top: int = positive(10)
    timeout_s: float = positive(300.0)


@dataclass
class MicroConfig:
    """The single-layer microbenchmark (forward+backward, one-member group)."""

    enabled: bool = True
    device: str = one_of("auto", *DEVICES)
    threads: int = positive(1)
    shapes: list[list[int]] = ruled(
        [[32, 64, 28, 28], [8, 256, 14, 14], [256, 512]],
        "listing shapes (N, C, *) of >= 2 sizes, each > 0",
        lambda v: all(len(shape) >= 2 and min(shape) > 0 for shape in v),
    )
    dtypes: list[str] = _each_of(["float32", "bfloat16"], DTYPES)
    memory_formats: list[str] = _each_of(list(MEMORY_FORMATS), MEMORY_FORMATS)
    warmup: int = non_negative(3)
    repeats: int = positive(30)
    profile: bool = True
    profile_top: int = positive(10)
    timeout_s: float = positive(300.0)
    # GLIBC_TUNABLES of the worker ("": inherit). By default glibc returns the freed top of the heap to the OS (trim)
    # and mmaps large blocks afresh, so a layer's outputs are refilled by page faults on some calls and not others:
    # up to 2000 a call at (32, 64, 28, 28), which swung F.batch_norm between 1.3 and 2.9 ms from run to run.
    glibc_tunables: str = "glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432"


@dataclass
class BenchConfig:
    """The whole benchmark (configs/bench.yaml)."""

    output_dir: str = "outputs/bench"
    device: str = one_of("auto", *DEVICES)  # not "auto": overrides every scenario's and the microbenchmark's device
    # Scenario files, relative to this config file's directory (or to the working directory).
    scenarios: list[str] = field(default_factory=lambda: ["bench_latency.yaml", "bench_compute.yaml"])
    compute_scenario: str = "compute"  # the scenario P1 is judged on
    micro: MicroConfig = field(default_factory=MicroConfig)
    plot: bool = True
    # A markdown file whose "performance table" section this run rewrites (README.md for make bench), or null.
    readme: Optional[str] = None


@dataclass
class ResolvedBenchConfig(BenchConfig):
    """What one run measured: the bench config and every scenario file after the overrides.

    Written as the ``config`` of performance.json and as performance_config.yaml.
    """

    scenario_configs: list[ScenarioConfig] = field(default_factory=list)


@dataclass
class _ScenarioOverrides:
    """The ``scenario.KEY=VALUE`` overrides, checked once against :class:`ScenarioConfig` under their own name."""

    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)


def _scenario_path(path: str, config_dir: str) -> str:
    """``path`` relative to the bench file's directory if it is there, else as given (absolute or from the cwd)."""
    if os.path.isabs(path):
        return path
    candidate = os.path.join(config_dir, path)
    return candidate if os.path.exists(candidate) else path


def _load_scenario(path: str, overrides: Sequence[str]) -> ScenarioConfig:
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config key 'scenarios': scenario file {path} not found")
    try:
        scenario = load_config(ScenarioConfig, path, overrides)
    except ConfigError as error:
        raise ConfigError(f"{name}: {error}") from None
    cap = scenario.bucket_cap_mb
    compiled = [v for v in scenario.variants if v.endswith(COMPILED_SUFFIX)]
    if compiled and cap is not None and cap < 1.0:
        # dynamo's DDP optimizer asserts that DDP's first bucket (1 MiB) is no larger than the others.
        raise ConfigError(
            f"{name}: config key 'bucket_cap_mb': compiled variants {compiled} need null or >= 1 (got {cap})"
        )
    return scenario


def load_bench(path: str, overrides: Sequence[str] = ()) -> tuple[BenchConfig, list[ScenarioConfig]]:
    """The bench config at ``path`` and its scenario files, with ``KEY=VALUE`` overrides applied, validated.

    Args:
        path: a bench YAML file (keys of :class:`BenchConfig`); its ``scenarios`` are files of
            :class:`ScenarioConfig` keys, relative to its directory (or to the working directory).
        overrides: ``KEY=VALUE`` strings for the bench file, ``scenario.KEY=VALUE`` for every scenario file;
            ``device`` other than ``auto`` also sets every scenario's and the microbenchmark's device.

    Returns:
        The bench config and one scenario config per scenario file, in order.

    Raises:
        ConfigError: naming the key (and the file) of the first mistake: a missing file, an unknown key, a wrong
            type, a value out of range, compiled variants with ``bucket_cap_mb`` below 1, or two scenarios of the
            same name.
    """
    scenario_overrides = [o for o in overrides if o.startswith(_SCENARIO)]
    load_config(_ScenarioOverrides, None, scenario_overrides)  # names the key as given: scenario.KEY
    cfg = load_config(BenchConfig, path, [o for o in overrides if not o.startswith(_SCENARIO)])
    per_file = [o[len(_SCENARIO) :] for o in scenario_overrides]
    if cfg.device != "auto":
        cfg.micro.device = cfg.device
        per_file.append(f"device={cfg.device}")
    config_dir = os.path.dirname(os.path.abspath(path))
    scenarios = [_load_scenario(_scenario_path(p, config_dir), per_file) for p in cfg.scenarios]
    names = [s.name for s in scenarios]
    if len(set(names)) != len(names):
        raise ConfigError(f"config key 'scenarios': expected files of distinct scenario names (got {names})")
    check_readme_key(cfg.readme, README_SECTION)
    return cfg, scenarios


def check_launch(cfg: BenchConfig) -> None:
    """Reject a config this machine cannot run, before anything starts. Scenarios' world sizes above the GPU count
    are skipped and reported instead; the microbenchmark has nothing to fall back to.

    Raises:
        ConfigError: for an enabled microbenchmark on ``cuda`` without CUDA (``device=cuda`` or ``micro.device``).
    """
    if cfg.micro.enabled and cfg.micro.device == "cuda" and not torch.cuda.is_available():
        key = "device" if cfg.device == "cuda" else "micro.device"
        raise ConfigError(f"config key '{key}': 'cuda' was asked for but CUDA is not available")
