"""Attention over a paged KV pool, in portable torch (CPU and CUDA alike).

The flattened batch puts single-token decodes first and prefill chunks after
them. Decodes are batched into one padded SDPA call per layer (or a native
kernel reads the blocks in place instead); each prefill
chunk gets its own call with a causal mask offset by the tokens already in the
cache. The gather indices and masks are built once per step (by the backend)
and shared by all layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    """Rows ``token_start:token_end`` of the batch are one request's chunk;
    ``blocks`` are the cache blocks holding its positions up to the end of the
    chunk; ``mask`` [n, len(blocks) * block_size] allows each query its own
    and earlier positions."""

    token_start: int
    token_end: int
    blocks: torch.Tensor
    mask: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step, shared by every layer. Reads gather whole blocks
    (block_size contiguous slots per index), not single slots."""

    slot_mapping: torch.Tensor          # [T] cache slot of every new token
    block_size: int
    num_decode: int                     # rows 0..num_decode-1 are decodes
    decode_blocks: torch.Tensor | None  # [D, NB] block table of each decode
    # [D, 1, 1, NB * block_size] True where real; only for the torch (SDPA)
    # decode path, None when a kernel reads the pool in place.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSegment]
    decode_lens: torch.Tensor | None = None   # [D] int64: each decode's context length
    decode_max_len: int = 0


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V. Caches are [num_slots, kv_heads, head_dim],
    in the compute dtype or a narrower one (rounded on the way in)."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    decode_kernel: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim]. Decodes go to
    ``decode_kernel`` (reading the pool in place) when one is given, else to
    gather + SDPA; prefill chunks always to SDPA."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    bs = meta.block_size
    k_blocks = k_cache.view(-1, bs, kv_heads, head_dim)
    v_blocks = v_cache.view(-1, bs, kv_heads, head_dim)
    out = torch.empty_like(q)
    d = meta.num_decode
    if d and decode_kernel is not None:
        decoded = decode_kernel(q[:d], k_cache, v_cache, meta.decode_blocks,
                                     meta.decode_lens, meta.decode_max_len, bs, scale)
        if not meta.prefills:
            return decoded.reshape(num_tokens, num_heads * head_dim)
        out[:d] = decoded
    elif d:
        # [D, NB, bs, kv, hd] -> [D, kv, NB * bs, hd]
        k = k_blocks[meta.decode_blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
        v = v_blocks[meta.decode_blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
        out[:d] = F.scaled_dot_product_attention(
            q[:d].unsqueeze(2), k, v, attn_mask=meta.decode_mask, scale=scale,
            enable_gqa=True).squeeze(2)
    for seg in meta.prefills:
        qs = q[seg.token_start:seg.token_end].transpose(0, 1).unsqueeze(0)
        k = k_blocks[seg.blocks].flatten(0, 1).transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = v_blocks[seg.blocks].flatten(0, 1).transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=seg.mask, scale=scale,
                                           enable_gqa=True)
        out[seg.token_start:seg.token_end] = o.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)
