"""The tree's budget arithmetic, in one place: how many tokens a tree needs in the verify pass, on the draft cache
and beside a prompt, what the head's extend passes take, and what the memory plan must hold for the trees an engine
may grow. Sizing, the builder, the scheduler and request admission read the same numbers from here, so a tree that
fits one of them fits them all.
"""
from __future__ import annotations

from eagle_ray.config import SpeculationConfig, TreeConfig, is_plain
from eagle_ray.errors import ConfigError
from eagle_ray.speculative.tree import static_shape

# the tree shapes the tuner (engine/tuning.py) searches and traces: the largest trees an engine with
# ``tree_policy: auto`` grows, so its memory plan holds them
GRID_TOTAL = (2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48)
GRID_DEPTH = (0, 1, 2, 3, 4, 5)
GRID_TOPK = (1, 2, 3, 4, 6, 8)
TRACE_TREE = TreeConfig(total_tokens=48, depth=5, top_k=8, lookup=0)   # the head's trees alone
MIN_EXTEND_TOKENS = 512   # padded tokens a head pass may take at least: a new prompt's pairs arrive in bulk


def draft_budget(tree: TreeConfig) -> int:
    """Tree tokens per sequence (root included) the head drafts."""
    return tree.total_tokens if tree.mode == "dynamic" else len(static_shape(tree)) + 1


def verify_budget(tree: TreeConfig) -> int:
    """Verify tokens per sequence (root included) a tree may take: the head's drafts and the lookup chain."""
    return draft_budget(tree) + (0 if is_plain(tree) else tree.lookup)


def draft_room(tree: TreeConfig) -> int:
    """Tree tokens a cycle stacks on a slot's draft cache (lookup tokens are never drafted)."""
    return tree.depth * tree.top_k if tree.mode == "dynamic" else draft_budget(tree)


def max_emitted(tree: TreeConfig) -> int:
    """The most tokens one step with ``tree`` can emit (its deepest path plus the bonus token): more pending pairs
    than this at a step's start means the head is catching up."""
    drafted = min(tree.total_tokens, tree.depth + 2) if tree.mode == "dynamic" else \
        max(len(p) for p in static_shape(tree)) + 1
    return drafted if is_plain(tree) else max(drafted, tree.lookup + 1)


def graph_widths(trees: list[TreeConfig]) -> list[int]:
    """Verify widths a captured target decode pass may run: plain roots, and every width between a tree's drafts
    and its drafts plus its lookup chain."""
    spec = [t for t in trees if not is_plain(t)]
    return sorted({1} | {w for t in spec for w in range(draft_budget(t), verify_budget(t) + 1)})


def extend_budget(step_budget: int) -> int:
    """Padded tokens one head pass takes: the step's own budget, or more where that is small."""
    return max(step_budget, MIN_EXTEND_TOKENS)


def prompt_room(max_len: int, budget: int) -> int:
    """The most prompt tokens a context of ``max_len`` takes: one verify budget stays free, so a request's first
    step can speculate (near the end of its slot a sequence decodes plainly)."""
    return max_len - budget - 1


def check_prompt_room(max_len: int, trees: list[TreeConfig]) -> None:
    """Fail unless a context of ``max_len`` leaves room for a prompt next to the largest verify budget: else every
    request would be refused as too long. Callers check before loading."""
    budget = max(verify_budget(t) for t in trees)
    if prompt_room(max_len, budget) < 1:
        raise ConfigError(f"cache.max_model_len {max_len} leaves no room for a prompt next to the largest tree's "
                          f"verify budget ({budget} tokens): raise max_model_len or use a smaller tree")


def tree_demand(spec: SpeculationConfig) -> tuple[int, int, int]:
    """(verify tokens per sequence, draft-cache room, draft rows scored per sequence) the engine's trees may need,
    what the memory plan holds; with ``tree_policy: auto`` also the tuner's largest shapes, which it runs while
    measuring."""
    trees = spec.trees()
    if spec.tree_policy == "auto":
        trees = trees + [TRACE_TREE, TreeConfig(total_tokens=max(GRID_TOTAL), depth=max(GRID_DEPTH),
                                                top_k=max(GRID_TOPK))]
    dynamic = [t for t in trees if t.mode == "dynamic"]
    verify = max(verify_budget(t) for t in trees)
    room = max(draft_room(t) for t in trees)
    rows = max([t.top_k for t in dynamic] + [draft_budget(t) for t in trees if t.mode != "dynamic"])
    return verify, room, rows
