"""The repository's command-line scripts (bench/, jobs/, scripts/) loaded as modules, so tests call their functions."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load(path: str) -> ModuleType:
    """``load("bench/speed.py")``: the script at ``path`` (from the repository root), executed as a module. Its
    folder goes on the import path, as ``python bench/speed.py`` puts it there, so the sibling modules it imports
    (``harness``, ``workloads``) are found."""
    folder = str((ROOT / path).parent)
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # as an import would (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module
