"""Which part of eagle_ray imports which: one line per importing part, and any import that points up the layers.

    python scripts/import_graph.py            # prints the graph; exit status 1 if an import points upward

Layers, bottom to top (a part may import its own layer or lower ones): the leaf modules (config, errors, stats,
prompts, cluster) < spec, model < engine < train, data, serve, tools (benchmark, report, measure) < cli. Imports
inside functions count too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "eagle_ray"
LAYER = {"config": 0, "errors": 0, "stats": 0, "prompts": 0, "uploads": 0, "speculative": 1, "model": 1, "engine": 2,
         "train": 3, "batch": 3, "serve": 3, "benchmark": 3, "report": 3, "measure": 3, "cluster": 0, "cli": 4}


def part_of(module: str) -> str | None:
    """``eagle_ray.engine.queue`` -> ``engine``; ``eagle_ray.cli`` -> ``cli``."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 and bits[0] == "eagle_ray" else None


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        src = part_of(".".join(rel.parts))
        if src is None or src == "__init__":
            continue
        for mod in imports(path):
            dst = part_of(mod)
            if dst and dst != src:
                edges[src].add(dst)
    return edges


def main() -> int:
    edges = graph()
    upward = []
    for src in sorted(edges, key=lambda p: (LAYER.get(p, 9), p)):
        print(f"{src:<10} -> {', '.join(sorted(edges[src], key=lambda p: (LAYER.get(p, 9), p)))}")
        upward += [(src, dst) for dst in edges[src] if LAYER.get(dst, 9) > LAYER.get(src, 9)]
    for src, dst in upward:
        print(f"UPWARD: {src} imports {dst}")
    print("no upward import" if not upward else f"{len(upward)} upward import(s)")
    return 1 if upward else 0


if __name__ == "__main__":
    sys.exit(main())
