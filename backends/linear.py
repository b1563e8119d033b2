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
import weakref

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


class PackedWeight:
    """A weight reordered once for oneDNN (an opaque mkldnn tensor), and,
    where Baton's operator library is loaded, the handle its operators take
    it by (``baton::hold_weight``): torch.compile traces an int, not a
    tensor it cannot fake. Not a module buffer, so it is counted by
    ``nbytes`` (backends/quantization/apply.py) rather than as a buffer."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.tensor = _reorder(weight.detach())
        self.nbytes = self.tensor.numel() * self.tensor.element_size()
        self.handle = 0
        from backends import kernels
        if kernels.loaded():
            self.handle = int(torch.ops.baton.hold_weight(self.tensor))
            weakref.finalize(self, torch.ops.baton.drop_weight, self.handle)


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.packed = PackedWeight(weight)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.handle:  # the same oneDNN call, opaque to torch.compile
            return torch.ops.baton.packed_linear(x, self.packed.handle, self.bias,
                                                 self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed.tensor, self.bias,
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
    weights on a CPU with AMX tiles; linear ``bf16-amx+onednn``), what the
    AMX tile linear multiplies for every batch of 1 to ``amx.max_rows`` rows,
    prefill or decode, oneDNN taking only larger ones: each row's bits
    independent of the rows beside it within that range.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemv,
                 amx=None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.gemv = gemv
        if amx is not None and weight.dtype != torch.bfloat16:
            raise ValueError("the AMX tile linear takes bf16 weights and activations")
        self.amx = amx
        act = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
        w16 = weight.detach().to(torch.bfloat16)
        # The gemv kernel's tiled layout (rows padded to 16, columns to 32).
        self.register_buffer("weight_tiled", gemv.tile(w16), persistent=False)
        self.packed = PackedWeight(w16.to(act))
        b = None if bias is None else bias.detach().to(torch.bfloat16).to(act).contiguous()
        self.register_buffer("bias", b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One operator whatever the rows (baton::linear_tiled picks the
        # kernel in C++): a compiled step has no branch on its token count.
        amx_rows = 0 if self.amx is None else self.amx.max_rows
        return torch.ops.baton.linear_tiled(
            x.reshape(-1, self.in_features), self.weight_tiled, self.packed.handle, None,
            self.bias, self.out_features, 0 if amx_rows else self.gemv.max_rows,
            amx_rows, self.gemv.kind).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bfloat16 weights, {self.packed.tensor.dtype} activations"
                + (f", 1-{self.amx.max_rows} rows on the AMX tiles" if self.amx else ""))


def bf16_weights_linears(model: nn.Module, gemv) -> int:
    """Replace every ``nn.Linear`` (holding bfloat16-exact values) by a
    Bf16WeightLinear. Returns how many were replaced."""
    return _replace_linears(model, lambda w, b: Bf16WeightLinear(w, b, gemv))


class TiledHeadLinear(nn.Module):
    """The output projection of a quantized model with bf16 weights: the
    native gemv's bf16 tiles for up to ``gemv.max_rows`` rows (decoding a few
    sequences, bound by reading the 49k x 576 matrix), ``F.linear`` on the
    weight it was given (often the tied embedding: no second copy) for more.
    A bfloat16 weight (native bf16): both accumulate in float32 and round to
    bf16. A float32 weight of bf16 values (the bf16-weights mode of CPUs
    without native bf16): float32 activations, the gemv widening the tiles in
    registers. Either way only the summation order differs. The tiles are
    the one extra copy."""

    def __init__(self, weight: torch.Tensor, gemv) -> None:
        super().__init__()
        w16 = weight.detach().to(torch.bfloat16)
        if weight.dtype not in (torch.bfloat16, torch.float32) or not torch.equal(
                w16.to(weight.dtype), weight.detach()):
            raise ValueError(f"TiledHeadLinear takes bfloat16 values, not {weight.dtype} "
                             "ones bf16 does not hold")
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.gemv = gemv
        self.weight = weight  # the module's own (tied) parameter, not a copy
        self.register_buffer("weight_tiled", gemv.tile(w16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.baton.linear_tiled(
            x.reshape(-1, self.in_features), self.weight_tiled, 0, self.weight, None,
            self.out_features, self.gemv.max_rows, 0, self.gemv.kind).view(
                *x.shape[:-1], self.out_features)

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
        make = lambda w, b: Bf16WeightLinear(w, b, gemv, amx)  # noqa: E731
    replaced = _replace_linears(model.layers, make) if make is not None else 0
    if type(model.lm_head) is nn.Linear and plan.lm_head != "torch":
        if plan.lm_head == "bf16-gemv+torch":
            from backends.kernels import GemvBf16
            model.lm_head = TiledHeadLinear(model.lm_head.weight, GemvBf16(plan.kernels))
        elif plan.lm_head in ("bf16-gemv+onednn", "bf16-amx+onednn"):
            from backends.kernels import GemvBf16
            model.lm_head = Bf16WeightLinear(model.lm_head.weight, None,
                                             GemvBf16(plan.kernels), amx)
        else:
            model.lm_head = PackedLinear(model.lm_head.weight, None)
    return replaced
