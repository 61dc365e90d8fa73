"""Tests of launch/common: the config layer every recipe shares, the atomic writes, and the torchrun restart setting."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from launch.common.config import (
    ConfigError,
    config_error_exit,
    distinct_ints,
    load_config,
    one_of,
    parse_config,
    positive,
    to_yaml,
)
from launch.common.io import atomic_write, write_json
from launch.common.torchrun import env_outside_torchrun, restart_hazard

# Left out of make test-quick (docs/testing.md, "The quick tier"): launch/common's config and IO helpers.
pytestmark = pytest.mark.plumbing


@dataclass
class _Section:
    size: int = positive(4)
    scale: float = 1.0


@dataclass
class _Schema:
    name: str = "run"
    mode: str = one_of("fast", "fast", "exact")
    flag: bool = False
    seeds: list[int] = distinct_ints([0, 1], minimum=0)
    cap: Optional[float] = None
    tags: list[str] = field(default_factory=list)
    section: _Section = field(default_factory=_Section)


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_file_then_overrides_layer_over_the_typed_defaults(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "mode: exact\nsection:\n  size: 8\n  scale: 2\n")
    cfg = load_config(_Schema, path, ["section.size=16", "seeds=[3]", "cap=1e-3", "tags=[a=b,c]"])
    assert cfg == _Schema(mode="exact", seeds=[3], cap=1e-3, tags=["a=b", "c"], section=_Section(16, 2.0))
    assert isinstance(cfg.section.scale, float)  # YAML's 2 for a float key
    assert load_config(_Schema) == _Schema()


def test_resolved_yaml_reloads_to_an_equal_config(tmp_path: Path) -> None:
    cfg = load_config(_Schema, None, ["mode=exact", "cap=0.5", "tags=[x]", "section.scale=1e-8"])
    text = to_yaml(cfg, "# resolved\n")
    assert text.startswith("# resolved\n")
    assert load_config(_Schema, _yaml(tmp_path, text)) == cfg


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["sektion.size=1"], ["unknown config key 'sektion'", "known keys here: name, mode"]),
        (["section.sise=1"], ["unknown config key 'section.sise'", "size, scale"]),
        (["section.size=ten"], ["'section.size'", "expected int", "str 'ten'"]),
        (["section.size=2.5"], ["'section.size'", "expected int", "float"]),
        (["section.size=true"], ["'section.size'", "expected int", "bool"]),
        (["flag=1"], ["'flag'", "expected bool", "int 1"]),
        (["flag=yes please"], ["'flag'", "expected bool"]),
        (["name=7"], ["'name'", "expected str", "int 7"]),
        (["cap=abc"], ["'cap'", "float | None"]),
        (["seeds=[0,x]"], ["'seeds'", "list of int"]),
        (["seeds=[1,1]"], ["'seeds'", "distinct ints >= 0"]),
        (["seeds=[]"], ["'seeds'", "non-empty"]),
        (["mode=slow"], ["'mode'", "one of 'fast' | 'exact'", "'slow'"]),
        (["section.size=0"], ["'section.size'", "> 0", "got 0"]),
        (["section=3"], ["section", "expected a mapping"]),
        (["section.size"], ["expected KEY=VALUE"]),
        (["=3"], ["expected KEY=VALUE"]),
    ],
)
def test_bad_override_is_refused_naming_the_key(overrides: list[str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_Schema, None, overrides)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- a\n- b\n", "expected a mapping"),
        ("mode: [unclosed\n", "not valid YAML"),
        ("flag: 1\n", "'flag': expected bool"),
        ("section:\n  size: -1\n", "'section.size': expected a value > 0"),
    ],
)
def test_bad_file_is_refused(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        load_config(_Schema, _yaml(tmp_path, text))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(_Schema, tmp_path / "missing.yaml")


def test_command_line_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _yaml(tmp_path, "name: file\n")
    assert parse_config(_Schema, ["--config", str(path), "flag=true"], "").flag is True
    assert parse_config(_Schema, ["flag=true"], "", default_config=str(path)).name == "file"
    with pytest.raises(ConfigError) as info:
        parse_config(_Schema, ["nope=1"], "")
    assert config_error_exit(info.value) == 2
    assert "error: unknown config key 'nope'" in capsys.readouterr().err


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    path = tmp_path / "out" / "metrics.json"
    write_json(path, {"epoch": 1})
    assert json.loads(path.read_text()) == {"epoch": 1}

    def fail(file: object) -> None:
        file.write(b'{"epoch": 2, "trunc')  # type: ignore[attr-defined]
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert json.loads(path.read_text()) == {"epoch": 1}  # the complete old file
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]  # no temp file left behind
    assert path.stat().st_mode & 0o777 == 0o644


def test_restart_hazard_is_a_restartable_worker_on_the_shared_agent_store() -> None:
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"}
    message = restart_hazard(shared)
    assert message is not None and "--max-restarts=2" in message and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message
    assert restart_hazard({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # no restart: nothing to go wrong
    assert restart_hazard({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a store per attempt
    assert restart_hazard({}) is None  # not under torchrun
    # Every job the recipes and tests start gets the setting for its torchrun.
    assert env_outside_torchrun({})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
