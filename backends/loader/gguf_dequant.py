"""GGML tensor types to float32, in torch, a whole tensor at a time.

gguf-py's numpy dequantization walks rows in groups of 16 through numpy
memmap slices: about 10 s for SmolLM2-135M on a 2-core VM. These do the same
arithmetic, in the same order, on whole tensors (so results equal gguf-py's
bit for bit; tests/test_gguf_dequant.py checks every type here against it),
in a few hundred milliseconds. Types not listed in ``TORCH_TYPES`` fall back
on gguf-py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

QK_K = 256
T = GGMLQuantizationType


def _u8(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return blocks[:, start:stop]


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of each block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Bytes [n, groups * width] -> codes [n, groups, 2, width]: each group's
    low nibbles, then its high nibbles (ggml's order within a block)."""
    q = qs.reshape(qs.shape[0], groups, 1, width)
    return torch.cat([q & 0x0F, q >> 4], dim=2)


def _bits(packed: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """[n, g, w] bytes -> [n, g, len(shifts), w]: (byte >> shift) & mask."""
    shift = torch.tensor(shifts, dtype=torch.uint8).view(1, 1, -1, 1)
    return (packed.unsqueeze(2) >> shift) & mask


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).to(torch.float32) * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1, 16).reshape(b.shape[0], 32)
    return _f16(b, 0) * (q.to(torch.int8) - 8).to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 1, 16).reshape(b.shape[0], 32).to(torch.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _q5(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """The 5-bit codes of Q5_0 / Q5_1: 4 low bits in nibbles, the fifth in a u32."""
    n = b.shape[0]
    qh = b[:, qh_at:qh_at + 4].contiguous().view(torch.int32)
    high = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)
    low = _nibbles(b[:, qh_at + 4:], 1, 16).reshape(n, 32)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_q5(b, 2).to(torch.int8) - 16).to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _q5(b, 4).to(torch.float32) + _f16(b, 2)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the eight 6-bit scales and minimums packed in 12 bytes."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-weight group of a Q4_K / Q5_K super-block: scale d*sc and the
    subtracted dmin*m, float32 [n, 8, 1], in gguf-py's (and ggml's) order."""
    sc, mn = k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.to(torch.float32)).unsqueeze(-1)
    dm = (_f16(b, 2) * mn.to(torch.float32)).unsqueeze(-1)
    return d, dm


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(b)
    q = _nibbles(b[:, 16:144], 4, 32).reshape(b.shape[0], 8, 32).to(torch.float32)
    return (d * q - dm).reshape(b.shape[0], QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_scales(b)
    low = _nibbles(b[:, 48:176], 4, 32).reshape(n, 8, 32)
    high = _bits(b[:, 16:48].reshape(n, 1, 32), list(range(8)), 1).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, :128], 2, 64).reshape(n, 8, 32)
    high = _bits(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 8, 32)
    scales = b[:, 192:208].view(torch.int8).to(torch.float32)
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (d * q).reshape(n, QK_K)


_BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
TORCH_TYPES = frozenset(_BLOCK_DECODERS) | {T.F32, T.F16, T.BF16}


def dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType,
               shape: tuple[int, ...]) -> torch.Tensor:
    """float32 tensor of torch ``shape`` from a GGUF tensor's ``data`` (typed
    elements or raw blocks, as gguf_file.GGUFTensor holds them). The result
    owns its memory."""
    if ggml_type == T.F32:
        return torch.from_numpy(data).reshape(shape).clone()
    if ggml_type == T.F16:
        return torch.from_numpy(data).reshape(shape).to(torch.float32)
    raw = torch.from_numpy(data).reshape(-1)
    if ggml_type == T.BF16:
        return raw.view(torch.bfloat16).reshape(shape).to(torch.float32)
    decode = _BLOCK_DECODERS.get(ggml_type)
    if decode is None:  # rarer types: gguf-py's numpy code, slower but complete
        array = np.asarray(gguf_dequantize(data, ggml_type), dtype=np.float32)
        return torch.from_numpy(np.array(array).reshape(shape))
    _block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return decode(raw.reshape(-1, type_size)).reshape(shape)
