"""GGUF weights left quantized: the raw blocks the loader hands through, their
lossless decoding into Int4Weights (Q4_0, Q4_1, Q4_K) or block-scaled int8
(Q8_0), and the module that runs Q8_0.

Block layouts (little-endian, as llama.cpp's ggml-common.h):
  Q8_0: 32 weights: d fp16, then 32 int8 q           w = d * q
  Q4_0: 32 weights: d fp16, then 16 bytes            w = d * (q - 8)
  Q4_1: 32 weights: d fp16, m fp16, then 16 bytes    w = d * q + m
where in the 16 bytes, byte j holds weight j in its low nibble and weight
j + 16 in its high nibble.
  Q4_K: 256 weights: d fp16, dmin fp16, 12 bytes of eight 6-bit scales sc_j and
        minimums m_j, then 128 bytes of nibbles (per 64 weights: 32 low nibbles,
        then the same bytes' 32 high nibbles)       w = (d * sc_j) * q - dmin * m_j
        for weight k in sub-block j = k // 32.
Any other type (Q5_0, Q6_K ...) is only carried through so the quantization
step can say what it became; it is dequantized there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backends.quantization.int4 import Int4Weights, pack_nibbles
from backends.quantization.spec import GGUF_BLOCK

INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})


def block_layout(ggml_type: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]


@dataclass(slots=True)
class GGUFBlocks:
    """A GGUF tensor kept as stored: ``data`` uint8 [rows, bytes per row],
    rows already in Hugging Face order; ``shape`` is the torch shape
    (rows, columns) of the matrix it encodes."""

    data: torch.Tensor
    ggml_type: str
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        block, size = block_layout(self.ggml_type)
        expected = (rows, cols // block * size)
        if cols % block or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.ggml_type} data of shape {tuple(self.data.shape)} "
                             f"cannot encode a {rows}x{cols} matrix")

    def blocks(self) -> torch.Tensor:
        """[rows, blocks per row, bytes per block]."""
        return self.data.view(self.shape[0], -1, block_layout(self.ggml_type)[1])

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, columns], as the loader decodes every other tensor."""
        from gguf import GGMLQuantizationType

        from backends.loader.gguf_dequant import dequantize
        return dequantize(self.data.numpy(), GGMLQuantizationType[self.ggml_type], self.shape)


def _fp16(fields: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> float32 [...]."""
    return fields.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def q4_to_int4(blocks: GGUFBlocks) -> Int4Weights:
    """Q4_0 / Q4_1 / Q4_K -> Int4Weights with group size 32, exactly: the
    codes are the file's nibbles, scale = d, zero = m + 8d (Q4_1) or 0 (Q4_0);
    for Q4_K see q4_k_to_int4."""
    if blocks.ggml_type == "Q4_K":
        return q4_k_to_int4(blocks)
    raw = blocks.blocks()
    rows = blocks.shape[0]
    d = _fp16(raw[..., 0:2])
    if blocks.ggml_type == "Q4_1":
        zeros = _fp16(raw[..., 2:4]) + 8.0 * d
        nibbles = raw[..., 4:]
    elif blocks.ggml_type == "Q4_0":
        zeros = torch.zeros_like(d)
        nibbles = raw[..., 2:]
    else:
        raise ValueError(f"{blocks.ggml_type} is not a 4-bit GGUF type")
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, -1)
    return Int4Weights(pack_nibbles(codes), d, zeros, GGUF_BLOCK)


def q4_k_to_int4(blocks: GGUFBlocks) -> Int4Weights:
    """Q4_K -> Int4Weights with group size 32: a super-block's eight
    sub-blocks of 32 are eight groups, with scale s = d * sc_j and zero
    z = 8 s - dmin * m_j, so (q - 8) s + z = s q - dmin m_j. The codes are the
    file's; s is exact in float32 (an 11-bit by a 6-bit integer), z is one
    float32 rounding away from exact."""
    from backends.loader.gguf_dequant import k_scale_min

    raw = blocks.blocks()
    rows, per_row = raw.shape[:2]
    flat = raw.reshape(rows * per_row, -1)
    d, dmin = _fp16(flat[:, 0:2]), _fp16(flat[:, 2:4])
    sc, mn = k_scale_min(flat[:, 4:16])
    scales = d[:, None] * sc.to(torch.float32)
    zeros = 8.0 * scales - dmin[:, None] * mn.to(torch.float32)
    nibbles = flat[:, 16:].reshape(-1, 4, 1, 32)
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2).reshape(rows, -1)
    return Int4Weights(pack_nibbles(codes), scales.reshape(rows, -1),
                       zeros.reshape(rows, -1), GGUF_BLOCK)


def q8_0_to_int8(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 -> (codes int8 [N, K], scales float16 [N, K/32]), exactly."""
    if blocks.ggml_type != "Q8_0":
        raise ValueError(f"{blocks.ggml_type} is not Q8_0")
    raw = blocks.blocks()
    scales = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    codes = raw[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape)
    return codes, scales


def pair_layout(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K a multiple of 32) in the layout of the native
    kernels' 8-bit rows (int4_linear.c): each two blocks of 32 as their even
    columns, then their odd ones (64 bytes); a last block alone as its even
    columns, then its odd ones."""
    n, k = codes.shape
    blocks = k // GGUF_BLOCK
    even, odd = codes.view(n, blocks, GGUF_BLOCK // 2, 2).unbind(-1)
    full = blocks // 2 * 2
    parts = [torch.cat([even[:, :full].reshape(n, full // 2, GGUF_BLOCK),
                        odd[:, :full].reshape(n, full // 2, GGUF_BLOCK)], -1).reshape(n, -1)]
    if blocks % 2:
        parts.append(torch.cat([even[:, -1], odd[:, -1]], -1))
    return torch.cat(parts, -1).contiguous()


class BlockInt8Linear(nn.Module):
    """Q8_0 weights (int8 with one fp16 scale per 32 inputs) kept as they are.

    torch ships no kernel for block-scaled int8, so each call expands the
    weight to the activation dtype and runs a dense matmul: the memory saving
    holds, the speed is that of the dense path or a little below. Given
    ``native_kind`` (the bf16-weights mode's 8-bit rows, float32
    activations), Baton's kernel instead: each block of 32 of a row rounded
    to int8 and the products summed in integers
    (``torch.ops.baton.int8_linear_q8``, backends/kernels/int4_linear.c),
    the codes held in that kernel's pair layout, scales in the file's
    float16 (the kernel widens them exactly).
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, native_kind: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.native_kind = native_kind
        if native_kind is not None:
            from backends.kernels import kind_id
            self.kind = kind_id(native_kind)
            codes, scales = pair_layout(codes), scales.half().contiguous()
            bias = None if bias is None else bias.to(torch.float32).contiguous()
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_kind is not None:
            return torch.ops.baton.int8_linear_q8(
                x.reshape(-1, self.in_features).contiguous(), self.weight, self.scales,
                self.bias, self.kind).view(*x.shape[:-1], self.out_features)
        n, k = self.weight.shape
        w = (self.weight.view(n, -1, GGUF_BLOCK).to(x.dtype)
             * self.scales.to(x.dtype)[..., None]).view(n, k)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={GGUF_BLOCK}, bias={self.bias is not None}"
                + (f", native {self.native_kind}, int8 rows" if self.native_kind else ""))
