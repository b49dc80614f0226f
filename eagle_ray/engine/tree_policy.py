"""Which draft tree a step grows, and how many verify tokens it may take, at each batch size.

One object answers it for the engine: the configured or tuned table of trees per batch size, the verify cap (the
most tree nodes one verify pass takes over the whole batch), and, with a measured choice, whether speculating pays
at this batch size at all. What a tree costs in tokens is ``engine/budgets.py``'s.
"""
from __future__ import annotations

from eagle_ray.config import PLAIN, SpeculationConfig, TreeConfig, is_plain
from eagle_ray.engine.budgets import verify_budget
from eagle_ray.engine.chooser import SpeculationChooser
from eagle_ray.errors import ConfigError
from eagle_ray.speculative.tree import children_per_node


# ---- checks ----------------------------------------------------------------------------------------------------
def check_draft_vocab(draft_vocab_size: int, trees: list[TreeConfig]) -> None:
    """Refuse trees whose nodes take more children than the head has draft tokens: top-k would pick padding."""
    k = max(children_per_node(t) for t in trees)
    if draft_vocab_size < k:
        raise ConfigError(f"the draft head proposes from {draft_vocab_size} tokens, fewer than the {k} children a "
                          "tree node takes (top_k, or a static tree's widest rank): use a narrower tree or a head "
                          "with a larger draft vocabulary")


def by_batch(table: dict, batch: int, below_all):
    """``table``'s entry for the largest batch size <= ``batch``; the entry for ``below_all`` (None: None) if every
    key is larger."""
    fits = [b for b in table if b <= batch]
    key = max(fits) if fits else below_all
    return None if key is None else table[key]


# ---- the policy ----------------------------------------------------------------------------------------------
class TreePolicy:
    """The live speculation settings (``spec``: the configured ones, then the tuner's) and the measured choice."""

    def __init__(self, spec: SpeculationConfig, drafting: bool = True, slots: int = 1):
        self.spec = spec
        self.slots = slots                                # sequences a step may hold (the measured choice's buckets)
        self.chooser: SpeculationChooser | None = None   # speculate or not per batch size, measured
        self.tuning = None                                # the TuningResult, with tree_policy "auto"
        if drafting and self.measured and spec.tree_policy != "auto":   # tuning starts it from its own choices
            self.chooser = SpeculationChooser.for_trees(self.table())

    def table(self, trees_by_batch: dict[int, TreeConfig] | None = None) -> dict[int, TreeConfig]:
        """The tree per batch size the measured choice starts from, one bucket per key: ``trees_by_batch``
        (configured or tuned), else the one tree at every power of two up to the slots, so that full batches and a
        job's tail of a few sequences, where drafting pays differently, are timed and chosen apart."""
        table = trees_by_batch if trees_by_batch is not None else self.spec.trees_by_batch
        return table or {1 << i: self.spec.tree for i in range(max(self.slots, 1).bit_length())}

    def restart_chooser(self) -> None:
        """The measured choice forgets what it measured and starts again from its priors: the tuner's choices, or
        the configured trees (a benchmark's every run starts where a new engine would)."""
        if self.chooser is not None:
            priors = self.tuning.trees_by_batch() if self.tuning is not None else self.table()
            self.chooser = SpeculationChooser.for_trees(priors)

    @property
    def measured(self) -> bool:
        """Whether steps time both modes and run the faster (``measured_choice``; default: with tuning)."""
        s = self.spec
        return s.measured_choice if s.measured_choice is not None else s.tree_policy == "auto"

    def trees(self) -> list[TreeConfig]:
        return self.spec.trees()

    def max_verify_budget(self) -> int:
        return max(verify_budget(t) for t in self.trees())

    def tree_for(self, batch: int) -> TreeConfig:
        """The tree a step with ``batch`` sequences grows: ``trees_by_batch``'s entry for the largest batch size
        <= ``batch`` (the smallest entry below that), else ``tree``."""
        table = self.spec.trees_by_batch
        return by_batch(table, batch, min(table)) if table else self.spec.tree

    def speculative_tree_for(self, batch: int) -> TreeConfig:
        """The tree a step drafts where the measured choice speculates: ``tree_for``'s, or where that is plain the
        configured ``tree`` (the default tree if that is plain too)."""
        tree = self.tree_for(batch)
        if is_plain(tree):
            tree = self.spec.tree
        return TreeConfig() if is_plain(tree) else tree

    def step_tree(self, batch: int) -> TreeConfig:
        """The tree a step with ``batch`` speculative sequences grows: ``tree_for``, or with a measured choice the
        tree or plain decoding, as it says for this batch size."""
        if self.chooser is None:
            return self.tree_for(batch)
        return self.speculative_tree_for(batch) if self.chooser.speculate(batch) else PLAIN

    def verify_cap(self, batch: int, room: int | None = None) -> int | None:
        """The most tree nodes a verify pass of ``batch`` speculative sequences takes (roots included): the tuned
        or configured cap, lowered to the ``room`` the step's prompt chunks leave; None where nothing limits it."""
        cap = by_batch(self.spec.verify_cap_by_batch or {}, batch, None) or self.spec.verify_cap
        if room is None or room >= batch * verify_budget(self.tree_for(batch)):
            return cap
        return min(cap, room) if cap else room

    def set_trees(self, tree: TreeConfig | None = None, trees_by_batch: dict[int, TreeConfig] | None = None) -> None:
        """A new tree table (benchmarks, the tuner); a measured choice starts again from it."""
        self.spec = self.spec.model_copy(update={"tree": tree or self.spec.tree, "trees_by_batch": trees_by_batch})
        if self.chooser is not None:
            self.chooser = SpeculationChooser.for_trees(self.table(trees_by_batch))

    def adopt(self, tuning) -> None:
        """Take the tuner's result: its trees (speculative ones where the measured choice decides), its caps, and
        its choices as where the measured choice starts."""
        self.tuning = tuning
        self.set_trees(trees_by_batch=tuning.speculative_trees() if self.measured else tuning.trees_by_batch())
        self.spec = self.spec.model_copy(update={"verify_cap_by_batch": tuning.verify_cap_by_batch()})
        if self.measured:
            self.chooser = SpeculationChooser.for_trees(tuning.trees_by_batch())

    def summary(self) -> dict:
        """What trees this engine grows (recorded in job outputs and Serve stats); with a measured choice, per batch
        size what steps run now ("plain" where speculation is off) and the tokens/s measured for both modes."""
        s = self.spec
        if not s.trees_by_batch and self.chooser is None:
            return s.tree.model_dump(exclude_none=True)
        table = self.table() if self.chooser is not None else s.trees_by_batch
        out = {"policy": s.tree_policy, "trees_by_batch": {
            str(b): "plain" if is_plain(t) or (self.chooser and not self.chooser.bucket(b).speculate) else
            t.model_dump(exclude_none=True) for b, t in sorted(table.items())}}
        if s.verify_cap_by_batch:
            out["verify_cap_by_batch"] = {str(b): n for b, n in sorted(s.verify_cap_by_batch.items())}
        if self.chooser is not None:
            out["measured"] = self.chooser.summary()
        return out
