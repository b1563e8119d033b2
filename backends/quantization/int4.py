"""Weight-only int4 in groups along the input dimension, and the module that
runs it.

``Int4Weights`` is the device-neutral form every int4 source is brought to
(quantization of a float matrix here, GGUF's Q4_0 / Q4_1 blocks in ggml.py):
4-bit codes q in 0..15, two per byte, and per group a scale and a zero with

    w[n, k] = (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]

which is the form torch's int4 kernels take. ``Int4Linear`` repacks it into
the kernel's own (opaque, device-specific) layout once, at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backends.quantization import kernels


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> bytes [N, K/2]; column 2j in the low
    nibble, 2j + 1 in the high nibble."""
    pairs = codes.to(torch.uint8).view(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: bytes [N, K/2] -> uint8 codes [N, K]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)


@dataclass(slots=True)
class Int4Weights:
    """``packed`` uint8 [N, K/2] (see pack_nibbles); ``scales`` and ``zeros``
    float32 [N, K/G]."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def codes(self) -> torch.Tensor:
        return unpack_nibbles(self.packed)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = self.codes().to(torch.float32).view(n, -1, self.group_size) - 8.0
        return (q * self.scales[..., None] + self.zeros[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Int4Weights]) -> Int4Weights:
        """Stack along output rows. Groups run along the input dimension, so
        this is exact."""
        group = parts[0].group_size
        if any(p.group_size != group or p.shape[1] != parts[0].shape[1] for p in parts):
            raise ValueError("int4 parts differ in group size or input width")
        return Int4Weights(torch.cat([p.packed for p in parts]),
                           torch.cat([p.scales for p in parts]),
                           torch.cat([p.zeros for p in parts]), group)


def quantize_int4(weight: torch.Tensor, group_size: int,
                  scale_dtype: torch.dtype = torch.float32) -> Int4Weights:
    """Asymmetric min/max int4 per group of ``group_size`` input columns.

    Scale and zero are rounded to ``scale_dtype`` (the kernel's) first and the
    codes chosen against the rounded values, so what the kernel computes is
    what was quantized.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input width {k}")
    w = weight.to(torch.float32).reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo).clamp(min=1e-6) / 15.0).to(scale_dtype).to(torch.float32)
    zeros = (lo + 8.0 * scales).to(scale_dtype).to(torch.float32)
    codes = torch.round((w - zeros[..., None]) / scales[..., None] + 8.0).clamp(0, 15)
    return Int4Weights(pack_nibbles(codes.view(n, k).to(torch.uint8)), scales, zeros,
                       group_size)


def _exact_in_half(t: torch.Tensor) -> bool:
    """Every value of float32 ``t`` is a float16 (widening it back gives the same bits)."""
    return bool(torch.equal(t.half().float(), t))


class Int4Linear(nn.Module):
    """y = x @ dequant(W).T + bias through torch's int4 kernel for the device,
    or, given ``native_kind`` (float32 activations on a CPU without native
    bf16, where torch's kernel wants bf16 and emulates it), Baton's native
    one (``torch.ops.baton.int4_linear``, backends/kernels/int4_linear.c).

    ``q8`` (native kernel only): each block of 32 columns of a row is
    rounded to int8 on its own scale and multiplied in integers
    (int4_linear.c, baton_int4_linear_q8), the bf16-weights mode's numerics.

    Buffers, torch's kernel: ``weight`` in the kernel's layout,
    ``scales_and_zeros`` [K/G, N', 2] in the kernel's dtype, ``bias`` [N] in
    the serving dtype or None. N' is N rounded up to a multiple of 16 (the
    kernels pack rows in tiles); the padding rows are zero and sliced off.
    The native kernel: ``weight`` the packed codes [N, K/2], ``scales`` and
    ``mins`` float32 [N, K/G] (w = q * scale + min), ``bias`` float32; with
    8-bit rows, ``scales`` and ``mins`` are float16 where every value is one
    (a Q4_0 / Q4_1 file's), the kernel widening them exactly.
    """

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None,
                 device: torch.device, serving_dtype: torch.dtype,
                 native_kind: str | None = None, q8: bool = False) -> None:
        super().__init__()
        if q8 and native_kind is None:
            raise ValueError("8-bit rows need the native int4 kernel")
        self.q8 = q8
        self.out_features, self.in_features = weights.shape
        self.group_size = weights.group_size
        self.native_kind = native_kind
        if native_kind is not None:
            from backends.kernels import kind_id
            self.kind = kind_id(native_kind)
            scales = weights.scales.to(torch.float32).contiguous()
            mins = (weights.zeros - 8.0 * weights.scales).to(torch.float32).contiguous()
            if q8 and self.group_size == 32 and _exact_in_half(scales) and _exact_in_half(mins):
                # A GGUF file's Q4_0 / Q4_1 values: the same numbers in half the
                # bytes (a sixth less to read a step), widened by the kernel.
                scales, mins = scales.half(), mins.half()
            self.register_buffer("weight", weights.packed.contiguous())
            self.register_buffer("scales", scales)
            self.register_buffer("mins", mins)
            self.register_buffer(
                "bias", None if bias is None else bias.to(torch.float32).contiguous())
            return
        kernel_dtype = kernels.compute_dtype("int4", device, serving_dtype)
        pad = -self.out_features % kernels.INT4_ROW_MULTIPLE
        codes, scales, zeros = weights.codes(), weights.scales, weights.zeros
        if pad:
            codes = torch.cat([codes, codes.new_full((pad, self.in_features), 8)])
            scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
            zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
        self.register_buffer("weight", kernels.int4_pack(codes, device))
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1)
                             .transpose(0, 1).contiguous().to(device=device, dtype=kernel_dtype))
        self.register_buffer(
            "bias", None if bias is None else bias.to(device=device, dtype=serving_dtype))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                   device: torch.device, serving_dtype: torch.dtype,
                   native_kind: str | None = None, q8: bool = False) -> Int4Linear:
        scale_dtype = (torch.float32 if native_kind is not None
                       else kernels.compute_dtype("int4", device, serving_dtype))
        return cls(quantize_int4(weight, group_size, scale_dtype), bias, device, serving_dtype,
                   native_kind, q8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_kind is not None:
            return torch.ops.baton.int4_linear(
                x.reshape(-1, self.in_features).contiguous(), self.weight, self.scales,
                self.mins, self.bias, self.group_size, self.kind, self.q8).view(
                    *x.shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        y = kernels.int4_mm(x2, self.weight, self.group_size, self.scales_and_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows = "int8 rows" if self.q8 else "float32"
        kernel = (f"native {self.native_kind}, {rows}" if self.native_kind is not None
                  else f"kernel_dtype={self.scales_and_zeros.dtype}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, {kernel}, "
                f"bias={self.bias is not None}")
