"""Which part of eagle_ray imports which: imports flow down the layers, and no two files import each other.

    python scripts/import_graph.py            # prints the graph; exit status 1 on an upward import or a circle

Layers, bottom to top (a part may import its own layer or lower ones):

    0  config, errors, stats, prompts, cluster, uploads       leaves: settings, errors, per-request stats
    1  speculative                                             trees, acceptance, sampling: tensors in, tensors out
    2  model                                                   target, heads, KV cache, attention, loading, memory
    3  engine                                                  scheduler, model runner, tree policy, builder, queue
    4  batch, serve, train, fidelity                           what runs an engine
    5  cli

Imports inside functions count too: a lazy import is still a dependency. ``tests/test_layout.py`` runs this.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "eagle_ray"
LAYERS = [("config", "errors", "stats", "prompts", "cluster", "uploads"), ("speculative",), ("model",), ("engine",),
          ("batch", "serve", "train", "fidelity"), ("cli",)]
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str | None:
    """``eagle_ray.engine.queue`` -> ``engine``; ``eagle_ray.cli`` -> ``cli``."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 and bits[0] == "eagle_ray" else None


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (``from eagle_ray.model import x`` names
    ``eagle_ray.model.x`` where that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if module_path(f"{node.module}.{a.name}") is not None)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def module_path(module: str) -> Path | None:
    if not module.startswith("eagle_ray"):
        return None
    base = PACKAGE.parent.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def module_graph() -> dict[str, set[str]]:
    """File -> the eagle_ray files it imports (package faces, ``__init__.py``, left out: they only hand names on)."""
    edges: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        edges[name] = {m for m in imports(path) if (p := module_path(m)) and p.name != "__init__.py" and m != name}
    return edges


def part_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for src, dsts in module_graph().items():
        for dst in dsts:
            a, b = part_of(src), part_of(dst)
            if a and b and a != b:
                edges[a].add(b)
    return edges


def upward_imports() -> list[tuple[str, str]]:
    """(part, the higher or unlisted part it imports)."""
    return sorted((src, dst) for src, dsts in part_graph().items() for dst in dsts
                  if LAYER.get(dst, 99) > LAYER.get(src, 99))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of nodes that import each other, directly or round a loop (Tarjan's strongly connected components)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    edges = part_graph()
    for src in sorted(edges, key=lambda p: (LAYER.get(p, 99), p)):
        print(f"{src:<12} -> {', '.join(sorted(edges[src], key=lambda p: (LAYER.get(p, 99), p)))}")
    problems = [f"UPWARD: {a} imports {b}" for a, b in upward_imports()]
    problems += [f"CIRCLE: {' <-> '.join(c)}" for c in circles(module_graph()) + circles(edges)]
    print("\n".join(problems) or "imports flow down; no circle")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
