"""The CPU fast paths against the portable torch path they replace: the
native paged decode-attention kernel against gather + SDPA, oneDNN-packed
linears against F.linear, and a whole backend with both against one without.

Kernel tests run once per CPU kind this CPU can run (backends/execution.py:
portable, avx2, avx512, avx512_bf16), each kind's own build; a kind the CPU
lacks is skipped with its reason."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backends import kernels as native
from backends.execution import (CPU_KINDS, Availability, CpuFeatures,
                                ExecutionOptions, make_plan)
from backends.factory import BackendConfig, create_backend, plan_for
from backends.interface import SamplingParams, ScheduledRequest, SchedulerOutput
from backends.linear import PackedLinear, packing_supported, prepack_linears
from backends.loader import load_model
from backends.torch_backend import TorchBackend

ROOT = Path(__file__).resolve().parents[1]
CPU = CpuFeatures.detect()


def _kind_or_skip(kind: str) -> str:
    if kind not in CPU.kinds:
        pytest.skip(f"this CPU ({CPU.describe()}) cannot run the {kind} kernels")
    ok, reason = native.available(kind)
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"the {kind} kernels did not build: {reason}")
        pytest.skip(f"the {kind} kernels cannot be built here: {reason}")
    return kind


@pytest.fixture(scope="module", params=CPU_KINDS)
def kind(request) -> str:
    """Every CPU kind this CPU can run, each with its own kernel build."""
    return _kind_or_skip(request.param)


def _attention_kernel(kind: str):
    k = native.kind_id(kind)

    def attention(q, k_cache, v_cache, tables, lens, max_len, block_size, scale):
        return torch.ops.baton.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                      max_len, block_size, scale, k)
    return attention


@pytest.fixture(scope="module")
def kernel(kind):
    return _attention_kernel(kind)


def test_each_kind_is_built_for_its_instruction_set(kind):
    """The portable build has no AVX2 code; the others do (the library holds
    every kind, the plan picks one at run time; never -march=native)."""
    assert torch.ops.baton.kind_has_avx2(native.kind_id(kind)) == (kind != "portable")
    assert "-march=native" not in " ".join(f for fl in native.KIND_FLAGS.values() for f in fl)


def test_operators_check_their_inputs_and_the_cpu(kind):
    """The dispatcher schemas plus the checks in ops.cpp: a wrong dtype,
    shape or kind is a clear error, never a crash."""
    k = native.kind_id(kind)
    baton = torch.ops.baton
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        baton.silu_mul(torch.zeros(2, 8, dtype=torch.float16), k)
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        baton.silu_mul(torch.zeros(2, 7), k)
    with pytest.raises(RuntimeError, match="weight must be"):
        baton.rms_norm(torch.zeros(2, 8), None, torch.zeros(8, dtype=torch.bfloat16), 1e-6, k)
    with pytest.raises(RuntimeError, match="unknown CPU kind"):
        baton.silu_mul(torch.zeros(2, 8), 99)
    # The operators refuse what the hardware cannot run (a capped process,
    # ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA, only plans lower).
    hardware = CpuFeatures.detect(capped=False)
    beyond = [i for i, name in enumerate(CPU_KINDS) if name not in hardware.kinds]
    for i in beyond:
        assert not baton.kind_runs(i)
        with pytest.raises(RuntimeError, match="cannot run"):
            baton.silu_mul(torch.zeros(2, 8), i)


def test_operators_are_visible_to_the_profiler_and_to_torch_compile(kind):
    k = native.kind_id(kind)
    x = torch.randn(3, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.baton.silu_mul(x, k)
    assert "baton::silu_mul" in {e.key for e in prof.key_averages()}

    def f(gate_up, residual, weight):
        normed = torch.ops.baton.rms_norm(residual, None, weight, 1e-6, k)
        return torch.ops.baton.silu_mul(gate_up * 2, k) + normed[:, :8]
    args = (x[:, :16].contiguous(), torch.randn(3, 8), torch.rand(8))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), f(*args))


def _reference(q, k_cache, v_cache, tables, lens, bs, scale):
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    nb = tables.shape[1]
    k = k_cache.view(-1, bs, kvh, d)[tables].flatten(1, 2).transpose(1, 2)
    v = v_cache.view(-1, bs, kvh, d)[tables].flatten(1, 2).transpose(1, 2)
    mask = (torch.arange(nb * bs)[None] < lens[:, None]).view(t, 1, 1, nb * bs)
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2's shape: grouped queries
    (9, 3, 64, 64),    # larger blocks: 150 positions in three, the last ragged
    (9, 3, 64, 128),   # every row but the longest in one block
    (14, 2, 64, 16),   # seven query heads per kv head: more than one register pass
    (8, 8, 32, 4),     # one kv head per query head
    (12, 2, 128, 16),  # wide heads
    (4, 1, 16, 1),     # a single kv head, one slot per block
    (6, 2, 12, 4),     # head_dim not a multiple of 8: the portable path
])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_gather_and_sdpa(kernel, heads, kv_heads, head_dim, block_size,
                                        kv_dtype):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_blocks = 19200 // max(block_size, 16)  # 1200 blocks of <= 16, the same slots above
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim,
                          generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim,
                          generator=gen).to(kv_dtype)
    # Lengths of 1, exact block multiples and ragged ones; blocks scattered.
    lens = torch.tensor([1, block_size, 2 * block_size, 37, 150, 5, 99])
    nb = int(-(-lens.max() // block_size))
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * nb].view(len(lens), nb)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = kernel(q, k_cache, v_cache, tables, lens, int(lens.max()), block_size, scale)
    # A bf16 cache is read widened to float32: exactly the float32 values.
    ref = _reference(q, k_cache.float(), v_cache.float(), tables, lens, block_size, scale)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_store_into_a_bf16_cache_rounds_like_torch(kind, qk_norm):
    """Storing K/V into a bfloat16 cache gives exactly torch's round-to-
    nearest-even of what a float32 cache receives; q is unchanged."""
    h, kvh, d, t = 6, 2, 32, 5
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen) * 3
    positions = torch.tensor([0, 7, 3, 12, 40])
    slots = torch.tensor([9, 2, 30, 4, 17])
    angles = torch.randn(64, d // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1).contiguous()
    sin = torch.cat([angles.sin(), angles.sin()], -1).contiguous()
    norms = (torch.rand(d, generator=gen), torch.rand(d, generator=gen)) if qk_norm else (None,
                                                                                          None)
    caches = {}
    qs = {}
    for dtype in (torch.float32, torch.bfloat16):
        k_cache = torch.zeros(32, kvh, d, dtype=dtype)
        v_cache = torch.zeros(32, kvh, d, dtype=dtype)
        qs[dtype] = torch.ops.baton.qkv_rope_store(qkv, h, kvh, d, positions, cos, sin, *norms,
                                                   1e-6, slots, k_cache, v_cache,
                                                   native.kind_id(kind))
        caches[dtype] = (k_cache, v_cache)
    assert torch.equal(qs[torch.float32], qs[torch.bfloat16])
    for f32, b16 in zip(caches[torch.float32], caches[torch.bfloat16]):
        assert torch.equal(f32.to(torch.bfloat16), b16)
        assert b16[slots].abs().sum() > 0


def test_silu_mul_matches_torch_over_the_whole_range(kind):
    """The kernels' own vectorised exp (no libmvec, no -ffast-math): silu
    agrees with torch's from far negative to far positive, NaN stays NaN."""
    gen = torch.Generator().manual_seed(2)
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.randn(999, generator=gen) * 4,
                      torch.tensor([float("nan"), 0.0, -0.0, 1e-40, -1e-40, 88.5, -88.5])])
    up = torch.randn(gate.shape[0], generator=gen)
    out = torch.ops.baton.silu_mul(torch.cat([gate, up])[None], native.kind_id(kind))
    ref = F.silu(gate) * up
    torch.testing.assert_close(out[0], ref, atol=1e-6, rtol=2e-6, equal_nan=True)


@pytest.mark.parametrize("wide", ["avx512", "avx512_bf16"])
def test_silu_mul_sixteen_lanes_give_the_eight_lane_results(wide):
    """The AVX-512 builds run silu in sixteen lanes: every element equals
    the AVX2 build's (eight lanes, same exp), in float32 and in bf16, over a
    width with a sixteen-lane body, an eight-lane step and a scalar tail."""
    _kind_or_skip("avx2")
    _kind_or_skip(wide)
    gen = torch.Generator().manual_seed(3)
    width = 1536 + 8 + 3
    gate_up = torch.randn(5, 2 * width, generator=gen) * 6
    gate_up[0, :width] = torch.linspace(-100, 100, width)
    for x in (gate_up, gate_up.to(torch.bfloat16)):
        ref = torch.ops.baton.silu_mul(x, native.kind_id("avx2"))
        out = torch.ops.baton.silu_mul(x, native.kind_id(wide))
        assert torch.equal(out, ref)


# ------------------------------------------------------ bfloat16 activations
# Each bf16 operator widens its inputs, computes in float32 and rounds once
# on store (RMSNorm twice: the normed row, then its product with the weight,
# the reference implementation's order): the reference is the float32
# computation on the widened inputs, rounded so; one bf16 ulp apart at most
# (float32 summation order).
BF16_ULP = dict(atol=1e-6, rtol=2 ** -7)


def _bf16(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def test_bf16_rms_norm_and_silu_round_like_the_reference(kind):
    k = native.kind_id(kind)
    gen = torch.Generator().manual_seed(21)
    t, n = 5, 200
    residual, delta, w = _bf16(t, n, gen=gen, scale=3), _bf16(t, n, gen=gen), _bf16(n, gen=gen)
    summed = (residual.float() + delta.float()).to(torch.bfloat16)
    x = summed.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    ref = w * normed  # bf16 x bf16, rounded: transformers' LlamaRMSNorm in bf16
    out = torch.ops.baton.rms_norm(residual, delta, w, 1e-6, k)
    assert torch.equal(residual, summed)  # the residual stream, updated in place
    torch.testing.assert_close(out.float(), ref.float(), **BF16_ULP)
    gate_up = _bf16(t, 2 * 96, gen=gen, scale=4)
    g, u = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.baton.silu_mul(gate_up, k).float(),
                               (F.silu(g) * u).to(torch.bfloat16).float(), **BF16_ULP)


def test_bf16_rms_norm_in_sixteen_lane_passes_gives_the_pass_per_step_bits():
    """The AVX512_BF16 build norms a bf16 row sixteen elements at a time in
    registers (two passes); the AVX-512 build without bf16 takes a pass per
    step over float32 copies. Same operations, same sixteen-lane sum: the
    same bits, residual and output, over a width with a sixteen-lane body
    and a tail, with and without the residual add."""
    _kind_or_skip("avx512")
    _kind_or_skip("avx512_bf16")
    gen = torch.Generator().manual_seed(23)
    t, n = 7, 576 + 16 + 5
    residual, delta, w = _bf16(t, n, gen=gen, scale=3), _bf16(t, n, gen=gen), _bf16(n, gen=gen)
    residual[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, 1.0, -1.0])
    for d in (delta, None):
        outs = []
        for name in ("avx512", "avx512_bf16"):
            r = residual.clone()
            outs.append((torch.ops.baton.rms_norm(r, d, w, 1e-6, native.kind_id(name)), r))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_bf16_qkv_rope_store_matches_float32_rounded(kind, qk_norm):
    k = native.kind_id(kind)
    h, kvh, d, t = 6, 2, 32, 5
    gen = torch.Generator().manual_seed(22)
    qkv = _bf16(t, (h + 2 * kvh) * d, gen=gen, scale=3)
    positions = torch.tensor([0, 7, 3, 12, 40])
    slots = torch.tensor([9, 2, 30, 4, 17])
    angles = torch.randn(64, d // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(torch.bfloat16)
    norms = (_bf16(d, gen=gen), _bf16(d, gen=gen)) if qk_norm else (None, None)
    wide = [None if n is None else n.float() for n in norms]
    out, ref = {}, {}
    for name, args in (("bf16", (qkv, cos, sin, *norms)),
                       ("f32", (qkv.float(), cos.float(), sin.float(), *wide))):
        k_cache = torch.zeros(32, kvh, d, dtype=torch.bfloat16)
        v_cache = torch.zeros(32, kvh, d, dtype=torch.bfloat16)
        x, c, sn, qn, kn = args
        q = torch.ops.baton.qkv_rope_store(x, h, kvh, d, positions, c, sn, qn, kn, 1e-6, slots,
                                           k_cache, v_cache, k)
        (out if name == "bf16" else ref)["q"] = q.float()
        (out if name == "bf16" else ref)["kv"] = (k_cache, v_cache)
    torch.testing.assert_close(out["q"], ref["q"].to(torch.bfloat16).float(), **BF16_ULP)
    for got, want in zip(out["kv"], ref["kv"]):
        torch.testing.assert_close(got.float(), want.float(), **BF16_ULP)


BF16_ATTENTION_SHAPES = pytest.mark.parametrize("h,kvh,d,bs", [
    (9, 3, 64, 16),     # SmolLM2
    (14, 2, 64, 16),    # seven query heads per kv head
    (12, 2, 128, 16),   # wide heads
    (8, 8, 32, 8),      # narrow heads, smaller blocks
    (6, 2, 48, 16),     # a head_dim the AVX-512 paths leave to the AVX2 one
    (4, 2, 64, 32),     # blocks wider than the bf16 scores take at once
    (9, 3, 64, 128),    # larger blocks
])


def _bf16_attention_matches_float32_rounded(kernel, h, kvh, d, bs):
    gen = torch.Generator().manual_seed(23)
    nb = -(-150 // bs)
    k_cache, v_cache = _bf16(300 * bs, kvh, d, gen=gen), _bf16(300 * bs, kvh, d, gen=gen)
    lens = torch.tensor([1, 16, 77, 150])
    tables = torch.randperm(300, generator=gen)[:4 * nb].view(4, nb)
    q = _bf16(4, h, d, gen=gen)
    out = kernel(q, k_cache, v_cache, tables, lens, 150, bs, d ** -0.5)
    ref = kernel(q.float(), k_cache, v_cache, tables, lens, 150, bs, d ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), **BF16_ULP)


@BF16_ATTENTION_SHAPES
def test_bf16_decode_attention_matches_float32_rounded(kernel, h, kvh, d, bs):
    """A bf16 query (scores as bf16 dot products where the kind has them: on
    AMX tiles where the avx512_bf16 kind has AMX, else VDPBF16PS) against the
    same values in float32 (scores as float32 FMAs)."""
    _bf16_attention_matches_float32_rounded(kernel, h, kvh, d, bs)


@BF16_ATTENTION_SHAPES
def test_bf16_decode_attention_forced_onto_vdpbf16ps(h, kvh, d, bs):
    """The avx512_bf16 kind's scores forced off AMX onto VDPBF16PS (what an
    AVX512_BF16 CPU without AMX runs), on a CPU that has AMX."""
    _kind_or_skip("avx512_bf16")
    if not native.attention_amx("avx512_bf16"):
        pytest.skip("no AMX tile data here: the default avx512_bf16 run above is "
                    "already the VDPBF16PS path")
    native.attention_amx("avx512_bf16", 0)
    try:
        _bf16_attention_matches_float32_rounded(
            _attention_kernel("avx512_bf16"), h, kvh, d, bs)
    finally:
        native.attention_amx("avx512_bf16", 1)


def test_kernel_ignores_slots_past_each_length(kernel):
    """Positions past a row's length (the rest of its last block, padding
    entries of its table) never reach the result, even when they hold NaN."""
    bs, kvh, d = 4, 2, 8
    k_cache = torch.randn(64 * bs, kvh, d)
    v_cache = torch.randn(64 * bs, kvh, d)
    tables = torch.tensor([[3, 7, 0], [9, 0, 0]])
    lens = torch.tensor([6, 2])
    q = torch.randn(2, 4, d)
    expected = kernel(q, k_cache, v_cache, tables, lens, 6, bs, 0.3)
    for slot in [7 * bs + 2, 7 * bs + 3, 9 * bs + 2, 9 * bs + 3]:
        k_cache[slot] = float("nan")
        v_cache[slot] = float("nan")
    k_cache[0:bs] = float("nan")
    out = kernel(q, k_cache, v_cache, tables, lens, 6, bs, 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_amx_scores_agree_with_vdpbf16ps(threads):
    """The avx512_bf16 kind's bf16 scores on AMX tiles against the same
    kernel forced onto VDPBF16PS: kv groups of 2 to 16 heads (several tile
    passes where a pass's sixteen heads or sixteen 32-dim pieces run out;
    groups of one head never take the tiles, so both modes agree there too),
    head dims 32 to 128, blocks of 16 to 128, ragged lengths whose last
    sixteen rows run past the length into NaN (the tile reads them; their
    scores never reach the result), one and two threads (two threads and
    few rows: context chunks merged by their log-sum-exps)."""
    kind = _kind_or_skip("avx512_bf16")
    if not native.attention_amx(kind):
        pytest.skip("this CPU or OS gives no AMX-BF16 tile data")
    k = native.kind_id(kind)
    gen = torch.Generator().manual_seed(41)
    for h, kvh, d, bs in [(9, 3, 64, 16), (32, 2, 64, 16), (8, 8, 32, 32), (20, 4, 128, 128),
                          (12, 2, 128, 16)]:
        num_blocks = 4000 // bs
        for lens in ([1, 15, 17, 200], [1000], [33, 600]):
            k_cache = _bf16(num_blocks * bs, kvh, d, gen=gen)
            v_cache = _bf16(num_blocks * bs, kvh, d, gen=gen)
            k_cache[:bs] = float("nan")   # block 0: unused table entries
            v_cache[:bs] = float("nan")
            lens = torch.tensor(lens)
            nb = int(-(-lens.max() // bs))
            tables = torch.zeros(len(lens), nb, dtype=torch.long)
            perm = 1 + torch.randperm(num_blocks - 1, generator=gen)
            for i, n in enumerate(lens.tolist()):
                used = -(-n // bs)
                tables[i, :used] = perm[i * nb:i * nb + used]
                last = int(tables[i, used - 1]) * bs
                k_cache[last + (n - 1) % bs + 1:last + bs] = float("nan")  # past the length
                v_cache[last + (n - 1) % bs + 1:last + bs] = float("nan")
            q = _bf16(len(lens), h, d, gen=gen)
            for num_threads in (1, 2):
                threads(num_threads)
                got = {}
                for mode in (1, 0):
                    native.attention_amx(kind, mode)
                    try:
                        got[mode] = torch.ops.baton.paged_decode_attention_lse(
                            q, k_cache, v_cache, tables, lens, int(lens.max()), bs,
                            d ** -0.5, k)
                    finally:
                        native.attention_amx(kind, 1)
                assert torch.isfinite(got[1][0].float()).all()
                torch.testing.assert_close(got[1][0].float(), got[0][0].float(), **BF16_ULP)
                torch.testing.assert_close(got[1][1], got[0][1], atol=2e-5, rtol=1e-5)


def _functions() -> dict[str, list[str]]:
    """The built kernel library's code, function by function (objdump)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump (binutils) to read the library's code")
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(native.library_path())],
                             capture_output=True, text=True, check=True).stdout
    functions: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in listing.splitlines():
        if line.endswith(">:"):
            lines = functions.setdefault(line.split("<", 1)[1][:-2], [])
        else:
            lines.append(line)
    return functions


def test_attention_prefetches_survive_the_compiler():
    """The AVX2 and AVX-512 attention asks for the next block's K and V lines
    ahead (paged_attention.c's prefetch_part). GCC 12 deleted those loops
    without a word once their addresses came from the block table through a
    helper (a prefetch builtin has no effect the compiler must keep): every
    kernel test still passed and a 32-row step's attention ran ~20% slower.
    They are asm statements now; the built library must still hold them, one
    site at least per kind in the attention's code, and in the AVX2 walk's
    (the float32 scores and the values, also the AVX-512 kinds' fallback)
    two at least: its scores and its values."""
    kinds = [k for k in ("avx2", "avx512", "avx512_bf16") if k in CPU.kinds
             and native.available(k)[0]]
    if not kinds:
        pytest.skip(f"this CPU ({CPU.describe()}) runs no AVX2 kind: the prefetching "
                    "paths are not built")
    functions = _functions()
    sites = sum(1 for name, lines in functions.items()
                if "attention" in name or "scores_amx" in name
                for line in lines if "prefetcht0" in line)
    assert sites >= len(kinds), sites
    grouped = sum(1 for name, lines in functions.items()
                  if re.match(r"(attention_task|scores|values)_grouped", name)
                  for line in lines if "prefetcht0" in line)
    assert grouped >= 2, grouped


def test_bf16_gemv_keeps_its_chains_in_registers():
    """The VDPBF16PS gemv (gemv_bf16.c's block_dp, a few bf16 rows where
    there are no AMX tiles) broadcasts each row's column pair from memory
    into its products. Two ways GCC 12 made it 1.1-1.3x slower at three and
    four rows while every value stayed the same: chains picked by a run-time
    index (the pair's parity) spilled to the stack, and a 64-bit load of two
    pairs moved through a general register (VPBROADCASTD from a GPR, port 5
    beside the products). The avx512_bf16 build's gemv must have neither."""
    if "avx512_bf16" not in CPU.kinds or not native.available("avx512_bf16")[0]:
        pytest.skip(f"this CPU ({CPU.describe()}) cannot run the avx512_bf16 kernels")
    # gemv_tiles_bf16x is static (only the avx512_bf16 build has it): its
    # symbol carries no kind; an exported one would (BATON_FN).
    found = {name: lines for name, lines in _functions().items()
             if re.fullmatch(r"(baton_)?gemv_tiles_bf16x(_avx512_bf16)?(\.\w+)*", name)}
    assert found, "no gemv_tiles_bf16x in the built library"
    lines = [line for body in found.values() for line in body]
    gpr = [line for line in lines if re.search(r"vpbroadcast[dq]\s+%[er]", line)]
    spills = [line for line in lines if "zmm" in line and re.search(r"\(%rsp,%r", line)]
    assert not gpr and not spills, (gpr + spills)[:5]
    assert any("vdpbf16ps" in line for line in lines)
    assert any(re.search(r"v(p?broadcastd|broadcastss)\s+\S*\(", line) for line in lines)


@pytest.fixture
def threads(request):
    """Runs the test body at the given torch thread count (the kernel's)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 128])
def test_few_rows_split_their_contexts_across_threads(kind, threads, num_threads, kv_dtype,
                                                      q_dtype, bs):
    """With fewer than two rows per thread and contexts of >= 256 positions,
    each row's context is cut into chunks of whole blocks, each (row, kv
    head, chunk) a task, merged by their log-sum-exps (paged_attention.c,
    context_chunks: two threads and one row of 2001 positions make 6
    chunks). Ragged lengths (one a single block, one not a multiple of the
    block size, chunks past a row's end), a table whose unused entries point
    at blocks full of NaN, and the log-sum-exp output all as without
    chunks: the reference and the lse operator agree. Blocks of 16 and of
    128 (chunks of whole blocks: fewer, longer ones)."""
    threads(num_threads)
    k = native.kind_id(kind)
    gen = torch.Generator().manual_seed(31)
    h, kvh, d, num_blocks = 9, 3, 64, 6400 // bs
    k_cache = torch.randn(num_blocks * bs, kvh, d, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks * bs, kvh, d, generator=gen).to(kv_dtype)
    k_cache[:bs] = float("nan")   # block 0: what the unused table entries point at
    v_cache[:bs] = float("nan")
    for lens in ([2001], [2001, 16], [300, 1100, 7]):
        lens = torch.tensor(lens)
        nb = int(-(-lens.max() // bs))
        tables = torch.zeros(len(lens), nb, dtype=torch.long)
        perm = 1 + torch.randperm(num_blocks - 1, generator=gen)
        for i, n in enumerate(lens.tolist()):
            tables[i, :-(-n // bs)] = perm[i * nb:i * nb + -(-n // bs)]
        q = torch.randn(len(lens), h, d, generator=gen).to(q_dtype)
        scale = d ** -0.5
        out, lse = torch.ops.baton.paged_decode_attention_lse(
            q, k_cache, v_cache, tables, lens, int(lens.max()), bs, scale, k)
        plain = torch.ops.baton.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                       int(lens.max()), bs, scale, k)
        assert torch.equal(out, plain)
        clean = tables.clone()
        clean[clean == 0] = perm[-1]  # SDPA masks the padding, but NaN * 0 is NaN
        ref = _reference(q.float(), k_cache.float(), v_cache.float(), clean, lens, bs, scale)
        torch.testing.assert_close(out.float(), ref, **(BF16_ULP if q_dtype == torch.bfloat16
                                                        else dict(atol=2e-5, rtol=1e-4)))
        keys = k_cache.float().view(-1, bs, kvh, d)[clean].flatten(1, 2)
        keys = keys.repeat_interleave(h // kvh, dim=2)
        scores = torch.einsum("thd,tlhd->thl", q.float(), keys) * scale
        hidden = torch.arange(scores.shape[-1])[None, None] >= lens[:, None, None]
        expected = torch.logsumexp(scores.masked_fill(hidden, float("-inf")), dim=-1)
        torch.testing.assert_close(lse, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_no_compiler_falls_back_to_the_torch_path(tmp_path):
    """Without a C compiler the loader says why and returns None; it never raises."""
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout, level=logging.INFO); "
            "import backends.kernels as k; print('LIB', k.load())")
    env = dict(os.environ, CC="/nonexistent/cc", BATON_KERNEL_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LIB (None" in out.stdout
    assert "no C compiler" in out.stdout


@pytest.mark.slow
def test_kernels_built_ahead_load_without_a_compiler(tmp_path):
    """`python -m backends.kernels` (what the image build runs) builds the one
    library of every kind into the cache (here: the suite's own, usually
    built already); a process with no compilers then loads it from a cache
    that holds only that file and its digest, as the runtime image does."""
    built = subprocess.run([sys.executable, "-m", "backends.kernels"], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr
    kinds, path = built.stdout.strip().rsplit("\n", 1)[-1].split(": ")
    assert kinds.split(", ")[0] == "portable"
    library = Path(path)
    assert library.stat().st_mode & 0o044 == 0o044  # readable by another user
    shutil.copy(library, tmp_path / library.name)
    shutil.copy(native._digest_path(library), tmp_path)
    env = dict(os.environ, BATON_KERNEL_CACHE=str(tmp_path), CC="/nonexistent/cc",
               CXX="/nonexistent/c++")
    code = ("import backends.kernels as k; ok, why = k.available('portable'); "
            "print('LOADED', ok, why)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "LOADED True" in out.stdout, out.stdout + out.stderr


_FP_STATE_PROBE = """
import ctypes, ctypes.util, json, platform
import numpy as np

libm = ctypes.CDLL(ctypes.util.find_library("m"))


def fp_state():
    env = (ctypes.c_uint8 * 64)()  # glibc's fenv_t: 32 bytes on x86-64
    assert libm.fegetenv(env) == 0
    # x86-64: the SSE control/status register (MXCSR) sits at byte 28; its
    # low six bits are sticky exception flags (status, not control).
    mxcsr = (int.from_bytes(bytes(env[28:32]), "little") & ~0x3F
             if platform.machine() in ("x86_64", "AMD64") else None)
    # Behaviour too: a subnormal input survives (no DAZ), a subnormal
    # result is produced (no FTZ).
    kept = (float(np.float32(1e-39) * np.float32(1.0)) != 0.0,
            float(np.float32(1e-30) * np.float32(1e-10)) != 0.0)
    return mxcsr, kept


before = fp_state()
import backends.kernels as k
assert k.load()[0] is not None, "kernels did not load"
print("FP", json.dumps([before, fp_state()]))
"""


def test_loading_the_kernels_leaves_the_fp_control_state_alone(tmp_path):
    """Building and loading the kernel library changes no floating-point
    control bits of the process (a library linked with -ffast-math would set
    flush-to-zero and denormals-are-zero for everything in it, torch included)."""
    _kind_or_skip(CPU.kind)  # built (and cached) here; the probe loads it
    out = subprocess.run([sys.executable, "-c", _FP_STATE_PROBE], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("FP "))
    before, after = json.loads(line[3:])
    assert before[1] == [True, True], "subnormals were flushed before the kernels loaded"
    assert after == before, f"the FP control state changed: {before} -> {after}"


@pytest.fixture(scope="module")
def packing():
    if not packing_supported(torch.device("cpu"), torch.float32):
        if os.environ.get("CI"):
            pytest.fail("torch's oneDNN linear is unavailable (the pinned CPU build has it)")
        pytest.skip("this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(packing, bias):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    layer = PackedLinear(w, b)
    for shape in [(1, 40), (7, 40), (300, 40), (2, 5, 40)]:
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_prepack_replaces_only_plain_linears(packing):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(8, 2, bias=False)))
    x = torch.randn(3, 4)
    expected = model(x)
    assert prepack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def _run(backend: TorchBackend, prompts: list[list[int]], steps: int):
    """Prefill every prompt in one mixed step, then decode them together.
    Returns each step's sampled ids and the chosen tokens' logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True, logprobs=3)
    bs = backend.block_size
    tables = [list(range(1 + i * 8, 1 + (i + 1) * 8)) for i in range(len(prompts))]
    last = []
    ids_seen, logprobs_seen = [], []
    res = backend.execute(SchedulerOutput([
        ScheduledRequest(f"r{i}", p, 0, tables[i], True, params, 0, p)
        for i, p in enumerate(prompts)]))
    last = list(res.token_ids)
    ids_seen.append(list(res.token_ids))
    logprobs_seen.append([lp.logprob for lp in res.logprobs])
    for step in range(steps):
        out = SchedulerOutput([
            ScheduledRequest(f"r{i}", [last[i]], len(p) + step, tables[i], True, params,
                             step + 1) for i, p in enumerate(prompts)])
        assert all(len(p) + step < 8 * bs for p in prompts)
        res = backend.execute(out)
        last = list(res.token_ids)
        ids_seen.append(list(res.token_ids))
        logprobs_seen.append([lp.logprob for lp in res.logprobs])
    return ids_seen, logprobs_seen


def _backend(path, dtype: str, fast_paths: bool = True, cpu_kind: str = "auto",
             num_kv_blocks: int = 64) -> TorchBackend:
    loaded = load_model(path, dtype=getattr(torch, dtype))
    return create_backend(loaded, BackendConfig(
        dtype=dtype, block_size=4, num_kv_blocks=num_kv_blocks,
        # eager, as every test engine (tests/conftest.py): compiling costs seconds
        execution=ExecutionOptions(fast_paths=fast_paths, cpu_kind=cpu_kind, compile=False)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_backend_fast_paths_agree_with_torch_path(kind, packing, request, arch):
    """float32: each CPU kind's kernels and oneDNN against the torch ops."""
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    fast = _backend(path, "float32", cpu_kind=kind)
    plain = _backend(path, "float32", fast_paths=False)
    assert (fast.plan.kernels, fast.plan.linear, fast.plan.decode_attention) == (
        kind, "onednn", "native")
    assert (plain.plan.kernels, plain.plan.linear, plain.plan.decode_attention) == (
        None, "torch", "torch-sdpa")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 6, 13, 4)]
    ids_fast, lp_fast = _run(fast, prompts, 10)
    ids_plain, lp_plain = _run(plain, prompts, 10)
    assert ids_fast == ids_plain
    torch.testing.assert_close(torch.tensor(lp_fast), torch.tensor(lp_plain), atol=1e-4, rtol=0)


# ------------------------------------------------------------ bfloat16 weights
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 77)])
def test_bf16_gemv_matches_float32_matmul(kind, rows, out_features, in_features):
    gemv = native.GemvBf16(kind)
    gen = torch.Generator().manual_seed(rows + out_features)
    w16 = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    tiled = gemv.tile(w16)
    torch.testing.assert_close(gemv(x, tiled, out_features, bias),
                               F.linear(x, w16.float(), bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(gemv(x, tiled, out_features), F.linear(x, w16.float()),
                               atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="rows"):
        gemv(torch.randn(gemv.max_rows + 1, in_features), tiled, out_features)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 77)])
def test_bf16_gemv_of_bf16_rows_rounds_once(kind, rows, out_features, in_features):
    """bf16 activations (native-bf16 CPUs; VDPBF16PS in the avx512_bf16
    build): the float32 sum of exact products plus bias, rounded once to
    bf16, as oneDNN's bf16 linear rounds. Only the summation order may
    differ, so each value is the reference's or one bf16 step from it."""
    gemv = native.GemvBf16(kind)
    gen = torch.Generator().manual_seed(3 * rows + in_features)
    w16 = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x16 = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    b16 = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    tiled = gemv.tile(w16)
    for bias in (b16, None):
        y = gemv(x16, tiled, out_features, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        ref = F.linear(x16.double(), w16.double(), None if bias is None else bias.double())
        exact = (y.double() == ref.to(torch.bfloat16).double()).float().mean().item()
        assert exact >= 0.95, exact
        torch.testing.assert_close(y.double(), ref, atol=1e-6, rtol=2 ** -7)
    with pytest.raises(RuntimeError, match="bias"):
        gemv(x16, tiled, out_features, b16.float())


def test_bf16_weight_linear_is_one_function_of_the_rows(kind, packing):
    """Small batches (bf16 gemv) and large ones (float32 copy) compute the
    same x @ W^T on W's bfloat16 values."""
    from backends.linear import Bf16WeightLinear
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(80, 48, generator=gen)
    b = torch.randn(80, generator=gen)
    layer = Bf16WeightLinear(w, b, native.GemvBf16(kind))
    ref_w = w.to(torch.bfloat16).float()
    ref_b = b.to(torch.bfloat16).float()
    x = torch.randn(12, 48, generator=gen)
    for n in (1, 3, 4, 5, 12):
        torch.testing.assert_close(layer(x[:n]), F.linear(x[:n], ref_w, ref_b),
                                   atol=1e-4, rtol=1e-5)
    # A row gives the same answer whichever path its batch took.
    torch.testing.assert_close(layer(x[:1]), layer(x)[:1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bf16_weight_linear_takes_no_rows(kind, packing, weight_dtype):
    """A step whose chunks all stop short of their prompt's end samples no
    row: the output projection gets zero rows (a prompt longer than the step
    budget made that step fail the request)."""
    from backends.linear import Bf16WeightLinear
    if weight_dtype == torch.bfloat16 and not packing_supported(torch.device("cpu"),
                                                                torch.bfloat16):
        # bf16 activations are planned only where oneDNN runs bf16 (native
        # bf16 CPUs); an AVX2-only one (or ONEDNN_MAX_CPU_ISA=AVX2) has none.
        pytest.skip("oneDNN runs no bf16 linear here: no plan gives this layer bf16 rows")
    layer = Bf16WeightLinear(torch.randn(80, 48).to(weight_dtype), None,
                             native.GemvBf16(kind))
    out = layer(torch.randn(0, 48).to(weight_dtype))
    assert out.shape == (0, 80) and out.dtype == weight_dtype


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_weights_mode_agrees_with_its_torch_path(request, arch):
    """--dtype bfloat16 on a CPU without native bf16 (forced on CPUs with it,
    so it runs on every kind): the model's bf16 weights and KV cache with
    float32 arithmetic. With the fast paths (bf16 gemv for up to four rows,
    native ops) it must agree with the same
    plan on the torch ops: a float32 model with bf16-rounded weights and a
    bf16 KV cache."""
    kind = _kind_or_skip("avx2")
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    default = _backend(path, "bfloat16", num_kv_blocks=8)
    assert default.bf16_weights == (not CPU.native_bf16)
    fast = _backend(path, "bfloat16", cpu_kind=kind)
    plan = fast.plan
    assert plan.bf16_weights and (plan.activation_dtype, plan.kv_dtype) == ("float32",
                                                                             "bfloat16")
    assert (plan.linear, plan.kernels, plan.few_rows) == ("bf16-gemv+onednn", kind, 4)
    assert fast.kv_caches[0][0].dtype == torch.bfloat16
    reference = _backend(path, "bfloat16", fast_paths=False, cpu_kind=kind)
    ref_plan = reference.plan
    assert (ref_plan.linear, ref_plan.kernels) == ("torch", None)
    assert (ref_plan.activation_dtype, ref_plan.weight_dtype, ref_plan.kv_dtype) == (
        plan.activation_dtype, plan.weight_dtype, plan.kv_dtype)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 9, 3, 6, 2)]
    for n in (1, 3, 4, 5):
        rows = prompts[:n]
        ids_a, lp_a = _run(fast, rows, 8)
        ids_b, lp_b = _run(reference, rows, 8)
        assert ids_a == ids_b
        # Float32 summation order differs (~1e-7 relative); where a K/V value
        # sits at a bf16 rounding boundary that becomes one bf16 ulp (2^-9
        # relative), hence a looser bound than the float32 cache's 1e-4.
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-3, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_native_bf16_agrees_with_the_bf16_torch_ops(request, arch):
    """A CPU with native bf16 runs bfloat16 end to end (activations and KV)
    through its kernels and oneDNN's bf16 linears (on AMX machines the AMX
    tile linear's). Against the same plan on
    the torch ops (which round after every elementary op): logprobs agree to
    bf16 precision and nearly all greedy tokens are the same; against float32
    the kernels are no less accurate than the torch ops."""
    if not CPU.native_bf16:
        pytest.skip(f"this CPU ({CPU.describe()}) has no native bf16")
    _kind_or_skip(CPU.kind)
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    fast = _backend(path, "bfloat16")
    slow = _backend(path, "bfloat16", fast_paths=False)
    plan = fast.plan
    assert (plan.activation_dtype, plan.kv_dtype, plan.kernels) == ("bfloat16", "bfloat16",
                                                                    CPU.kind)
    assert plan.decode_attention == "native"
    assert plan.linear in ("bf16-gemv+onednn", "bf16-amx+onednn", "torch")
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 6, 13, 4)]
    ids_fast, lp_fast = _run(fast, prompts, 10)
    ids_slow, lp_slow = _run(slow, prompts, 10)
    _ids, lp_f32 = _run(_backend(path, "float32", fast_paths=False), prompts, 0)
    # The first step (the prompts' last positions) sees the same inputs on all three.
    first = [torch.tensor(lp[0]) for lp in (lp_fast, lp_slow, lp_f32)]
    torch.testing.assert_close(first[0], first[1], atol=0.1, rtol=0)
    err_fast, err_slow = ((x - first[2]).abs().max().item() for x in first[:2])
    assert err_fast <= 1.5 * err_slow + 0.01, (err_fast, err_slow)
    same = sum(a == b for x, y in zip(ids_fast, ids_slow) for a, b in zip(x, y))
    assert same >= 0.8 * sum(len(x) for x in ids_fast)


def test_numerics_do_not_depend_on_the_compiler(tiny_llama_dir):
    """The bf16-weights plan without native kernels (no compiler) computes
    what it computes with them: same dtypes, same tokens."""
    cpu = CPU.limited_to("avx2") if "avx2" in CPU.kinds else CPU
    fast = _backend(tiny_llama_dir, "bfloat16", cpu_kind=cpu.kind)
    no_cc = make_plan("cpu", "bfloat16", "none", cpu,
                      Availability(onednn_dtypes=frozenset(["float32"]), reason="no compiler"))
    assert no_cc.kernels is None and no_cc.linear == "onednn-f32-copy"
    assert (no_cc.activation_dtype, no_cc.weight_dtype, no_cc.kv_dtype) == (
        fast.plan.activation_dtype, fast.plan.weight_dtype, fast.plan.kv_dtype)
    slow = TorchBackend(load_model(tiny_llama_dir, dtype=torch.bfloat16), no_cc, block_size=4,
                        num_kv_blocks=64)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 2)]
    ids_a, lp_a = _run(fast, prompts, 8)
    ids_b, lp_b = _run(slow, prompts, 8)
    assert ids_a == ids_b
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-3, rtol=0)


def test_plan_of_this_machine_is_logged_in_one_line(tiny_llama_dir, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="baton.backend"):
        backend = _backend(tiny_llama_dir, "float32")
    lines = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    assert lines == [f"execution plan: {backend.plan.describe()}"]
    assert backend.plan == plan_for(BackendConfig(dtype="float32",
                                                  execution=ExecutionOptions(compile=False)))


def test_every_kernel_source_ships_in_the_package():
    """The kernels compile from sources at run time, so an installed Baton
    (wheel, Docker image) needs every .c/.h/.cpp file: pyproject's package-data
    must match each one."""
    import fnmatch
    import tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["backends"]
    kernel_dir = ROOT / "backends" / "kernels"
    sources = [p.relative_to(ROOT / "backends").as_posix() for p in kernel_dir.iterdir()
               if p.suffix in (".c", ".h", ".cpp")]
    assert sources
    from backends import kernels
    assert {p.name for p in (*kernels._C_SOURCES, *kernels._HEADERS, kernels._CPP_SOURCE)} == {
        p.rsplit("/", 1)[-1] for p in sources}
    for src in sources:
        assert any(fnmatch.fnmatch(src, pat) for pat in patterns), src


def test_include_paths_match_cpp_extension_without_importing_it():
    """The library's cache key is computed at every start from torch's include
    paths; Baton derives them itself (importing cpp_extension costs time) and
    they must stay what cpp_extension says, or a stale library could load."""
    from torch.utils import cpp_extension
    assert native.torch_include_paths() == cpp_extension.include_paths()
    probe = ("import sys, backends.kernels as k; k.library_path(); "
             "print('torch.utils.cpp_extension' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# ------------------------------------------- the cached library checks itself

@pytest.fixture
def fake_builds(tmp_path, monkeypatch):
    """``build()`` with the compilers replaced by writers of a fake library
    (one per build, so a rebuild is seen), in an empty kernel cache."""
    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_compilers", lambda: ("cc", "c++"))
    builds = []

    def run(cmd):
        out = Path(cmd[cmd.index("-o") + 1])
        if "-shared" in cmd:
            builds.append(out)
            out.write_bytes(b"\x7fELF fake library %d" % len(builds) + bytes(4096))
        else:
            out.write_bytes(b"object")
    monkeypatch.setattr(native, "_run", run)
    return builds


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty", "no digest"])
def test_a_damaged_library_is_built_again_and_the_log_says_why(fake_builds, damage, caplog):
    """Before: a truncated library crashed every start with SIGBUS, flipped
    bytes with SIGSEGV, and an empty one silently meant the torch ops."""
    library = native.build()
    assert len(fake_builds) == 1 and native.build() == library and len(fake_builds) == 1
    good = library.read_bytes()
    if damage == "truncated":
        library.write_bytes(good[:100])
    elif damage == "flipped byte":
        library.write_bytes(good[:50] + bytes([good[50] ^ 1]) + good[51:])
    elif damage == "empty":
        library.write_bytes(b"")
    else:
        native._digest_path(library).unlink()
    with caplog.at_level(logging.WARNING, logger="baton.kernels"):
        assert native.build() == library
    assert len(fake_builds) == 2, "the damaged library was not built again"
    assert native._damage(library) is None
    why = " ".join(r.getMessage() for r in caplog.records)
    assert "not used" in why and ("SHA-256" in why or "no digest" in why), why


def test_the_library_is_keyed_by_content_not_by_where_torch_lies(monkeypatch):
    """Before: the key held torch's folder (in the include and link flags),
    so every clone with its own environment built the library again."""
    here = native.library_path()
    moved = "/somewhere/else/site-packages/torch/__init__.py"
    monkeypatch.setattr(torch, "__file__", moved)
    assert any("/somewhere/else" in flag for flag in native._torch_flags()[0])
    assert native.library_path() == here
