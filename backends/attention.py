"""Attention over a paged KV pool, in portable torch (CPU and CUDA alike).

The flattened batch puts single-token decodes first and prefill chunks after
them. Decodes are batched into one padded SDPA call per layer; each prefill
chunk gets its own call with a causal mask offset by the tokens already in the
cache. The gather indices and masks are built once per step (by the backend)
and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    """Rows ``token_start:token_end`` of the batch are one request's chunk;
    ``context_slots`` are the cache slots of all its positions up to the end of
    the chunk; ``mask`` is None when the chunk starts at position 0 (plain
    causal attention)."""

    token_start: int
    token_end: int
    context_slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] cache slot of every new token
    num_decode: int                     # rows 0..num_decode-1 are decodes
    decode_slots: torch.Tensor | None   # [D, L] slots of each decode's context
    decode_mask: torch.Tensor | None    # [D, 1, 1, L] True where a slot is real
    prefills: list[PrefillSegment]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V. Caches are [num_slots, kv_heads, head_dim]."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    d = meta.num_decode
    if d:
        # [D, L, kv, hd] -> [D, kv, L, hd]
        k = k_cache[meta.decode_slots].transpose(1, 2)
        v = v_cache[meta.decode_slots].transpose(1, 2)
        out[:d] = F.scaled_dot_product_attention(
            q[:d].unsqueeze(2), k, v, attn_mask=meta.decode_mask, scale=scale,
            enable_gqa=True).squeeze(2)
    for seg in meta.prefills:
        qs = q[seg.token_start:seg.token_end].transpose(0, 1).unsqueeze(0)
        k = k_cache[seg.context_slots].transpose(0, 1).unsqueeze(0)
        v = v_cache[seg.context_slots].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale,
            enable_gqa=True)
        out[seg.token_start:seg.token_end] = o.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)
