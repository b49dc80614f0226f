"""Runs a script as the NVIDIA device machine would, on any machine: only the device image's packages and the carried
wheels importable, and the repository not installed.

    python -I bench/device/as_on_device.py bench/gpu_step.py --device cpu --shapes tiny ... --out /tmp/x.jsonl

The device has no ray, no pydantic, no s3fs and no eagle-ray install; an import of any of them on the GPU path fails
there, minutes into a run that took a scarce machine. Here, before anything else is imported, the path finder is
wrapped so that a top-level module whose distribution is on neither list (``packages.txt``: the image;
``wheels.txt``: what travels in ``.whl/``) is not found, exactly as if it were not installed (``import`` raises
ModuleNotFoundError, ``importlib.util.find_spec`` answers None); an editable install of eagle-ray is taken off the
import machinery, so ``eagle_ray`` is found through the repository root or not at all. Then the script runs as
``python SCRIPT`` runs it: its folder first on the path, as ``__main__``. With ``-I`` (isolated mode) neither
``PYTHONPATH`` nor the current folder add anything. The modules refused are listed on stderr at exit.
"""
from __future__ import annotations

import atexit
import importlib.machinery
import importlib.metadata
import re
import runpy
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LISTS = (HERE / "packages.txt", HERE / "wheels.txt")


def normalise(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(lists=LISTS) -> set[str]:
    """The distributions the device has or gets from ``.whl/``: the names in ``lists`` (``name`` or
    ``name==version`` a line, ``#`` comments)."""
    names = set()
    for path in lists:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                names.add(normalise(re.split(r"[=<>~! ;\[]", line, maxsplit=1)[0]))
    return names


def with_requirements(names: set[str]) -> set[str]:
    """``names`` and what they require as installed here, transitively (extras left out): a package's own
    dependencies are on the device with it, whatever this machine's newer version of it needs instead."""
    from packaging.requirements import Requirement
    out, todo = set(names), list(names)
    while todo:
        try:
            requires = importlib.metadata.requires(todo.pop()) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            name = normalise(req.name)
            if name not in out and (req.marker is None or req.marker.evaluate({"extra": ""})):
                out.add(name)
                todo.append(name)
    return out


def device_distributions() -> set[str]:
    return with_requirements(listed())


class DevicePathFinder:
    """``importlib.machinery.PathFinder`` that does not find a top-level module of a distribution the device lacks
    (submodules follow their package; the standard library and the repository's own files are always found)."""

    def __init__(self, allowed: set[str]):
        self.allowed = allowed
        self.owners = importlib.metadata.packages_distributions()   # top-level module -> distributions
        self.always = [ROOT] + [Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")]
        self.refused: list[str] = []

    def refuses(self, name: str, spec) -> bool:
        if "." in name or any(under(spec, place) for place in self.always):
            return False
        return not {normalise(d) for d in self.owners.get(name, ())} & self.allowed

    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or not self.refuses(name, spec):
            return spec
        if name not in self.refused:
            self.refused.append(name)
        return None

    def find_distributions(self, *args, **kwargs):
        """Installed distributions' metadata (``importlib.metadata``), those the device lacks left out."""
        for dist in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if normalise(dist.metadata["Name"] or "") in self.allowed:
                yield dist

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()


def under(spec, place: Path) -> bool:
    """Whether ``spec``'s files lie in ``place`` (stdlib folders hold site-packages: that one is not in)."""
    files = list(spec.submodule_search_locations or []) + ([spec.origin] if spec.origin else [])
    for f in files:
        path = Path(f).resolve()
        if path.is_relative_to(place) and "site-packages" not in path.relative_to(place).parts:
            return True
    return False


def install(allowed: set[str]) -> DevicePathFinder:
    """Swap the path finder for a :class:`DevicePathFinder` and drop editable installs' finders."""
    finder = DevicePathFinder(allowed)
    kept = []
    for f in sys.meta_path:
        if f is importlib.machinery.PathFinder:
            kept.append(finder)
        elif not (f.__module__ if isinstance(f, type) else type(f).__module__).startswith("__editable__"):
            kept.append(f)
    sys.meta_path[:] = kept
    for name in [m for m in sys.modules if m == "eagle_ray" or m.startswith("eagle_ray.")]:
        del sys.modules[name]
    return finder


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -I bench/device/as_on_device.py SCRIPT [ARGS...]")
    finder = install(device_distributions())
    atexit.register(lambda: finder.refused and print(
        f"as_on_device: not on the device, not imported: {', '.join(sorted(finder.refused))}", file=sys.stderr))
    script = Path(sys.argv[1]).resolve()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
