"""Repetition, frequency and presence penalties and logit bias, applied as vLLM applies them, to every node of a tree.

At a tree node the target predicts the token after the node's path, so the penalties there count the sequence's
output *and the path's own tokens* (the node and its ancestors; the root, the last emitted token, is already in
the output): each node is scored as plain decoding would score it had the path been emitted. Acceptance then walks
the penalised choices, so speculation stays lossless for the penalised distribution.

Formulas (vLLM's sampler, in its order: logit bias, then penalties; temperature, top-k and top-p come after):

- ``logit_bias``: added to the raw logit of each listed token;
- ``repetition_penalty`` r over the prompt's and the output's tokens: a positive logit is divided by r, a negative
  one multiplied by r;
- ``frequency_penalty`` f and ``presence_penalty`` p over the output's tokens: ``logit -= f * count + p * (count > 0)``.

Counts are built per step on the device with ``scatter_add`` from the token ids (the output's, padded, and the
tree's tokens through its ancestor mask): no loop over nodes, nothing kept per slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eagle_ray.uploads import padded, uploads_for


def penalised(params) -> bool:
    """Whether a request's logits are changed by penalties or a logit bias."""
    return bool(params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0
                or params.logit_bias)


@dataclass
class PenaltyBatch:
    """The penalised rows of a block of sequences, their parameters and token ids as device tensors."""
    rows: torch.Tensor           # [R] which rows of the block are penalised
    frequency: torch.Tensor      # [R]
    presence: torch.Tensor       # [R]
    repetition: torch.Tensor     # [R]
    output_ids: torch.Tensor     # [R, L] the output so far, padded with ``vocab`` (a bin that is dropped)
    prompt_ids: torch.Tensor | None   # [R, P] likewise the prompt (only where a row has a repetition penalty)
    bias_ids: torch.Tensor | None     # [R, K] logit-bias token ids, padded with ``vocab``
    bias: torch.Tensor | None         # [R, K] their biases

    @staticmethod
    def arrays_of(seqs: list, vocab: int) -> list:
        """The host arrays a block's penalties need (staged with the step's other small inputs); [] when none."""
        picked = [s for s in seqs if penalised(s.params)]
        if not picked:
            return []
        rows = [i for i, s in enumerate(seqs) if penalised(s.params)]
        params = [[s.params.frequency_penalty, s.params.presence_penalty, s.params.repetition_penalty]
                  for s in picked]
        arrays = [rows, np.asarray(params, dtype=np.float64).view(np.int64), padded([s.output_ids for s in picked],
                                                                                     vocab)]
        if any(s.params.repetition_penalty != 1.0 for s in picked):
            arrays.append(padded([s.prompt_ids for s in picked], vocab))
        if any(s.params.logit_bias for s in picked):
            biases = [sorted((s.params.logit_bias or {}).items()) for s in picked]
            arrays.append(padded([[k for k, _ in b] for b in biases], vocab))
            width = arrays[-1].shape[1]
            arrays.append(np.asarray([[v for _, v in b] + [0.0] * (width - len(b)) for b in biases],
                                     dtype=np.float64).view(np.int64))
        return arrays

    @classmethod
    def of(cls, seqs: list, vocab: int, device) -> "PenaltyBatch | None":
        """From sequences' ``params``, ``prompt_ids`` and ``output_ids`` (their staged views where staged)."""
        arrays = cls.arrays_of(seqs, vocab)
        if not arrays:
            return None
        upload = uploads_for(device)
        rows, params, output = (upload.ints(a) for a in arrays[:3])
        params = params.view(torch.float64).float()
        rest = arrays[3:]
        prompt = upload.ints(rest.pop(0)) if any(s.params.repetition_penalty != 1.0 for s in seqs) else None
        bias_ids = bias = None
        if rest:
            bias_ids, bias = upload.ints(rest[0]), upload.ints(rest[1]).view(torch.float64).float()
        return cls(rows, params[:, 0], params[:, 1], params[:, 2], output, prompt, bias_ids, bias)


def bin_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``ids [R, L]`` (padded with ``vocab``) as counts per token ``[R, vocab]``."""
    counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :vocab]


def path_counts(tokens: torch.Tensor, ancestors: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per node, how often each token occurs on its path below the root: ``[R, T, vocab]`` from the tree's
    ``tokens [R, T]`` and reflexive ``ancestors [R, T, T]``."""
    R, T = tokens.shape
    weight = ancestors.float()
    weight[:, :, 0] = 0.0    # the root is the last emitted token: already counted in the output
    counts = torch.zeros(R, T, vocab, device=tokens.device)
    return counts.scatter_add_(2, tokens.unsqueeze(1).expand(R, T, T), weight)


def apply_penalties(logits: torch.Tensor, batch: PenaltyBatch, tokens: torch.Tensor | None = None,
                    ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [B, T, V]`` with the penalised rows' logit bias and penalties applied at every node (a new tensor;
    the raw logits stay as they were). ``tokens``/``ancestors``: the block's tree (None: no path, as for a
    prompt's first token)."""
    B, T, V = logits.shape
    rows = batch.rows
    x = logits[rows].float()                                                   # [R, T, V]
    if batch.bias_ids is not None:
        bias = torch.zeros(len(rows), V + 1, device=x.device).scatter_add_(1, batch.bias_ids, batch.bias)
        x = x + bias[:, :V].unsqueeze(1)
    counts = bin_counts(batch.output_ids, V).unsqueeze(1)                      # [R, 1, V]
    if tokens is not None and T > 1:
        counts = counts + path_counts(tokens[rows], ancestors[rows], V)
    seen = counts > 0
    if batch.prompt_ids is not None:
        repeated = seen | (bin_counts(batch.prompt_ids, V) > 0).unsqueeze(1)
        r = batch.repetition.view(-1, 1, 1)
        x = torch.where(repeated, torch.where(x > 0, x / r, x * r), x)
    x = x - batch.frequency.view(-1, 1, 1) * counts - batch.presence.view(-1, 1, 1) * seen
    out = logits.clone() if logits.dtype == x.dtype else logits.float()
    out[rows] = x
    return out
