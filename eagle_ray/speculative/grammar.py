"""Structured output: a grammar masks the target's choices at every position and prunes the draft trees.

A request's ``guided_json`` (a JSON schema), ``guided_regex``, ``guided_choice``, ``guided_grammar`` (EBNF) or
``guided_structural_tag`` is compiled by xgrammar (chosen over llguidance by measurement: docs/design.md) into a
grammar shared by every request with the same one (:class:`GrammarCache`, an LRU keyed by the JSON of the field
and its value, keys in their own order: a schema's properties are written in it), on the thread that adds the
request, never on the step's. Each sequence then holds a matcher (:class:`Guide`) at the state its output has
reached.

In a step, each constrained sequence's drafted tree is read to the host once and walked by its matcher
(``traverse_draft_tree``: accept down each path, roll back up): every node gets the mask of the tokens the grammar
allows after it, and a node whose token its parent's mask forbids is dropped with its subtree before the verify
pass (:func:`prune_tree`), so a forbidden node is never verified. At acceptance the target's logits at every node
are masked with that node's mask (:func:`mask_logits`), the bonus token's included, so every emitted token is the
constrained target's own choice: greedy output equals constrained plain decoding token for token, sampled output has
the constrained distribution. The end-of-sequence token is allowed only where the grammar accepts termination, and
a sequence whose grammar can take nothing more ends there (``Guide.finished``).

A reasoning model's output is held to its grammar only once it has thought, as vLLM's structured output waits for
the reasoning parser's end (:meth:`Guide.gate`): where ``<think>`` and ``</think>`` are one token each, nodes on a
path still thinking are left free, the node closing the thinking starts a grammar walk of its own subtree, and where
the output may or may not open a thinking (Qwen3's mode read from its prompt) the first token is the grammar's
or ``<think>``.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np
import torch

from eagle_ray.errors import InvalidRequestError
from eagle_ray.speculative.tree import Tree, keep_nodes
from eagle_ray.uploads import uploads_for

WORD_BITS = 32   # a mask row holds one bit per token in int32 words, as xgrammar fills it


def mask_words(vocab: int) -> int:
    return (vocab + WORD_BITS - 1) // WORD_BITS


def allowed_bits(masks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Whether each of ``tokens`` is allowed by the mask row beside it (``masks [..., words]``, ``tokens [...]``)."""
    words = np.take_along_axis(masks, (tokens >> 5)[..., None], -1)[..., 0]
    return ((words >> (tokens & 31)) & 1).astype(bool)


def _engine_message(err: Exception) -> str:
    """xgrammar's error text without its log prefix (``[time] /path/file.cc:94: ``)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)


class GrammarCache:
    """Compiled grammars of one engine's tokenizer, by request field and value: an LRU of ``capacity`` entries.

    ``compile`` runs on the calling thread (the one adding the request); a second caller asking for a grammar being
    compiled waits for that one instead of compiling it again, and callers asking for others go on. A grammar that
    fails to compile is an :class:`InvalidRequestError` naming the field, and is not kept."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, capacity: int = 64):
        self.tokenizer, self.vocab_size, self.capacity = tokenizer, vocab_size, capacity
        self.stop_ids = sorted(stop_ids)
        self._lock = threading.Lock()
        self._compiler = None
        self._grammars: OrderedDict[str, Future] = OrderedDict()
        self.compiled = 0   # grammars compiled (not found in the cache)

    @staticmethod
    def key(field: str, value) -> str:
        # keys in their own order: a schema's properties are written in it, so two orders are two grammars
        return json.dumps([field, value], separators=(",", ":"), ensure_ascii=False)

    def compiler(self):
        with self._lock:
            if self._compiler is None:   # about a second for a 49k vocabulary: once per engine, at the first request
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, field: str, value):
        key = self.key(field, value)
        with self._lock:
            future = self._grammars.get(key)
            owner = future is None
            if owner:
                future = self._grammars[key] = Future()
                while len(self._grammars) > self.capacity:
                    oldest = next(iter(self._grammars))
                    if not self._grammars[oldest].done():
                        break
                    self._grammars.popitem(last=False)
            else:
                self._grammars.move_to_end(key)
        if owner:
            try:
                future.set_result(self._compile(field, value))
                self.compiled += 1
            except Exception as e:  # noqa: BLE001 - whatever the engine raises, the request is refused
                with self._lock:
                    self._grammars.pop(key, None)
                future.set_exception(InvalidRequestError(f"{field}: the grammar engine cannot compile it: "
                                                         f"{_engine_message(e)}"))
        return future.result()

    def _compile(self, field: str, value):
        compiler = self.compiler()
        if field == "guided_json":   # one line, ", " and ": " between items: no run of whitespace to loop in
            return compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
        if field == "guided_regex":
            return compiler.compile_regex(value)
        if field == "guided_choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))
        if field == "guided_grammar":
            return compiler.compile_grammar(value) if "::=" in value else compiler.compile_lark(value)
        if field == "guided_structural_tag":
            return compile_structural_tag(compiler, value)
        raise ValueError(f"unknown guided field {field}")

    def guide(self, params) -> "Guide | None":
        """A matcher at the start of the output for ``params``' guided field (None: unconstrained)."""
        guided = params.guided
        if guided is None:
            return None
        return Guide(self.compile(*guided), self.vocab_size, self.stop_ids)


THINKING, UNDECIDED, ANSWER = 0, 1, 2   # where a gated output is: thinking, not yet begun (it may open a thinking
                                        # or start its answer), or in its answer (held to the grammar)
PHASES = {"until_close": THINKING, "if_opened": UNDECIDED, "answer": ANSWER}


def compile_structural_tag(compiler, tag: dict):
    """vLLM's ``structural_tag`` response format: xgrammar's own (``{"type": "structural_tag", "format": ...}``),
    or the earlier ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``."""
    import xgrammar as xgr
    if "format" in tag:
        return compiler.compile_structural_tag(json.dumps(tag))
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError("a structural tag needs format, or structures and triggers")
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f"structures[{i}] must be an object with begin and end strings (and a schema)")
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
             for s in structures]
    return compiler.compile_structural_tag(items, triggers)


class Guide:
    """One sequence's grammar matcher, at the state its output has reached, and this step's node masks."""

    def __init__(self, compiled, vocab_size: int, stop_ids):
        import xgrammar as xgr
        self.compiled, self.matcher = compiled, xgr.GrammarMatcher(compiled)
        self.vocab_size, self.words = vocab_size, mask_words(vocab_size)
        self.stop_ids = np.asarray(sorted(stop_ids), dtype=np.int64)
        self.masks: np.ndarray | None = None   # [W, words]: the masks of this step's tree row, in its node order
        self.pruned = 0                        # draft nodes dropped because the grammar forbids them
        self.markers: tuple[int, int] | None = None   # (<think>, </think>) ids of a gated guide
        self.phase = self.start = ANSWER

    def gate(self, mode: str, markers: tuple[int, int]) -> None:
        """Hold the grammar back while the output thinks (``mode``: ``engine/reasoning.py``'s, from the prompt)."""
        self.markers, self.phase = markers, PHASES[mode]
        self.start = self.phase

    def fresh(self) -> "Guide":
        """A matcher of the same grammar at the start (another sample of the request)."""
        guide = Guide(self.compiled, self.vocab_size, self.stop_ids)
        guide.markers, guide.phase, guide.start = self.markers, self.start, self.start
        return guide

    def state_mask(self) -> np.ndarray:
        """``[1, words]``: what the grammar allows next (anything while thinking; ``<think>`` too before a
        thinking may open)."""
        if self.phase == THINKING:
            return np.full((1, self.words), -1, dtype=np.int32)
        out = torch.zeros(1, self.words, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(out, 0)
        out = out.numpy()
        if self.phase == UNDECIDED:
            self._allow_open(out[0])
        return out

    def _allow_open(self, row: np.ndarray) -> None:
        opener = self.markers[0]
        row[opener >> 5] |= np.int32(1) << np.int32(opener & 31)

    def walks(self, tokens: np.ndarray, parents: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """``[W]``: the node whose grammar walk each node of a tree row is in (-1: thinking, or not a node). An
        ungated guide walks the whole tree from its root; a gated one from each node closing the thinking, and
        from the root where the output has not begun (its ``<think>`` children think)."""
        walk = np.full(len(tokens), -1, dtype=np.int64)
        if self.phase == ANSWER:
            walk[valid] = 0
            walk[0] = 0
            return walk
        phase = np.full(len(tokens), THINKING, dtype=np.int64)
        phase[0] = self.phase
        walk[0] = 0 if self.phase == UNDECIDED else -1
        opener, closer = self.markers
        for i in np.flatnonzero(valid[1:]) + 1:   # parents precede children
            p = parents[i]
            if phase[p] == THINKING:
                if tokens[i] == closer:
                    phase[i], walk[i] = ANSWER, i
            elif phase[p] == ANSWER or tokens[i] != opener:
                phase[i], walk[i] = ANSWER, walk[p]
        return walk

    def walk_masks(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """``[N, words]``: the grammar's masks after each node of a subtree (node 0 its root, the matcher's state;
        parents precede children), walked from the matcher's state; nodes it refuses, and theirs, all zero."""
        N = len(tokens)
        first_child = np.full(N, -1, dtype=np.int64)
        next_sibling = np.full(N, -1, dtype=np.int64)
        for i in range(N - 1, 0, -1):   # host bookkeeping of a few dozen nodes: links for the C++ walk
            next_sibling[i], first_child[parents[i]] = first_child[parents[i]], i
        masks = torch.zeros(N, self.words, dtype=torch.int32)
        self.matcher.traverse_draft_tree(torch.from_numpy(first_child), torch.from_numpy(next_sibling),
                                         torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)), masks)
        return masks.numpy()

    def tree_masks(self, tokens: np.ndarray, parents: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(keep ``[W]``, masks ``[W, words]``) of one tree row: a node is kept when the grammar allows its whole
        path; its mask is what the grammar allows after it (all ones on a path still thinking). The matcher ends
        where it started."""
        W = len(tokens)
        walk = self.walks(tokens, parents, valid)
        masks = np.full((W, self.words), -1, dtype=np.int32)
        for root in np.unique(walk[walk >= 0]):
            nodes = np.flatnonzero(walk == root)   # in tree order: the root first
            local = np.zeros(W, dtype=np.int64)
            local[nodes] = np.arange(len(nodes))
            masks[nodes] = self.walk_masks(tokens[nodes], local[parents[nodes]])
        if self.phase == UNDECIDED:
            self._allow_open(masks[0])
        ok = valid & allowed_bits(masks[parents], tokens)
        keep = ok.copy()
        keep[0] = True
        for i in range(1, W):           # parents precede children: a node stands when its parent does
            keep[i] = ok[i] and keep[parents[i]]
        return keep, masks

    def take_masks(self) -> np.ndarray:
        """This step's masks (set by :func:`prune_tree`), or the state's alone for a one-node tree; cleared."""
        masks, self.masks = self.masks, None
        return self.state_mask() if masks is None else masks

    def accept(self, token: int) -> bool:
        """Take an emitted token; False where the grammar refuses it: a dead end, where a vocabulary has no token
        to continue what it allowed (then every logit was masked), and the sequence ends before it. A gated
        guide's thinking passes untouched; the token closing it starts the grammar after it."""
        if self.phase == THINKING:
            if token == self.markers[1]:
                self.phase = ANSWER
            return True
        if self.phase == UNDECIDED:
            if token == self.markers[0]:
                self.phase = THINKING
                return True
            self.phase = ANSWER
        return self.matcher.accept_token(token)

    def finished(self) -> bool:
        """The grammar took a stop token, or it is complete and allows nothing more but one."""
        if self.phase != ANSWER:
            return False
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        row = self.state_mask()[0].copy()
        stops = self.stop_ids[self.stop_ids < self.vocab_size]
        row[stops >> 5] &= ~(np.int32(1) << (stops & 31).astype(np.int32))
        return not row.any()


def prune_tree(tree: Tree, seqs: list) -> Tree:
    """The drafted ``tree`` of ``seqs`` without the nodes their grammars forbid (reads the tree to the host once,
    only in a step with a constrained sequence); each constrained sequence's ``guide.masks`` get the kept nodes'
    masks, in the pruned tree's node order, and ``guide.pruned`` counts what was dropped."""
    B, T = tree.tokens.shape
    host = torch.cat([tree.tokens, tree.parents, tree.valid.long()], 1).cpu().numpy()
    tokens, parents, valid = host[:, :T], host[:, T:2 * T], host[:, 2 * T:].astype(bool)
    keep = valid.copy()
    masks: dict[int, np.ndarray] = {}
    for b, s in enumerate(seqs):
        if s.guide is not None:
            keep[b], masks[b] = s.guide.tree_masks(tokens[b], parents[b], valid[b])
            masks[b][~keep[b]] = -1   # dropped and padding nodes: never accepted, and no row all -inf
            s.guide.pruned += int((valid[b] & ~keep[b]).sum())
    width = int(keep.sum(1).max())
    idx = np.arange(T)
    order = np.argsort(np.where(keep, idx, idx + T), axis=1)[:, :width]   # as keep_nodes orders them
    for b, m in masks.items():
        seqs[b].guide.masks = m[order[b]]
    if (keep == valid).all():
        return tree
    return keep_nodes(tree, uploads_for(tree.tokens.device).ints(keep.astype(np.int64)).bool(), width)


def unpack_masks(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., words]`` int32 bit masks as ``[..., vocab]`` booleans."""
    shifts = torch.arange(WORD_BITS, dtype=masks.dtype, device=masks.device)
    return ((masks.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :vocab].bool()


def mask_logits(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """``logits [B, W, V]`` with each constrained sequence's rows masked by its grammar at every node (-inf where
    forbidden): the masks ``prune_tree`` left on its guide, or its state's for a one-node tree. A new tensor."""
    rows = [b for b, s in enumerate(seqs) if s.guide is not None]
    if not rows:
        return logits
    B, W, V = logits.shape
    host = np.full((len(rows), W, mask_words(V)), -1, dtype=np.int32)   # padding nodes: all allowed
    for r, b in enumerate(rows):
        m = seqs[b].guide.take_masks()
        host[r, : len(m), : m.shape[1]] = m[:W]
    device = logits.device
    index = uploads_for(device).ints(rows)
    allowed = unpack_masks(torch.from_numpy(host).to(device), V)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return out
