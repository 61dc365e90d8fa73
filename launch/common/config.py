"""Typed configs for every recipe: OmegaConf structured configs, ``key=value`` overrides, range rules.

A recipe's config is a tree of dataclasses with a typed default for every key. :func:`load_config` layers the
YAML file and then the ``key=value`` overrides (dotted for sections, values in OmegaConf's YAML grammar, so
``1e-3`` is a float) over the defaults, and returns the dataclass instance. Every mistake raises
:class:`ConfigError` naming the key; recipes print it and exit 2 before any process group starts.

OmegaConf rejects unknown keys and values it cannot convert. It also converts more than a config should accept
(``resume: 1`` to ``True``, ``epochs: "3"`` to 3), so the values given are first checked against the field types
strictly. Range rules (:func:`positive`, :func:`one_of`, ...) sit next to the defaults as field metadata and are
checked in one place, :func:`check_rules`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config file, key, type, value or launch mode; raised before any process group starts."""


@dataclass(frozen=True)
class Rule:
    """A range rule of one key: ``check(value)`` must hold; ``text`` says how (e.g. "> 0")."""

    text: str
    check: Callable[[Any], bool]


def ruled(default: Any, text: str, check: Callable[[Any], bool]) -> Any:
    """A dataclass field with ``default`` (copied per instance for lists) and the rule ``text``/``check``."""
    metadata = {"rule": Rule(text, check)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def positive(default: Any) -> Any:
    return ruled(default, "> 0", lambda v: v > 0)


def non_negative(default: Any) -> Any:
    return ruled(default, ">= 0", lambda v: v >= 0)


def one_of(default: str, *choices: str) -> Any:
    """A string key with a fixed set of values (OmegaConf has no ``Literal``)."""
    return ruled(default, "one of " + " | ".join(repr(c) for c in choices), lambda v: v in choices)


def distinct_ints(default: list[int], minimum: int | None = None) -> Any:
    """A non-empty list of distinct ints, each at least ``minimum`` if given."""
    text = "a non-empty list of distinct ints" + ("" if minimum is None else f" >= {minimum}")
    return ruled(default, text, lambda v: bool(v) and len(set(v)) == len(v) and (minimum is None or min(v) >= minimum))


def check_rules(cfg: Any, prefix: str = "") -> None:
    """Check every range rule of the dataclass tree ``cfg``: the one place ranges are checked.

    Raises:
        ConfigError: naming the first key whose value breaks its rule.
    """
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_rules(value, f"{prefix}{f.name}.")
            continue
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):  # a list of sections
            for index, item in enumerate(value):
                check_rules(item, f"{prefix}{f.name}[{index}].")
            continue
        rule = f.metadata.get("rule")
        if rule is not None and not rule.check(value):
            raise ConfigError(f"config key '{prefix}{f.name}': expected a value {rule.text} (got {value!r})")


_UNIONS = (Union, getattr(typing, "UnionType", Union))


def _type_name(tp: Any) -> str:
    if get_origin(tp) in _UNIONS:
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list of {_type_name(get_args(tp)[0])}" if get_args(tp) else "list"
    return "None" if tp is type(None) else tp.__name__


def _strictly(value: Any, tp: Any) -> bool:
    """Whether ``value`` (as YAML read it) has type ``tp``, without the conversions OmegaConf would make."""
    if get_origin(tp) in _UNIONS:
        return any(_strictly(value, a) for a in get_args(tp))
    if get_origin(tp) is list or tp is list:
        args = get_args(tp)
        return isinstance(value, list) and (not args or all(_strictly(v, args[0]) for v in value))
    if tp is type(None):
        return value is None
    if tp is float:  # YAML writes 1.0 as 1; bool is an int subclass but never a number here
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _check_types(schema: type, values: Any, prefix: str = "") -> None:
    """Check the values given for ``schema`` (a plain nested mapping) against its field types; unknown keys are
    left to OmegaConf, which names them."""
    if not isinstance(values, dict):
        where = prefix.rstrip(".") or "the config file"
        raise ConfigError(f"{where}: expected a mapping of keys (got {type(values).__name__} {values!r})")
    hints = get_type_hints(schema)
    for name, value in values.items():
        if name not in hints:
            continue
        key, tp = f"{prefix}{name}", hints[name]
        item = get_args(tp)[0] if get_origin(tp) is list and get_args(tp) else None
        if dataclasses.is_dataclass(tp):
            _check_types(tp, value, f"{key}.")
        elif dataclasses.is_dataclass(item) and isinstance(value, list):  # a list of sections
            for index, section in enumerate(value):
                _check_types(item, section, f"{key}[{index}].")
        elif not _strictly(value, tp):
            raise ConfigError(f"config key '{key}': expected {_type_name(tp)} (got {type(value).__name__} {value!r})")


def _read_file(path: str | Path) -> DictConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = OmegaConf.load(path)
    except Exception as error:  # yaml.YAMLError, or OmegaConf's grammar errors
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path}: expected a mapping of keys (got a list)")
    return loaded


def _read_overrides(overrides: Sequence[str]) -> DictConfig:
    for override in overrides:
        key, sep, _ = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected KEY=VALUE with a dotted KEY such as train.epochs=3 (got {override!r})")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as error:
        raise ConfigError(f"cannot parse the overrides {list(overrides)}: {error.msg}") from None


def _config_error(error: OmegaConfBaseException) -> ConfigError:
    """OmegaConf's error as a one-line :class:`ConfigError` naming the key."""
    if isinstance(error, ConfigKeyError) and dataclasses.is_dataclass(error.object_type):
        known = ", ".join(f.name for f in dataclasses.fields(error.object_type))
        return ConfigError(f"unknown config key '{error.full_key}' (known keys here: {known})")
    message = str(error.msg).strip().splitlines()[0]
    return ConfigError(f"config key '{error.full_key}': {message}" if error.full_key else message)


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """The validated config: ``schema``'s defaults, then the YAML file at ``path`` (if any), then ``overrides``.

    Args:
        schema: a dataclass whose fields are typed and all have defaults (nested sections are dataclasses).
        path: a YAML file whose keys are a subset of the schema's (nested sections as mappings).
        overrides: ``"dotted.key=value"`` strings; values use OmegaConf's YAML grammar (``[0, 1]`` is a list).

    Returns:
        An instance of ``schema``, every key typed and within its range.

    Raises:
        ConfigError: if the file is missing, not YAML or not a mapping, an override is not ``KEY=VALUE``, a key
            is unknown, a value has the wrong type, or a value breaks its rule. The message names the key.
    """
    layers = [] if path is None else [_read_file(path)]
    layers.append(_read_overrides(overrides))
    try:
        for layer in layers:
            _check_types(schema, OmegaConf.to_container(layer))
        merged = OmegaConf.merge(OmegaConf.structured(schema), *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise _config_error(error) from None
    check_rules(cfg)
    return cfg


def to_yaml(cfg: Any, header: str = "") -> str:
    """The dataclass tree ``cfg`` as YAML that :func:`load_config` reads back to an equal config."""
    return header + OmegaConf.to_yaml(OmegaConf.structured(cfg))


def argument_parser(description: str, default_config: str | None = None) -> argparse.ArgumentParser:
    """A parser with every recipe's arguments: ``--config PATH`` and any number of ``KEY=VALUE`` overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config, help="YAML config; omitted keys keep their typed defaults")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="override a key, dotted for sections: train.epochs=3"
    )
    return parser


def parse_config(schema: type[T], argv: Sequence[str] | None, description: str, default_config: str | None = None) -> T:
    """The config from a command line ``[--config PATH] [KEY=VALUE ...]`` (``sys.argv[1:]`` if ``argv`` is None).

    Raises:
        ConfigError: see :func:`load_config`.
    """
    args = argument_parser(description, default_config).parse_args(argv)
    return load_config(schema, args.config, args.overrides)


def config_error_exit(error: ConfigError) -> int:
    """Print ``error`` as argparse does and return 2, the exit code of every recipe for a bad config."""
    print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
    return 2
