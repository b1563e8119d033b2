"""Prefill chunks' causal attention on AMX tiles
(backends/kernels/prefill_attention.c, ``baton::paged_prefill_attention``):
bf16 queries over a bf16 paged pool read in place, float32 scores and
softmax, the weights rounded to bf16 for the second product as torch's flash
attention does. It must agree with float32 attention over the same bf16
values as closely as torch's bf16 SDPA path does, attend causally from each
chunk's start position, and give a row the same bits whatever else shares the
call (a prompt computes the same attention cold and after a prefix-cache
hit). Where the CPU has no AMX these tests skip with that reason; the plan's
choice is checked everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.execution import Availability, CpuFeatures, CPU_KINDS, make_plan
from tests.test_amx_linear import _amx_or_skip

AMX = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, amx_bf16=True)
ZEN4 = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True)
ALL = Availability(native_kernels=frozenset(CPU_KINDS),
                   onednn_dtypes=frozenset({"float32", "bfloat16"}), amx_tiles=True)


def _kind() -> int:
    _amx_or_skip()
    from backends import kernels as native
    return native.kind_id("avx512_bf16")


def _pool(gen, blocks, bs, kvh, d):
    k = torch.randn(blocks * bs, kvh, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(blocks * bs, kvh, d, generator=gen).to(torch.bfloat16)
    return k, v


def _segments(gen, chunks, bs, pool_blocks):
    """(segs [S, 3], tables [S, NB], each chunk's table): chunks of (start
    position, rows) over blocks drawn at random from the pool."""
    order = torch.randperm(pool_blocks, generator=gen)
    segs, tables, used, row = [], [], 0, 0
    for start, rows in chunks:
        nb = -(-(start + rows) // bs)
        tables.append(order[used:used + nb])
        used += nb
        segs.append((row, row + rows, start))
        row += rows
    width = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    return torch.tensor(segs, dtype=torch.long), padded, tables


def _smollm_chunks(seed, pool_blocks, chunks):
    """SmolLM2's attention shape (9 query heads, 3 kv heads of 64), blocks of
    16: (k_cache, v_cache, segs, padded tables, tables, q) for ``chunks``."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = _pool(gen, pool_blocks, 16, 3, 64)
    segs, padded, tables = _segments(gen, chunks, 16, pool_blocks)
    q = torch.randn(int(segs[-1, 1]), 9, 64, generator=gen).to(torch.bfloat16)
    return k_cache, v_cache, segs, padded, tables, q


def _reference(q, k_cache, v_cache, segs, tables, bs, scale, dtype=torch.float32):
    """Each chunk's causal attention through torch's SDPA in ``dtype`` over
    the same bf16 values (float32: the reference; bfloat16: what the engine's
    SDPA path computes)."""
    out = torch.empty(q.shape, dtype=dtype)
    for (r0, r1, start), table in zip(segs.tolist(), tables):
        pos = torch.arange(start + r1 - r0)
        slots = table[pos // bs] * bs + pos % bs
        k = k_cache[slots].to(dtype).transpose(0, 1).unsqueeze(0)
        v = v_cache[slots].to(dtype).transpose(0, 1).unsqueeze(0)
        qs = q[r0:r1].to(dtype).transpose(0, 1).unsqueeze(0)
        mask = pos[None, :] <= (start + torch.arange(r1 - r0))[:, None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[r0:r1] = o[0].transpose(0, 1)
    return out


def _run(q, k_cache, v_cache, segs, tables, bs, scale, kind):
    return torch.ops.baton.paged_prefill_attention(q, k_cache, v_cache, segs, tables, bs,
                                                   scale, kind)


# (heads, kv heads, head_dim, block size, chunks of (start position, rows))
CASES = [
    (9, 3, 64, 16, [(0, 128)]),                         # SmolLM2's shape, one prompt
    (9, 3, 64, 16, [(0, 128)] * 4),                     # a step of four prompts
    (9, 3, 64, 16, [(0, 1), (0, 5), (30, 17), (250, 128)]),  # partial blocks, cached prefixes
    (9, 3, 64, 16, [(100, 37)]),                        # a chunk after 100 cached tokens
    (4, 4, 32, 32, [(0, 70), (64, 33)]),                # no grouping, head_dim 32, blocks of 32
    (8, 2, 128, 16, [(0, 45), (17, 60)]),               # head_dim 128 (two passes of values)
    (6, 1, 96, 64, [(0, 200)]),                         # one kv head, head_dim 96, blocks of 64
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_agrees_with_float32_attention_as_closely_as_sdpa_does(case):
    kind = _kind()
    heads, kvh, d, bs, chunks = case
    gen = torch.Generator().manual_seed(hash(str(case)) % 1000)
    pool_blocks = sum(-(-(s + n) // bs) for s, n in chunks) + 7
    k_cache, v_cache = _pool(gen, pool_blocks, bs, kvh, d)
    segs, padded, tables = _segments(gen, chunks, bs, pool_blocks)
    q = torch.randn(int(segs[-1, 1]), heads, d, generator=gen).to(torch.bfloat16)
    scale = d ** -0.5
    got = _run(q, k_cache, v_cache, segs, padded, bs, scale, kind)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ref = _reference(q, k_cache, v_cache, segs, tables, bs, scale)
    sdpa = _reference(q, k_cache, v_cache, segs, tables, bs, scale, torch.bfloat16)
    err = (got.float() - ref).abs().max().item()
    sdpa_err = (sdpa.float() - ref).abs().max().item()
    # bf16 outputs of magnitude up to ~3 round by up to ~0.008; the weights'
    # rounding to bf16 adds as much again
    assert err <= max(2 * sdpa_err, 0.02), (err, sdpa_err)


def test_attends_causally_from_the_chunk_start():
    """Each row sees exactly positions 0 .. start + i: moving the start by one
    position, or letting a row see its successor, changes the result far
    beyond rounding."""
    kind = _kind()
    bs = 16
    k_cache, v_cache, segs, padded, tables, q = _smollm_chunks(3, 20, [(40, 30)])
    got = _run(q, k_cache, v_cache, segs, padded, bs, 0.125, kind).float()
    ref = _reference(q, k_cache, v_cache, segs, tables, bs, 0.125)
    shifted = _reference(q, k_cache, v_cache, torch.tensor([[0, 30, 41]]), tables, bs, 0.125)
    assert (got - ref).abs().max() < 0.02
    assert (got[:-1] - shifted[:-1]).abs().max() > 0.1


def test_a_rows_bits_do_not_depend_on_the_call():
    """A prompt attended in one chunk, in two chunks (the second after the
    first is cached, as after a prefix-cache hit), or beside other prompts:
    the same bits for every row."""
    kind = _kind()
    bs = 16
    k_cache, v_cache, segs, padded, _, q = _smollm_chunks(4, 40, [(0, 100)])
    gen = torch.Generator().manual_seed(44)
    whole = _run(q, k_cache, v_cache, segs, padded, bs, 0.125, kind)
    for cut in (16, 37, 64, 99):
        head = _run(q[:cut].contiguous(), k_cache, v_cache, torch.tensor([[0, cut, 0]]),
                    padded, bs, 0.125, kind)
        tail = _run(q[cut:].contiguous(), k_cache, v_cache,
                    torch.tensor([[0, 100 - cut, cut]]), padded, bs, 0.125, kind)
        assert torch.equal(torch.cat([head, tail]), whole), cut
    other = torch.randn(50, 9, 64, generator=gen).to(torch.bfloat16)
    both = _run(torch.cat([other, q]), k_cache, v_cache,
                torch.tensor([[0, 50, 0], [50, 150, 0]]), padded[[0, 0]].contiguous(), bs,
                0.125, kind)
    assert torch.equal(both[50:], whole)


def test_refuses_what_it_cannot_take():
    kind = _kind()
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _pool(gen, 8, 16, 3, 64)
    q = torch.randn(20, 9, 64).to(torch.bfloat16)
    segs = torch.tensor([[0, 20, 0]])
    table = torch.arange(2).unsqueeze(0)
    bad = [
        (q.float(), k_cache, v_cache, segs, table, 16, "bfloat16 q"),
        (q, k_cache.float(), v_cache.float(), segs, table, 16, "bfloat16 KV"),
        (q, k_cache, v_cache, torch.tensor([[0, 19, 0]]), table, 16, "cover"),
        (q, k_cache, v_cache, torch.tensor([[0, 20, 20]]), table, 16, "too short"),
        (q, k_cache, v_cache, segs, torch.tensor([[0, 8]]), 16, "outside the pool"),
        (q, k_cache, v_cache, segs, table, 8, "multiple of 16"),
    ]
    for *args, words in bad:
        with pytest.raises(RuntimeError, match=words):
            _run(*args, 0.125, kind)
    q48 = torch.randn(20, 9, 48).to(torch.bfloat16)
    k48, v48 = _pool(gen, 8, 16, 3, 48)
    with pytest.raises(RuntimeError, match="head_dim"):
        _run(q48, k48, v48, segs, table, 16, 0.125, kind)


def _model(head_dim):
    from backends.config import ModelConfig
    return ModelConfig(architecture="test", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=head_dim)


def test_the_plan_takes_it_where_amx_attention_runs():
    def plan(cpu, dtype="bfloat16", available=ALL, model=None):
        return make_plan("cpu", dtype, "none", cpu, available, model=model)

    assert plan(AMX).prefill_attention == "native-amx"
    assert "prefill attention native-amx" in plan(AMX).describe()
    # no tiles, no bf16 activations, or no tile data granted: torch's SDPA
    assert plan(ZEN4).prefill_attention == "torch-sdpa"
    assert plan(AMX, "float32").prefill_attention == "torch-sdpa"
    no_tiles = Availability(native_kernels=ALL.native_kernels,
                            onednn_dtypes=ALL.onednn_dtypes, amx_tiles=False)
    assert plan(AMX, available=no_tiles).prefill_attention == "torch-sdpa"
    # head sizes the tiles do not take
    assert plan(AMX, model=_model(128)).prefill_attention == "native-amx"
    odd = plan(AMX, model=_model(48))
    assert odd.prefill_attention == "torch-sdpa" and "head_dim 32-128" in odd.describe()
