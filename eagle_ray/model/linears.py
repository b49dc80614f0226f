"""CPU layouts for the target's linears: few-row products (a verify block, a tree level) are what speculation
multiplies, and on CPU the kernel behind ``nn.Linear`` makes them cost several single-row products.

``numerics_for`` picks one per device and dtype (``Numerics.cpu_linears``):

- ``packed`` (fp32 on CPU with oneDNN; bf16 too where the CPU has native bf16): the weight in oneDNN's own
  blocked layout, run by oneDNN's kernel, which keeps a few-row product close to the cost of one row where MKL's
  sgemm behind ``nn.Linear`` does not (figures per CPU: docs/benchmarks.md, ``bench/costs.py``).
- ``input_major`` (fp32 where oneDNN is missing, and whenever Inductor compiles the forwards): the weight
  stored [in, out].
- ``native`` (CUDA; fp16, and bf16 without native bf16, on CPU): ``nn.Linear`` as loaded. oneDNN packs neither
  emulated dtype, and an emulated product over an input-major weight costs several times one over this layout
  (bf16 on an AVX2 CPU: a verify pass 5-7x, the lm_head 37-48x; ``bench/costs.py linears --dtype bfloat16``).

Either CPU layout replaces the dense weight (same bytes), except the lm_head, which keeps it: the draft head and
the exact logits read it. A packed call costs tens of microseconds around oneDNN's kernel, more than a small
product takes in any layout: fp32 weights under the device table's ``packed_min_weights`` (a tiny model's, a
135M target's key and value projections) stay input-major (``layout_of``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle_ray.model.numerics import defaults_for


class InputMajorLinear(torch.nn.Module):
    """``y = x @ W^T + b`` with ``W^T`` stored contiguous (input-major)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_dense: bool = False):
        super().__init__()
        self.weight_t = torch.nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        if keep_dense:
            self.weight = self.weight_t.t()   # a view: no extra bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class PackedLinear(torch.nn.Module):
    """``y = x @ W^T + b`` by oneDNN on a weight it laid out once (an opaque tensor, not a parameter)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_dense: bool = False):
        super().__init__()
        w = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = w.shape
        if keep_dense:
            self.weight = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __deepcopy__(self, memo):
        import copy
        new = copy.copy(self)
        new.__dict__ = {k: (v.clone() if k == "packed" else copy.deepcopy(v, memo)) for k, v in self.__dict__.items()}
        return new


LAYOUTS = {"input_major": InputMajorLinear, "packed": PackedLinear}   # the CPU layouts by name ("native": none)


def packs(numel: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether the packed layout packs a weight of ``numel`` elements: not an fp32 one under the device table's
    ``packed_min_weights`` (measured in fp32 only), whose product is shorter than oneDNN's call."""
    return dtype != torch.float32 or numel >= defaults_for(device_type).packed_min_weights


def layout_of(kind: str, weight: torch.Tensor) -> str:
    """The layout a linear of ``weight`` takes where the target's is ``kind``: a weight the packed layout does not
    pack (``packs``) is input-major."""
    return "input_major" if kind == "packed" and not packs(weight.numel(), weight.dtype, weight.device.type) else kind


def laid_out(linear: torch.nn.Linear, kind: str, keep_dense: bool = False) -> torch.nn.Module:
    """``linear`` in layout ``kind`` (``layout_of``)."""
    kind = layout_of(kind, linear.weight)
    if kind == "native":
        return linear
    return LAYOUTS[kind](linear.weight, linear.bias, keep_dense)


def lay_out_linears(module: torch.nn.Module, kind: str, keep_dense: tuple[str, ...] = ()) -> None:
    """Swap every nn.Linear under ``module`` for layout ``kind`` (in place); children named in ``keep_dense``
    keep their dense weight as well."""
    if kind == "native":
        return
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, laid_out(child, kind, name in keep_dense))
        else:
            lay_out_linears(child, kind, keep_dense)


class Scorer:
    """A draft head's logits over the rows of a scoring matrix: a plain object, so that neither the target's
    lm_head nor a gathered copy of its rows is registered as (or saved with) the head's parameters."""

    def __init__(self, linear: torch.nn.Module | None = None, weight: torch.Tensor | None = None):
        self.linear, self.weight = linear, weight

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden) if self.linear is not None else F.linear(hidden, self.weight)

    def __deepcopy__(self, memo):
        return self   # read-only, and the target's: a copied head scores the same way


def scorer(weight: torch.Tensor, kind: str) -> Scorer:
    """Scores against a [rows, hidden] matrix, laid out like the target's linears (``kind``)."""
    kind = layout_of(kind, weight)
    if kind == "native":
        return Scorer(weight=weight)
    return Scorer(LAYOUTS[kind](weight, None))
