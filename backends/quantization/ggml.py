"""GGUF weights left quantized: the raw blocks the loader hands through, their
lossless decoding into Int4Weights (Q4_0, Q4_1) or block-scaled int8 (Q8_0),
and the module that runs Q8_0.

Block layouts (32 weights each, little-endian, as llama.cpp's ggml-common.h):
  Q8_0: d fp16, then 32 int8 q                 w = d * q
  Q4_0: d fp16, then 16 bytes                  w = d * (q - 8)
  Q4_1: d fp16, m fp16, then 16 bytes          w = d * q + m
where in the 16 bytes, byte j holds weight j in its low nibble and weight
j + 16 in its high nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from backends.quantization.int4 import Int4Weights, pack_nibbles
from backends.quantization.spec import GGUF_BLOCK

_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


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
        expected = (rows, cols // GGUF_BLOCK * _BLOCK_BYTES[self.ggml_type])
        if cols % GGUF_BLOCK or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.ggml_type} data of shape {tuple(self.data.shape)} "
                             f"cannot encode a {rows}x{cols} matrix")

    def blocks(self) -> torch.Tensor:
        """[rows, blocks per row, bytes per block]."""
        return self.data.view(self.shape[0], -1, _BLOCK_BYTES[self.ggml_type])

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, columns], by gguf-py (the loader's path for every
        other type)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        array = dequantize(self.data.numpy(), GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(np.asarray(array, dtype=np.float32).reshape(self.shape))


def _fp16(fields: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> float32 [...]."""
    return fields.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def q4_to_int4(blocks: GGUFBlocks) -> Int4Weights:
    """Q4_0 / Q4_1 -> Int4Weights with group size 32, exactly: the codes are
    the file's nibbles, scale = d, zero = m + 8d (Q4_1) or 0 (Q4_0)."""
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


def q8_0_to_int8(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 -> (codes int8 [N, K], scales float16 [N, K/32]), exactly."""
    if blocks.ggml_type != "Q8_0":
        raise ValueError(f"{blocks.ggml_type} is not Q8_0")
    raw = blocks.blocks()
    scales = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    codes = raw[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape)
    return codes, scales


class BlockInt8Linear(nn.Module):
    """Q8_0 weights (int8 with one fp16 scale per 32 inputs) kept as they are.

    torch ships no kernel for block-scaled int8, so each call expands the
    weight to the activation dtype and runs a dense matmul: the memory saving
    holds, the speed is that of the dense path or a little below.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.weight.shape
        w = (self.weight.view(n, -1, GGUF_BLOCK).to(x.dtype)
             * self.scales.to(x.dtype)[..., None]).view(n, k)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={GGUF_BLOCK}, bias={self.bias is not None}")
