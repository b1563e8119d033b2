"""Cascade decode attention over a shared prefix (backends/attention.py): the
decode kernel's log-sum-exps, the grouping of decodes by the blocks their
tables share, the cascade against the kernel over whole tables on every CPU
kind this CPU runs, and a backend whose decodes share a cached prefix giving
the same tokens with the cascade as without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import backends.attention as attention
import backends.torch_backend as torch_backend
from backends import kernels as native
from backends.attention import AttentionMetadata, SharedPrefix, cascade_decode
from backends.attention import find_shared_prefixes
from backends.interface import SamplingParams, ScheduledRequest, SchedulerOutput
from tests.test_cpu_kernels import _backend, _kind_or_skip
from backends.execution import CPU_KINDS


@pytest.fixture(scope="module", params=CPU_KINDS)
def kind(request) -> str:
    return _kind_or_skip(request.param)


def _lse_kernel(kind):
    k = native.kind_id(kind)

    def run(q, k_cache, v_cache, tables, lens, max_len, block_size, scale):
        return torch.ops.baton.paged_decode_attention_lse(q, k_cache, v_cache, tables, lens,
                                                          max_len, block_size, scale, k)
    return run


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


@pytest.mark.parametrize("h,kvh,d,bs", [(9, 3, 64, 16), (4, 2, 16, 4), (12, 2, 128, 16),
                                        (6, 2, 12, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_gives_each_heads_log_sum_exp(kind, h, kvh, d, bs, dtype):
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(200 * bs, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(200 * bs, kvh, d, generator=gen).to(dtype)
    lens = torch.tensor([1, bs, 3 * bs + 5, 97])
    nb = int(-(-lens.max() // bs))
    tables = torch.randperm(200, generator=gen)[:4 * nb].view(4, nb)
    q = torch.randn(4, h, d, generator=gen).to(dtype)
    scale = d ** -0.5
    out, lse = _lse_kernel(kind)(q, k_cache, v_cache, tables, lens, int(lens.max()), bs, scale)
    plain = torch.ops.baton.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                   int(lens.max()), bs, scale,
                                                   native.kind_id(kind))
    assert torch.equal(out, plain)
    assert lse.dtype == torch.float32 and lse.shape == (4, h)
    keys = k_cache.view(-1, bs, kvh, d)[tables].flatten(1, 2).float()       # [T, L, kvh, d]
    keys = keys.repeat_interleave(h // kvh, dim=2)
    scores = torch.einsum("thd,tlhd->thl", q.float(), keys) * scale
    hidden = torch.arange(scores.shape[-1])[None, None] >= lens[:, None, None]
    expected = torch.logsumexp(scores.masked_fill(hidden, float("-inf")), dim=-1)
    torch.testing.assert_close(lse, expected, atol=2e-5, rtol=1e-5)


def test_rows_are_grouped_by_the_full_blocks_their_tables_share():
    bs = 4
    prefix = list(range(100, 110))                     # 10 shared blocks
    tables = [prefix + [200 + i, 300 + i] for i in range(5)]
    positions = [10 * bs + 1, 10 * bs + 5, 10 * bs, 10 * bs + 2, 11 * bs]
    # another group of four shares only six blocks: one row diverges early
    other = list(range(400, 410))
    tables += [other + [500 + i] for i in range(3)] + [other[:6] + [600, 601, 602, 603, 604]]
    positions += [10 * bs + 1] * 4
    # a lone row and a row whose current block is the shared block itself
    tables += [list(range(700, 712)), prefix[:3] + [800]]
    positions += [11 * bs, 2 * bs + 1]
    groups = find_shared_prefixes(tables, positions, bs, min_rows=4, min_tokens=16)
    assert groups == [([0, 1, 2, 3, 4], 10), ([5, 6, 7, 8], 6)]
    # never a block at or after a member's current block (the one being written)
    assert find_shared_prefixes(tables[:5], [3 * bs + 2] + positions[1:5], bs,
                                min_rows=4, min_tokens=8) == [([0, 1, 2, 3, 4], 3)]
    # too few rows, too few tokens
    assert find_shared_prefixes(tables[:5], positions[:5], bs, min_rows=6, min_tokens=16) == []
    assert find_shared_prefixes(tables[:5], positions[:5], bs, min_rows=4,
                                min_tokens=41 + bs) == []
    # the defaults: at least CASCADE_MIN_ROWS rows sharing CASCADE_MIN_TOKENS tokens
    n = -(-attention.CASCADE_MIN_TOKENS // 16)
    shared = list(range(n))
    rows = attention.CASCADE_MIN_ROWS
    big = [shared + [1000 + i] for i in range(rows)]
    assert find_shared_prefixes(big, [n * 16] * rows, 16) == [(list(range(rows)), n)]
    assert find_shared_prefixes(big[:-1], [n * 16] * (rows - 1), 16) == []


def _cascade_meta(tables, positions, bs, groups):
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_size=bs,
                             num_decode=len(tables), decode_blocks=None, decode_mask=None,
                             prefills=[])
    cut = [0] * len(tables)
    for members, n in groups:
        for i in members:
            cut[i] = n
        meta.shared_prefixes.append(SharedPrefix(torch.tensor(members),
                                                 torch.tensor(tables[members[0]][:n])))
    lens = [p + 1 - c * bs for p, c in zip(positions, cut)]
    meta.rest_blocks = _padded([t[c:c - (-n // bs)] for t, c, n in zip(tables, cut, lens)])
    meta.rest_lens = torch.tensor(lens)
    meta.rest_max_len = max(lens)
    return meta


@pytest.mark.parametrize("h,kvh,d,bs", [(9, 3, 64, 16), (4, 2, 16, 4), (8, 8, 32, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_attention_over_the_whole_table(kind, h, kvh, d, bs, dtype):
    """Two groups sharing prefixes of different lengths and rows in none,
    against the kernel over every row's whole table."""
    gen = torch.Generator().manual_seed(9)
    pool = 400
    k_cache = torch.randn(pool * bs, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(pool * bs, kvh, d, generator=gen).to(dtype)
    ids = torch.randperm(pool, generator=gen).tolist()
    a, b, own = ids[:20], ids[20:27], iter(ids[27:])
    tables, positions = [], []
    for i in range(9):
        prefix = a if i < 5 else (b if i < 8 else [])
        extra = 1 + i % 3 if prefix else 12
        tables.append(prefix + [next(own) for _ in range(extra)])
        positions.append((len(tables[-1]) - 1) * bs + i % bs)
    groups = find_shared_prefixes(tables, positions, bs, min_rows=3, min_tokens=bs)
    assert groups == [([0, 1, 2, 3, 4], 20), ([5, 6, 7], 7)]
    q = torch.randn(9, h, d, generator=gen).to(dtype)
    scale = d ** -0.5
    lens = torch.tensor(positions) + 1
    whole, _ = _lse_kernel(kind)(q, k_cache, v_cache, _padded(tables), lens, int(lens.max()),
                                 bs, scale)
    meta = _cascade_meta(tables, positions, bs, groups)
    out = cascade_decode(q, k_cache, v_cache, meta, scale, _lse_kernel(kind))
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, whole, atol=2e-6, rtol=1e-5)
    else:  # both parts are rounded to bf16 before the merge: a few bf16 ulps
        torch.testing.assert_close(out.float(), whole.float(), atol=4e-3, rtol=2 ** -6)


def test_decodes_sharing_a_cached_prefix_give_the_same_tokens(kind, tiny_llama_dir,
                                                              monkeypatch):
    """Five requests over one cached 20-token prefix (the prefix cache's
    layout: the same first blocks in every table), float32: the same greedy
    tokens and logprobs with the cascade as with every row walking its table;
    the cascade ran on every decode step."""
    monkeypatch.setattr(attention, "CASCADE_MIN_TOKENS", 16)
    found = []

    def spy(*args, **kwargs):
        groups = find_shared_prefixes(*args, **kwargs)
        found.append(groups)
        return groups

    monkeypatch.setattr(torch_backend, "find_shared_prefixes", spy)
    cascade = _backend(tiny_llama_dir, "float32", cpu_kind=kind, num_kv_blocks=128)
    assert cascade.plan.shared_prefix_decode == "cascade"
    assert "shared-prefix decode cascade" in cascade.plan.describe()
    plain = _backend(tiny_llama_dir, "float32", cpu_kind=kind, num_kv_blocks=128)
    plain.plan = dataclasses.replace(plain.plan, shared_prefix_decode="none")
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 500, (20,), generator=gen).tolist()
    suffixes = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (2, 5, 3, 7, 4)]
    bs = cascade.block_size
    shared = list(range(1, 1 + 20 // bs))
    tables = [shared + list(range(10 + 10 * i, 20 + 10 * i)) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)

    def run(backend):
        ids, lps = [], []
        prompt0 = prefix + suffixes[0]
        res = backend.execute(SchedulerOutput([ScheduledRequest(
            "r0", prompt0, 0, tables[0], True, params, 0, prompt0)]))
        last = {"r0": res.token_ids[0]}
        # the others find the prefix cached: only their suffix is computed
        res = backend.execute(SchedulerOutput([ScheduledRequest(
            f"r{i}", suffixes[i], 20, tables[i], True, params, 0, prefix + suffixes[i])
            for i in range(1, 5)]))
        last.update(zip(res.request_ids, res.token_ids))
        pos = {f"r{i}": 20 + len(suffixes[i]) for i in range(5)}
        for step in range(8):
            res = backend.execute(SchedulerOutput([ScheduledRequest(
                f"r{i}", [last[f"r{i}"]], pos[f"r{i}"] + step, tables[i], True, params,
                1 + step) for i in range(5)]))
            last.update(zip(res.request_ids, res.token_ids))
            ids.append(list(res.token_ids))
            lps.append([lp.logprob for lp in res.logprobs])
        return ids, lps

    ids_a, lp_a = run(cascade)
    used = [g for g in found if g]
    assert len(used) == 8 and all(g == [([0, 1, 2, 3, 4], 20 // bs)] for g in used)
    found.clear()
    ids_b, lp_b = run(plain)
    assert found == []
    assert ids_a == ids_b
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=0)
