"""Attention over a paged KV pool, in portable torch (CPU and CUDA alike).

The flattened batch puts single-token decodes first and prefill chunks after
them. Decodes are batched into one padded SDPA call per layer (or a native
kernel reads the blocks in place instead); each prefill
chunk gets its own call with a causal mask offset by the tokens already in the
cache. The gather indices and masks are built once per step (by the backend)
and shared by all layers.

Sliding-window layers read ``meta.sliding``: the same step seen through the
window (block tables that start at the first block holding a position inside
the window, masks that hide the positions before it), so their cost follows
the window, not the context. Soft-capped attention (Gemma 2) cannot go
through SDPA, which has no hook between the scores and the softmax; it
computes the scores, caps them and takes the softmax itself, over the same
gathered blocks and masks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

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
    # The mask as SDPA's additive bias in the activation dtype (0 / -inf),
    # made once per step: given a bool mask, SDPA converts it (where +
    # scalar_tensor) in every layer. None: use ``mask``.
    bias: torch.Tensor | None = None


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
    # The step as sliding-window layers see it (masks always present, no
    # decode_lens: the native decode kernel attends whole contexts).
    sliding: AttentionMetadata | None = None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V. Caches are [num_slots, kv_heads, head_dim],
    in the compute dtype or a narrower one (rounded on the way in)."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         attn_mask: torch.Tensor, scale: float, softcap: float,
                         enable_gqa: bool = True) -> torch.Tensor:
    """SDPA's signature and result, with the scores soft-capped before the
    softmax: cap * tanh(q.k * scale / cap), in the reference's order.
    q [B, H, n, D]; k, v [B, KVH, L, D]; attn_mask broadcastable to
    [B, H, n, L], True where allowed."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _gather(blocks: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``blocks[index]`` for an index of block ids of any shape. index_select
    copies whole rows: 8-10x faster than advanced indexing (``aten::index``)
    for a prefill chunk's blocks."""
    return blocks.index_select(0, index.reshape(-1)).view(*index.shape, *blocks.shape[1:])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    decode_kernel: Callable[..., torch.Tensor] | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim]. Decodes go to
    ``decode_kernel`` (reading the pool in place) when one is given, else to
    gather + SDPA; prefill chunks always to SDPA. With ``softcap`` (no
    decode kernel then) both go to ``softcapped_attention`` instead."""
    sdpa = F.scaled_dot_product_attention
    if softcap is not None:
        if decode_kernel is not None:
            raise ValueError("the decode kernel does not soft-cap scores")
        sdpa = partial(softcapped_attention, softcap=softcap)
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
        k = _gather(k_blocks, meta.decode_blocks).flatten(1, 2).transpose(1, 2).to(q.dtype)
        v = _gather(v_blocks, meta.decode_blocks).flatten(1, 2).transpose(1, 2).to(q.dtype)
        out[:d] = sdpa(
            q[:d].unsqueeze(2), k, v, attn_mask=meta.decode_mask, scale=scale,
            enable_gqa=True).squeeze(2)
    for seg in meta.prefills:
        qs = q[seg.token_start:seg.token_end].transpose(0, 1).unsqueeze(0)
        k = _gather(k_blocks, seg.blocks).flatten(0, 1).transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = _gather(v_blocks, seg.blocks).flatten(0, 1).transpose(0, 1).unsqueeze(0).to(q.dtype)
        mask = seg.mask if softcap is not None or seg.bias is None else seg.bias
        o = sdpa(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[seg.token_start:seg.token_end] = o.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)
