"""The AMX tile linear (backends/kernels/amx_bf16.c): decode batches of bf16
rows on the gemv's tiled bf16 weights, where the CPU has AMX-BF16 and the OS
lets the process use tile data. It must compute what oneDNN's bf16 linear
computes (float32 sums of exact products, plus bias, rounded once to bf16):
only the summation order may differ. Where the CPU has no AMX the tests that
run it skip with that reason; the refusal of every other kind, the plan and
the routing by rows are checked everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends import kernels as native
from backends.execution import (AMX_FEW_ROWS, AMX_PREFILL_ROWS, CPU_KINDS, Availability,
                                CpuFeatures, ExecutionOptions, make_plan)
from backends.factory import BackendConfig, create_backend
from backends.loader import load_model

from tests.test_cpu_kernels import CPU, _kind_or_skip, _run

AMX = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, amx_bf16=True)
ZEN4 = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True)
ALL = Availability(native_kernels=frozenset(CPU_KINDS),
                   onednn_dtypes=frozenset({"float32", "bfloat16"}), amx_tiles=True)


def _amx_or_skip() -> native.LinearAmx:
    if not CPU.amx_bf16:
        pytest.skip(f"this CPU ({CPU.describe()}) has no AMX-BF16")
    _kind_or_skip("avx512_bf16")
    ok, reason = native.amx_ready("avx512_bf16")
    if not ok:
        pytest.skip(f"no AMX tile linear here: {reason}")
    return native.LinearAmx("avx512_bf16", 32)


def _bf16_operands(seed, rows, out_features, in_features):
    """Random bf16 weights [out, in], rows [rows, in] and bias [out], in that
    order from one generator seeded with seed."""
    gen = torch.Generator().manual_seed(seed)
    w16 = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x16 = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    b16 = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    return w16, x16, b16


def _close_to_rounded_reference(y, x16, w16, b16):
    """Each value the float64 reference rounded to bf16, or one bf16 step
    from it (another summation order), give or take what a float32 sum of K
    products can lose where they cancel (K * 2^-24 * sum |x w|, the classic
    bound); nearly all of them exact."""
    ref = F.linear(x16.double(), w16.double(), None if b16 is None else b16.double())
    exact = (y.double() == ref.to(torch.bfloat16).double()).float().mean().item()
    assert exact >= 0.95, exact
    k = x16.shape[1] + (b16 is not None)
    magnitude = F.linear(x16.double().abs(), w16.double().abs(),
                         None if b16 is None else b16.double().abs())
    allowed = 2 ** -7 * ref.abs() + k * 2 ** -24 * magnitude + 1e-30
    excess = ((y.double() - ref).abs() / allowed).max().item()
    assert excess <= 1.0, excess


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 77), (24, 1030)])
def test_amx_linear_rounds_once_like_onednn(rows, out_features, in_features):
    """Odd shapes included: features not a multiple of 8 or 16, columns not a
    multiple of 16 (or of 2), rows not a multiple of 16 and above 32 (more
    than one pass over the row blocks)."""
    amx = _amx_or_skip()
    w16, x16, b16 = _bf16_operands(rows * 7 + in_features, rows, out_features, in_features)
    tiled = native.GemvBf16.tile(w16)
    for bias in (b16, None):
        y = amx(x16, tiled, out_features, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        _close_to_rounded_reference(y, x16, w16, bias)
    # oneDNN's bf16 linear on the same values: the same results up to order.
    onednn = F.linear(x16, w16, b16)
    torch.testing.assert_close(amx(x16, tiled, out_features, b16).double(), onednn.double(),
                               atol=1e-6, rtol=2 ** -7)


def test_tile_layout_is_what_the_kernels_read():
    """The layout kernels.h documents: blocks of 16 features x 32 columns,
    each [16 column pairs][16 features][2], zero padding past N and K."""
    w = torch.arange(37 * 77, dtype=torch.float32).view(37, 77).to(torch.bfloat16)
    t = native.GemvBf16.tile(w)
    assert t.shape == (3, 3, 16, 32) and t.dtype == torch.bfloat16 and t.is_contiguous()
    blocks = t.view(3, 3, 16, 16, 2)  # [N/16][K/32][pair][feature][2]
    for n, k in [(0, 0), (0, 1), (5, 2), (15, 31), (16, 32), (36, 76), (20, 45)]:
        assert blocks[n // 16, k // 32, (k % 32) // 2, n % 16, k % 2] == w[n, k]
    assert not blocks[2, :, :, 5:].any()  # features 37..47
    assert not blocks[:, 2, 7:].any() and not blocks[:, 2, 6, :, 1].any()  # columns 77..95


@pytest.mark.parametrize("out_features,in_features", [(40, 33), (17, 96), (64, 1537)])
def test_amx_linear_row_does_not_depend_on_the_batch(out_features, in_features):
    """A row's result is bit-for-bit the same whatever rows share its batch
    (1..64 of them): the prefix cache relies on it (a prompt's suffix may be
    computed beside other rows, or alone). Odd K, features not a multiple of
    16, bias and none; every value within a bf16 step of the reference."""
    amx = _amx_or_skip()
    w16, x16, b16 = _bf16_operands(out_features + in_features, 64, out_features, in_features)
    tiled = native.GemvBf16.tile(w16)
    for bias in (b16, None):
        full = amx(x16, tiled, out_features, bias)
        _close_to_rounded_reference(full, x16, w16, bias)
        for m in range(1, 65):
            part = amx(x16[64 - m:], tiled, out_features, bias)
            assert torch.equal(part, full[64 - m:]), m


@pytest.mark.parametrize("rows,out_features,in_features",
                         [(700, 40, 1537), (97, 33, 64), (300, 1001, 1537), (290, 3000, 576),
                          (100, 40, 11000)])
def test_amx_linear_many_rows_give_each_row_the_few_row_bits(rows, out_features, in_features):
    """Prefill chunks take the many-row paths: rows packed in tile order, in
    panels (97 rows), or above 128 rows (and where K is so wide that panels
    would read the weights three times: 100 rows of 11000 columns) row-major
    over chunks of each thread's weights, K cut into slices whose sums wait
    in float32 between them (1001 or 3000 features span several chunks; an
    odd row block, an odd last feature block); each row's bits are still
    those of the few-row path (rows 16 at a time), and within a bf16 step of
    the reference."""
    amx = _amx_or_skip()
    w16, x16, b16 = _bf16_operands(rows, rows, out_features, in_features)
    tiled = native.GemvBf16.tile(w16)
    for bias in (b16, None):
        full = amx(x16, tiled, out_features, bias)
        _close_to_rounded_reference(full, x16, w16, bias)
        few = torch.cat([amx(x16[i:i + 16], tiled, out_features, bias)
                         for i in range(0, rows, 16)])
        assert torch.equal(full, few)
        assert torch.equal(amx(x16[3:], tiled, out_features, bias), full[3:])


def test_amx_linear_checks_its_inputs():
    amx = _amx_or_skip()
    w = native.GemvBf16.tile(torch.randn(40, 32).to(torch.bfloat16))
    x = torch.randn(6, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        amx(x.float(), w, 40)
    with pytest.raises(RuntimeError, match="tiled bf16 layout"):
        amx(x, w, 64)
    with pytest.raises(RuntimeError, match="bias"):
        amx(x, w, 40, torch.randn(40))
    assert amx(x[:0], w, 40).shape == (0, 40)


@pytest.mark.parametrize("kind", [k for k in CPU_KINDS if k != "avx512_bf16"])
def test_other_kinds_have_no_amx_linear(kind):
    """Only the avx512_bf16 build has the tile code: every other kind says
    so (and its operator refuses) rather than computing something else."""
    kind = _kind_or_skip(kind)
    ok, reason = native.amx_ready(kind)
    assert not ok and "no AMX tile linear" in reason
    with pytest.raises(RuntimeError, match="no AMX tile linear"):
        torch.ops.baton.linear_amx(torch.zeros(5, 16, dtype=torch.bfloat16),
                                   torch.zeros(1, 1, 8, 16, dtype=torch.bfloat16), 8, None,
                                   native.kind_id(kind))
    with pytest.raises(RuntimeError, match="no AMX"):
        native.LinearAmx(kind, 32)


def _kernels_of(layer, x, gemv, amx) -> set[str]:
    """The kernels whose own result ``layer(x)`` equals to the bit
    (baton::linear_tiled picks one in C++ by the number of rows; at one row
    the gemv and the tile linear may agree)."""
    y = layer(x)
    found = set()
    if x.shape[0] <= gemv.max_rows and torch.equal(
            y, gemv(x, layer.weight_tiled, layer.out_features, layer.bias)):
        found.add("gemv")
    if torch.equal(y, amx(x, layer.weight_tiled, layer.out_features, layer.bias)):
        found.add("amx")
    return found


def test_bf16_weight_linear_gives_batches_up_to_max_rows_to_amx():
    """bf16-amx+onednn: every batch of 1 to max_rows rows (the gemv's few and
    prefill chunks alike) on the tile linear; a row's bits the same whichever
    such batch it came in; oneDNN above max_rows; without the tile linear the
    gemv takes its few rows."""
    from backends.linear import Bf16WeightLinear
    amx = _amx_or_skip()
    amx.max_rows = 300
    gemv = native.GemvBf16("avx512_bf16")
    gen = torch.Generator().manual_seed(22)
    w = torch.randn(80, 600, generator=gen).to(torch.bfloat16)
    b = torch.randn(80, generator=gen).to(torch.bfloat16)
    layer = Bf16WeightLinear(w, b, gemv, amx)
    assert "1-300 rows on the AMX tiles" in repr(layer)
    x = torch.randn(301, 600, generator=gen).to(torch.bfloat16)
    full = layer(x[1:])
    _close_to_rounded_reference(full, x[1:], w, b)
    for n in (1, 3, 5, 33, 129):
        assert torch.equal(layer(x[-n:]), full[-n:]), n
        assert "amx" in _kernels_of(layer, x[-n:], gemv, amx), n
    _close_to_rounded_reference(layer(x), x, w, b)  # 301 rows: oneDNN
    no_tiles = Bf16WeightLinear(w, b, gemv)
    assert "gemv" in _kernels_of(no_tiles, x[:4], gemv, amx)
    _close_to_rounded_reference(no_tiles(x[:5]), x[:5], w, b)
    with pytest.raises(ValueError, match="AMX tile linear"):
        Bf16WeightLinear(w.float(), b.float(), gemv, amx)


def test_plan_gives_every_bf16_row_to_amx_only_where_it_runs():
    """Native bf16 with AMX tiles available: every call of up to
    AMX_PREFILL_ROWS rows on the tile linear (bf16-amx+onednn). Not without
    AMX (the AVX512_BF16 EPYC kind), nor without the OS's leave (amx_tiles),
    nor when turned off, nor for float32 or the bf16-weights mode."""
    plan = make_plan("cpu", "bfloat16", "none", AMX, ALL)
    assert plan.amx_linear_rows == AMX_PREFILL_ROWS
    assert (plan.linear, plan.lm_head) == ("bf16-amx+onednn",) * 2
    assert f"amx-tile linear <= {AMX_PREFILL_ROWS} rows" in plan.describe()
    # a c=32 decode step reads the weights about once on the tiles: the
    # speculative budget's rows
    assert plan.few_rows == AMX_FEW_ROWS
    no_tiles = Availability(native_kernels=ALL.native_kernels, onednn_dtypes=ALL.onednn_dtypes)
    others = [make_plan("cpu", "bfloat16", "none", ZEN4, ALL),
              make_plan("cpu", "bfloat16", "none", AMX, no_tiles),
              make_plan("cpu", "bfloat16", "none", AMX, ALL, ExecutionOptions(amx=False)),
              make_plan("cpu", "bfloat16", "none", AMX, ALL, ExecutionOptions(cpu_kind="avx2")),
              make_plan("cpu", "float32", "none", AMX, ALL),
              make_plan("cpu", "bfloat16", "int8", AMX, ALL),
              make_plan("cpu", "bfloat16", "int4", AMX, ALL),
              make_plan("cpu", "bfloat16", "none", AMX, ALL,
                        ExecutionOptions(fast_paths=False))]
    assert [p.amx_linear_rows for p in others] == [0] * len(others)
    assert [p.few_rows for p in others] == [4, 4, 4, 4, 0, 0, 0, 0]
    for p in others[:3]:
        assert (p.activation_dtype, p.weight_dtype, p.kv_dtype, p.linear) == (
            plan.activation_dtype, plan.weight_dtype, plan.kv_dtype, "bf16-gemv+onednn")


def test_plan_names_amx_attention_scores_where_the_kernel_takes_them():
    """The decode attention kernel's bf16 scores run on AMX tiles wherever the
    avx512_bf16 kernels run with AMX tile data (paged_attention.c decides it
    at run time, whatever ExecutionOptions.amx says of the linears): the plan
    and its log line say so there, and only there."""
    plan = make_plan("cpu", "bfloat16", "none", AMX, ALL)
    assert plan.attention_scores == "amx"
    assert "decode attention native (amx scores)" in plan.describe()
    assert make_plan("cpu", "bfloat16", "none", AMX, ALL,
                     ExecutionOptions(amx=False)).attention_scores == "amx"
    no_tiles = Availability(native_kernels=ALL.native_kernels, onednn_dtypes=ALL.onednn_dtypes)
    others = [make_plan("cpu", "bfloat16", "none", ZEN4, ALL),
              make_plan("cpu", "bfloat16", "none", AMX, no_tiles),
              make_plan("cpu", "bfloat16", "none", AMX, ALL, ExecutionOptions(cpu_kind="avx2")),
              make_plan("cpu", "float32", "none", AMX, ALL),
              make_plan("cpu", "bfloat16", "none", AMX, ALL,
                        ExecutionOptions(fast_paths=False))]
    assert [p.attention_scores for p in others] == [""] * len(others)
    assert all("scores)" not in p.describe() for p in others)


def _backend(path, amx: bool):
    loaded = load_model(path, dtype=torch.bfloat16)
    return create_backend(loaded, BackendConfig(
        dtype="bfloat16", block_size=4, num_kv_blocks=80,
        execution=ExecutionOptions(amx=amx, compile=False)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_amx_rows_agree_with_onednn(request, arch):
    """A native-bf16 backend whose linears take every call of up to 1024 rows
    on the AMX tile linear (prefill chunks, and decode batches on the layer
    path) against the same plan on oneDNN: the same greedy tokens and
    logprobs to bf16 precision (only the summation order differs)."""
    _amx_or_skip()
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    fast, onednn = _backend(path, amx=True), _backend(path, amx=False)
    assert fast.plan.linear == "bf16-amx+onednn" and onednn.plan.amx_linear_rows == 0
    assert fast.model.lm_head.amx is not None
    gen = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist()
               for n in (1, 9, 3, 6, 2, 5, 7, 4)]
    ids_a, lp_a = _run(fast, prompts, 8)
    ids_b, lp_b = _run(onednn, prompts, 8)
    assert ids_a == ids_b
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=0.01, rtol=0)


def test_a_process_capped_below_amx_runs_no_tiles(tiny_llama_dir):
    """ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 on an AMX CPU: the process plans
    and runs as an AVX512_BF16 CPU without AMX would (an EPYC of that kind),
    the decode attention's scores included (they choose AMX at run time), so
    the cap measures and tests that kind here."""
    import json
    import os
    import subprocess
    import sys
    _amx_or_skip()
    script = (
        "import json, sys, torch\n"
        "from backends import kernels as native\n"
        "from backends.execution import CpuFeatures, ExecutionOptions\n"
        "from backends.factory import BackendConfig, create_backend\n"
        "from backends.loader import load_model\n"
        "loaded = load_model(sys.argv[1], dtype=torch.bfloat16)\n"
        "backend = create_backend(loaded, BackendConfig(dtype='bfloat16', block_size=4,\n"
        "    num_kv_blocks=16, execution=ExecutionOptions(compile=False)))\n"
        "print(json.dumps({'kind': CpuFeatures.detect().describe(),\n"
        "                  'scores': native.attention_amx('avx512_bf16'),\n"
        "                  'plan': backend.plan.describe()}))\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    out = subprocess.run([sys.executable, "-c", script, str(tiny_llama_dir)], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["kind"] == "avx512_bf16" and got["scores"] is False
    assert "native avx512_bf16" in got["plan"] and "amx" not in got["plan"], got["plan"]
