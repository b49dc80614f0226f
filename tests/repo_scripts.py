"""The repository's command-line scripts (bench/, jobs/) loaded as modules, so tests call their functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load(path: str) -> ModuleType:
    """``load("bench/tree_speed.py")``: the script at ``path`` (from the repository root), executed as a module."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
