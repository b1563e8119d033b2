"""Linear layers with weights reordered once for oneDNN (CPU).

A plain ``F.linear`` on CPU lets the BLAS pack the weight matrix into its
blocked layout on every call; for the small batches of decoding that packing
costs as much as the arithmetic. ``PackedLinear`` holds the weight in oneDNN's
layout, reordered once at load time, and calls oneDNN's linear directly. The
results equal ``F.linear``'s up to float rounding (a different summation order).

On devices or dtypes oneDNN cannot serve (CUDA; bfloat16 on CPUs without native
bf16 instructions) nothing is replaced and the model keeps ``nn.Linear``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("baton.backend")

# Batch size oneDNN chooses the packed layout for: decode batches are around
# here; prefill chunks (hundreds of rows) run on the same layout at full speed.
PACK_BATCH_HINT = 32


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True when oneDNN can run a prepacked linear here (probed, not guessed:
    torch raises for dtypes this CPU lacks instructions for)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), _reorder(w),
                                                 None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.all(out == 8))


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        # A buffer, not a parameter: the opaque layout has no strides to save.
        self.register_buffer("packed_weight", _reorder(weight.detach()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                  "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def _replace_linears(model: nn.Module, make) -> int:
    """Replace every plain ``nn.Linear`` inside ``model`` by ``make(weight,
    bias)``. Returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child.weight, child.bias))
                replaced += 1
    return replaced


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by a PackedLinear. Returns
    how many were replaced. The caller checks ``packing_supported`` first."""
    return _replace_linears(model, PackedLinear)


class Bf16WeightLinear(nn.Module):
    """A linear layer with bfloat16 weights that keeps them in two layouts:
    the native gemv's tiles for up to ``gemv.max_rows`` input rows (decoding
    a few sequences, bound by reading the weights) and oneDNN's packed layout
    for more rows (bound by arithmetic).

    Its arithmetic follows the dtype of the weight it is given:

    * float32 weight holding bfloat16 values (the bf16-weights mode of CPUs
      without native bf16, where torch emulates bf16 matmuls several times
      slower than float32): float32 activations; the gemv widens the bf16
      tiles in registers (half the bytes of float32), oneDNN runs its float32
      kernel on an exact float32 copy;
    * bfloat16 weight (CPUs with native bf16): bfloat16 activations; the gemv
      (VDPBF16PS where the CPU has it) and oneDNN's bf16 kernel (AMX where
      present) both accumulate in float32 and round the output to bf16.

    Either way the batch size changes only the summation order. The tiles are
    a second copy of the weights beside oneDNN's: it is what the whole-step
    decode (backends/kernels/decode_bf16.c) streams, and, given ``amx`` (bf16
    weights on a CPU with AMX tiles), what the AMX tile linear multiplies for
    batches up to ``amx.max_rows`` (decode steps); larger ones take oneDNN.
    With ``every_row`` (linear ``bf16-amx+onednn``; ``amx`` required) the
    AMX tile linear takes every batch of 1 to ``amx.max_rows`` rows, prefill
    or decode, and oneDNN only larger ones: each row's bits independent of
    the rows beside it within that range.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemv,
                 amx=None, every_row: bool = False) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.gemv = gemv
        self.amx = amx if weight.dtype == torch.bfloat16 else None
        if every_row and self.amx is None:
            raise ValueError("a Bf16WeightLinear with every_row needs bf16 weights and the "
                             "AMX tile linear")
        self.every_row = every_row
        act = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
        w16 = weight.detach().to(torch.bfloat16)
        # The gemv kernel's tiled layout (rows padded to 16, columns to 32).
        self.register_buffer("weight_tiled", gemv.tile(w16), persistent=False)
        self.register_buffer("packed_weight", _reorder(w16.to(act)), persistent=False)
        b = None if bias is None else bias.detach().to(torch.bfloat16).to(act).contiguous()
        self.register_buffer("bias", b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 0:  # a step that samples no row
            return x.new_empty(0, self.out_features)
        if self.every_row and x.dim() == 2 and x.shape[0] <= self.amx.max_rows:
            return self.amx(x, self.weight_tiled, self.out_features, self.bias)
        if x.dim() == 2 and x.shape[0] <= self.gemv.max_rows:
            return self.gemv(x, self.weight_tiled, self.out_features, self.bias)
        if (self.amx is not None and self.amx.enabled and x.dim() == 2
                and x.shape[0] <= self.amx.max_rows):
            return self.amx(x, self.weight_tiled, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                  "none", [], "")

    def features_only(self, x: torch.Tensor, features: torch.Tensor,
                      w_tiled: torch.Tensor) -> torch.Tensor:
        """``forward(x)[:, features]`` from ``w_tiled`` (``gemv.tile`` of
        those rows of the weight) by the kernel ``forward`` takes for x's
        rows, for calls of up to the gemv's rows: the AMX tile linear or the
        gemv, where each output's bits depend only on its weight row and its
        input row, so they are ``forward``'s (the greedy screen's exact pass)."""
        if x.dim() != 2 or not 0 < x.shape[0] <= self.gemv.max_rows:
            raise ValueError(f"features_only takes 1 to {self.gemv.max_rows} rows")
        bias = None if self.bias is None else self.bias[features].contiguous()
        if self.every_row and x.shape[0] <= self.amx.max_rows:
            return self.amx(x, w_tiled, len(features), bias)
        return self.gemv(x, w_tiled, len(features), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bfloat16 weights, {self.packed_weight.dtype} activations"
                + (f", 1-{self.amx.max_rows} rows on the AMX tiles" if self.every_row else ""))


def bf16_weights_linears(model: nn.Module, gemv) -> int:
    """Replace every ``nn.Linear`` (holding bfloat16-exact values) by a
    Bf16WeightLinear. Returns how many were replaced."""
    return _replace_linears(model, lambda w, b: Bf16WeightLinear(w, b, gemv))


class TiledHeadLinear(nn.Module):
    """The output projection of a quantized model in native bf16: the native
    gemv's bf16 tiles for up to ``gemv.max_rows`` rows (decoding a few
    sequences, bound by reading the 49k x 576 matrix), ``F.linear`` on the
    weight it was given (often the tied embedding: no second copy) for more.
    Both accumulate in float32 and round to bf16; only the summation order
    differs. The tiles are the one extra copy."""

    def __init__(self, weight: torch.Tensor, gemv) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"TiledHeadLinear takes a bfloat16 weight, not {weight.dtype}")
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.gemv = gemv
        self.weight = weight  # the module's own (tied) parameter, not a copy
        self.register_buffer("weight_tiled", gemv.tile(weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self.gemv.max_rows:
            return self.gemv(x, self.weight_tiled, self.out_features)
        return torch.nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bf16 gemv tiles for <= {self.gemv.max_rows} rows")


def swap_linears(model: nn.Module, plan) -> int:
    """Give the decoder layers' linear modules and the output projection
    (``model.layers``, ``model.lm_head``) the implementation ``plan`` names
    (backends/execution.py): ``onednn`` / ``onednn-f32-copy`` PackedLinear,
    ``bf16-gemv+onednn`` Bf16WeightLinear (float32 weights of bf16 values, or
    bf16 weights: the model's activation dtype; with ``amx_linear_rows`` its
    decode batches on the AMX tile linear), ``bf16-amx+onednn`` the same
    with every call of up to ``amx_linear_rows`` rows on the AMX tile linear
    (prefill chunks too), oneDNN above; ``torch`` and the quantized
    kinds keep what loading put there. Returns how many layer linears
    changed."""
    make = None
    amx = None
    if plan.amx_linear_rows:
        from backends.kernels import LinearAmx
        amx = LinearAmx(plan.kernels, plan.amx_linear_rows)
    if plan.linear in ("onednn", "onednn-f32-copy"):
        make = PackedLinear
    elif plan.linear in ("bf16-gemv+onednn", "bf16-amx+onednn"):
        from backends.kernels import GemvBf16
        gemv = GemvBf16(plan.kernels)
        every = plan.linear == "bf16-amx+onednn"
        make = lambda w, b: Bf16WeightLinear(w, b, gemv, amx, every)  # noqa: E731
    replaced = _replace_linears(model.layers, make) if make is not None else 0
    if type(model.lm_head) is nn.Linear and plan.lm_head != "torch":
        if plan.lm_head == "bf16-gemv+torch":
            from backends.kernels import GemvBf16
            model.lm_head = TiledHeadLinear(model.lm_head.weight, GemvBf16(plan.kernels))
        elif plan.lm_head in ("bf16-gemv+onednn", "bf16-amx+onednn"):
            from backends.kernels import GemvBf16
            model.lm_head = Bf16WeightLinear(model.lm_head.weight, None,
                                             GemvBf16(plan.kernels), amx,
                                             every_row=plan.lm_head == "bf16-amx+onednn")
        else:
            model.lm_head = PackedLinear(model.lm_head.weight, None)
    return replaced
