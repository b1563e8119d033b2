"""Attention over a paged KV pool, in portable torch (CPU and CUDA alike).

The flattened batch puts single-token decodes first and prefill chunks after
them. Decodes are batched into one padded SDPA call per layer (or a native
kernel reads the blocks in place instead); each prefill
chunk gets its own call with a causal mask offset by the tokens already in the
cache. The gather indices and masks are built once per step (by the backend)
and shared by all layers.

Decode rows that share a cached prefix (many users of one system prompt)
can take cascade attention: the prefix's part once for all of them, as one
SDPA call whose query length is every row's query heads of a kv head (the
prefix's K/V read once instead of once per row, and a matrix product instead
of dot products), merged with each row's own rest (the native kernel over
the table past the prefix) by the two parts' log-sum-exps. The result is the
same attention over the whole context, summed in another order.

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
from dataclasses import dataclass, field
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
    # The position of the chunk's first token (the tokens already cached).
    start_pos: int
    # The mask as SDPA's additive bias in the activation dtype (0 / -inf),
    # made once per step: given a bool mask, SDPA converts it (where +
    # scalar_tensor) in every layer. None: use ``mask``.
    bias: torch.Tensor | None = None


@dataclass(slots=True)
class SharedPrefix:
    """Decode rows ``rows`` (indices among the step's decodes) whose block
    tables all begin with ``blocks``: full blocks, all before the block that
    holds any of these rows' current token."""

    rows: torch.Tensor    # [R] int64
    blocks: torch.Tensor  # [P] int64


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
    # Cascade decode (only with a kernel that gives log-sum-exps): the groups
    # of decodes sharing a prefix, and every decode's table and length past
    # its group's prefix (rows in no group: the whole table).
    shared_prefixes: list[SharedPrefix] = field(default_factory=list)
    rest_blocks: torch.Tensor | None = None
    rest_lens: torch.Tensor | None = None
    rest_max_len: int = 0
    # The step as sliding-window layers see it (masks always present, no
    # decode_lens: the native decode kernel attends whole contexts).
    sliding: AttentionMetadata | None = None


@dataclass(slots=True)
class TokenRowsMetadata:
    """A step whose every token attends as a decode does (decode rows, the
    few tokens of a speculative verification row, a short chunk): token i
    attends to positions ``0 .. seq_lens[i] - 1`` of its request's blocks
    ``block_tables[i]``, its own K/V (stored this step, before attention)
    included, so the causal order inside a multi-token row comes from the
    lengths. Tensors only: what a compiled step traces (backends/compiled_step.py).
    ``block_tables`` is as wide as the step's longest row needs."""

    slot_mapping: torch.Tensor   # [T] cache slot of every new token
    block_tables: torch.Tensor   # [T, W] int64
    seq_lens: torch.Tensor       # [T] int64
    block_size: int


def token_rows_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: TokenRowsMetadata, scale: float,
                         decode_kernel: Callable[..., torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads * head_dim] for token rows: the
    decode kernel (reading the pool in place) when given, else the blocks
    gathered and SDPA with a mask from the lengths."""
    t, heads, head_dim = q.shape
    bs = meta.block_size
    if decode_kernel is not None:
        out = decode_kernel(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                            meta.block_tables.shape[1] * bs, bs, scale)
        return out.reshape(t, heads * head_dim)
    kv_heads = k_cache.shape[1]
    k_blocks = k_cache.view(-1, bs, kv_heads, head_dim)
    v_blocks = v_cache.view(-1, bs, kv_heads, head_dim)
    k = _gather(k_blocks, meta.block_tables).flatten(1, 2).transpose(1, 2).to(q.dtype)
    v = _gather(v_blocks, meta.block_tables).flatten(1, 2).transpose(1, 2).to(q.dtype)
    positions = torch.arange(meta.block_tables.shape[1] * bs, device=q.device)
    mask = (positions.unsqueeze(0) < meta.seq_lens.unsqueeze(1)).view(t, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.reshape(t, heads * head_dim)


# Cascade only where it pays: a group of at least this many decodes sharing
# at least this many tokens (one SDPA call and a merge per group and layer
# cost ~0.05-0.1 ms on a 2-core CPU).
CASCADE_MIN_ROWS = 4
CASCADE_MIN_TOKENS = 256


def find_shared_prefixes(tables: list[list[int]], positions: list[int], block_size: int,
                         min_rows: int | None = None,
                         min_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """Groups of decode rows (``tables[i]``: row i's block table,
    ``positions[i]``: the position of its current token) whose tables begin
    with the same blocks: (row indices, number of shared blocks). Only blocks
    before every member's current block count (full ones: the prefix cache
    shares nothing else), and a group has at least ``min_rows`` rows sharing
    at least ``min_tokens`` tokens. Rows are grouped by their first block;
    a group shares what all its rows share. The limits default to
    CASCADE_MIN_ROWS and CASCADE_MIN_TOKENS."""
    min_rows = CASCADE_MIN_ROWS if min_rows is None else min_rows
    min_tokens = CASCADE_MIN_TOKENS if min_tokens is None else min_tokens
    min_blocks = max(1, -(-min_tokens // block_size))
    by_first: dict[int, list[int]] = {}
    for i, (table, pos) in enumerate(zip(tables, positions)):
        if pos // block_size >= min_blocks:
            by_first.setdefault(table[0], []).append(i)
    groups = []
    for rows in by_first.values():
        if len(rows) < min_rows:
            continue
        ref = tables[rows[0]]
        n = min(positions[i] // block_size for i in rows)
        for i in rows[1:]:
            table = tables[i]
            if table[:n] != ref[:n]:
                n = next(j for j in range(n) if table[j] != ref[j])
        if n >= min_blocks:
            groups.append((rows, n))
    return groups


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


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float,
                   lse_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor:
    """Decode attention of q [D, heads, head_dim] with the shared prefixes
    of ``meta.shared_prefixes`` computed once per group. ``lse_kernel``:
    the decode kernel's signature, returning (out, lse [D, heads] float32)."""
    out, lse = lse_kernel(q, k_cache, v_cache, meta.rest_blocks, meta.rest_lens,
                          meta.rest_max_len, meta.block_size, scale)
    _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    bs = meta.block_size
    k_blocks = k_cache.view(-1, bs, kv_heads, head_dim)
    v_blocks = v_cache.view(-1, bs, kv_heads, head_dim)
    for shared in meta.shared_prefixes:
        rows = shared.rows.shape[0]
        # [R, kv, G, hd] -> [1, kv, R * G, hd]: the rows' query heads of one
        # kv head are that head's queries.
        qs = q.index_select(0, shared.rows).view(rows, kv_heads, group, head_dim)
        qs = qs.permute(1, 0, 2, 3).reshape(1, kv_heads, rows * group, head_dim)
        k = _gather(k_blocks, shared.blocks).flatten(0, 1).transpose(0, 1).unsqueeze(0)
        v = _gather(v_blocks, shared.blocks).flatten(0, 1).transpose(0, 1).unsqueeze(0)
        o, l = _sdpa_lse(qs, k.to(q.dtype), v.to(q.dtype), scale)
        o = o.view(kv_heads, rows, group, head_dim).permute(1, 0, 2, 3).reshape(
            rows, heads, head_dim)
        l = l.view(kv_heads, rows, group).permute(1, 0, 2).reshape(rows, heads)
        # softmax over both parts = each part's softmax weighted by
        # exp(lse_part) / (exp(lse_prefix) + exp(lse_rest))
        w = torch.sigmoid(l - lse.index_select(0, shared.rows)).unsqueeze(-1)
        rest = out.index_select(0, shared.rows).float()
        out.index_copy_(0, shared.rows, torch.lerp(rest, o.float(), w).to(out.dtype))
    return out


def _sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked SDPA [B, H, L, D] and each query's log-sum-exp [B, H, L]
    (float32): torch's CPU flash attention, which computes both."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, scale=scale)
    return out, lse


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    decode_kernel: Callable[..., torch.Tensor] | None = None,
                    softcap: float | None = None,
                    decode_lse_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                    | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim]. Decodes go to
    ``decode_kernel`` (reading the pool in place) when one is given, else to
    gather + SDPA; with ``decode_lse_kernel`` and shared prefixes in
    ``meta``, to ``cascade_decode``. Prefill chunks go to SDPA one chunk at
    a time. With ``softcap`` (no kernels then) both go to
    ``softcapped_attention`` instead. Token-row steps
    (``TokenRowsMetadata``) go to ``token_rows_attention``."""
    if isinstance(meta, TokenRowsMetadata):
        if softcap is not None:
            raise ValueError("token-row steps do not soft-cap scores")
        return token_rows_attention(q, k_cache, v_cache, meta, scale, decode_kernel)
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
    if d and decode_lse_kernel is not None and meta.shared_prefixes:
        decoded = cascade_decode(q[:d], k_cache, v_cache, meta, scale, decode_lse_kernel)
        if not meta.prefills:
            return decoded.reshape(num_tokens, num_heads * head_dim)
        out[:d] = decoded
    elif d and decode_kernel is not None:
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
