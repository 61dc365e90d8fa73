"""Load the scripts of launch/ as modules for the tests (launch/ is not a package: the library never imports it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(filename: str) -> ModuleType:
    """``launch/<filename>`` as module ``syncbn_launch_<stem>``, loaded once (the name compare.py uses too)."""
    name = f"syncbn_launch_{Path(filename).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "launch" / filename)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and get_type_hints look the module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]
