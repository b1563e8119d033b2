"""The screened greedy pick (backends/greedy_screen.py, kernels/greedy_screen.c):
a plain greedy step of up to four rows picks through an int8 copy of the bf16
output projection and computes exactly only the logits that can still win.
Its token must be the one the full projection's ``row_max`` picks, ties to
the lowest id, on both kernels the projection may run (the AMX tile linear,
the VDPBF16PS gemv), near-ties and exact ties included; what the bound does
not cover falls back to the full projection; the engine's tokens do not
change. The kernels need native bf16 (the avx512_bf16 build); the AMX case
also AMX tile data: elsewhere those tests skip with the reason."""

from __future__ import annotations

import pytest
import torch

from backends import greedy_screen as screen_mod
from backends import kernels as native
from backends.execution import (AMX_LINEAR_ROWS, CpuFeatures, ExecutionOptions, make_plan)
from backends.greedy_screen import ScreenedGreedyPick, int8_copy, untile
from backends.interface import SamplingParams
from backends.linear import Bf16WeightLinear

from tests.engine_helpers import make_engine, run_all
from tests.test_amx_linear import ALL, AMX, ZEN4, _amx_or_skip
from tests.test_cpu_kernels import _kind_or_skip

KIND = "avx512_bf16"


def _head(weight: torch.Tensor, amx: bool) -> Bf16WeightLinear:
    _kind_or_skip(KIND)
    gemv = native.GemvBf16(KIND)
    if amx:
        return Bf16WeightLinear(weight, None, gemv, _amx_or_skip(), every_row=True)
    return Bf16WeightLinear(weight, None, gemv)


def _hard_weight(vocab: int = 1203, width: int = 100, seed: int = 0) -> torch.Tensor:
    """Random bf16 rows (vocab not a multiple of 16, width not of 32) with
    the cases a screen can get wrong: exact duplicates (ties: the lower id
    must win), rows one bf16 step apart in one element, an all-zero row,
    rows of very different scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, width, generator=g) * 0.05
    w[100:110] *= 40.0           # a few rows of a much larger scale
    w[7] = 0.0                   # scale 0
    w[500] = w[20]               # exact duplicates of earlier rows
    w[501] = w[20]
    w = w.to(torch.bfloat16)
    w[900] = w[30]
    w[900, 3] = torch.nextafter(w[30, 3].float(), torch.tensor(1e9)).to(torch.bfloat16)
    return w


def _rows(weight: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """Rows aimed near the weight rows above (so their logits nearly tie)
    and plain random ones, at several magnitudes."""
    g = torch.Generator().manual_seed(seed)
    width = weight.shape[1]
    x = torch.randn(count, width, generator=g) * (1 + 10 * torch.rand(count, 1, generator=g))
    aims = (weight[20].float() * 30,     # its duplicates 500, 501 tie with row 20
            weight[30].float() * 30,     # 900 is one step off row 30
            weight[105].float())
    for i in range(min(count, len(aims))):
        x[i] = aims[(i + seed) % len(aims)]
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("amx", [True, False], ids=["amx-tile-linear", "gemv"])
def test_screened_pick_is_the_full_projection_s(amx):
    weight = _hard_weight()
    head = _head(weight, amx)
    pick = ScreenedGreedyPick(head, KIND, 4)
    for seed in range(12):
        for rows in (1, 2, 3, 4):
            x = _rows(weight, rows, seed * 10 + rows)
            got = pick(x)
            assert got is not None
            values, full = torch.ops.baton.row_max(head(x), native.kind_id(KIND))
            assert torch.equal(got[0], full), (seed, rows)
            assert torch.equal(got[1], torch.isfinite(values))
    # The exact tie: rows 20, 500 and 501 hold the same weights and, without
    # the large rows, the largest logit of a row aimed at them: 20 wins.
    weight[100:110] = 0
    head = _head(weight, amx)
    pick = ScreenedGreedyPick(head, KIND, 4)
    x = (weight[20].float() * 30).to(torch.bfloat16).unsqueeze(0)
    logits = head(x)[0].float()
    assert logits[20] == logits[500] == logits[501] == logits.max()
    assert int(pick(x)[0][0]) == 20


def test_int8_copy_bounds_every_weight():
    weight = _hard_weight()
    q, scales = int8_copy(weight)
    v, k = weight.shape
    assert q.dtype == torch.int8 and q.shape == (-(-v // 16), k, 16)
    back = q.permute(0, 2, 1).reshape(-1, k)[:v].double() * scales.double().unsqueeze(1)
    err = (back - weight.double()).abs()
    assert bool((err <= scales.double().unsqueeze(1) * (0.5 + 1e-5)).all())
    assert scales[7] == 0 and int(q.permute(0, 2, 1).reshape(-1, k)[7].abs().sum()) == 0


def test_a_projection_with_bias_is_refused():
    weight = _hard_weight()
    _kind_or_skip(KIND)
    head = Bf16WeightLinear(weight, torch.ones(weight.shape[0]), native.GemvBf16(KIND))
    with pytest.raises(ValueError, match="without bias"):
        ScreenedGreedyPick(head, KIND, 4)


def test_untile_inverts_the_gemv_tiles():
    weight = _hard_weight()
    assert torch.equal(untile(native.GemvBf16.tile(weight), *weight.shape), weight)


def test_what_the_bound_does_not_cover_falls_back(monkeypatch):
    weight = _hard_weight()
    weight[100:110] = 0  # so that the tie of rows 20, 500 and 501 is the largest logit
    head = _head(weight, False)
    pick = ScreenedGreedyPick(head, KIND, 4)
    x = _rows(weight, 2, 3)
    x[1, 5] = float("nan")
    assert pick(x) is None                       # a non-finite row
    huge = torch.full((1, weight.shape[1]), 1e36).to(torch.bfloat16)
    assert pick(huge) is None                    # logits near bf16's overflow
    assert pick(_rows(weight, 5, 1)) is None     # more rows than it takes
    monkeypatch.setattr(screen_mod, "MAX_CANDIDATES", 1)
    tie = (weight[20].float() * 30).to(torch.bfloat16).unsqueeze(0)
    assert pick(tie) is None                     # 20, 500 and 501 are all candidates


def test_greedy_screen_checks_its_input():
    _kind_or_skip(KIND)
    weight = _hard_weight()
    q, scales = int8_copy(weight)
    tiles = native.GemvBf16.tile(weight)
    op, k = torch.ops.baton.greedy_screen, native.kind_id(KIND)
    x = torch.zeros(1, weight.shape[1], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1-4 bfloat16 rows"):
        op(torch.zeros(5, weight.shape[1], dtype=torch.bfloat16), q, scales, tiles, 64, k)
    with pytest.raises(RuntimeError, match="1-4 bfloat16 rows"):
        op(x.float(), q, scales, tiles, 64, k)
    with pytest.raises(RuntimeError, match="int8"):
        op(x, q[:-1], scales, tiles, 64, k)
    with pytest.raises(RuntimeError, match="tiles"):
        op(x, q, scales, tiles[:-1], 64, k)


def test_the_plan_screens_bf16_heads_only():
    amx = make_plan("cpu", "bfloat16", "none", AMX, ALL)
    zen4 = make_plan("cpu", "bfloat16", "none", ZEN4, ALL)
    assert amx.greedy_screen == zen4.greedy_screen == 4
    assert "greedy screen <= 4 rows" in amx.describe()
    for plan in (make_plan("cpu", "float32", "none", AMX, ALL),
                 make_plan("cpu", "bfloat16", "none", CpuFeatures(avx2=True), ALL),
                 make_plan("cpu", "bfloat16", "none", AMX, ALL,
                           ExecutionOptions(greedy_screen=False)),
                 make_plan("cpu", "bfloat16", "none", AMX, ALL,
                           ExecutionOptions(tensor_parallel_size=2)),
                 make_plan("cpu", "bfloat16", "none", AMX, ALL,
                           ExecutionOptions(fast_paths=False)),
                 make_plan("cpu", "bfloat16", "gguf", AMX, ALL)):
        assert plan.greedy_screen == 0, plan.describe()
    from tests.test_execution_plan import _model
    gemma = make_plan("cpu", "bfloat16", "none", AMX, ALL, model=_model(final_logit_softcap=30.0))
    assert gemma.greedy_screen == 0 and "no greedy screen" in gemma.describe()


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [5, 17, 99, 230, 41], "b": [8, 77, 300, 12], "c": [400, 3, 3, 9, 250, 61]}


def test_the_engine_s_tokens_do_not_change(tiny_llama_dir):
    """Plain greedy steps of up to four rows go through the screen; the
    tokens are those of the full projection (the screen off)."""
    core = make_engine(tiny_llama_dir, dtype="bfloat16")
    backend = core.backend
    if backend._screen is None:
        pytest.skip(f"no greedy screen here: {backend.plan.describe()}")
    calls = []
    screen = backend._screen

    def counted(hidden):
        got = screen(hidden)
        calls.append(got is not None)
        return got
    backend._screen = counted
    screened = run_all(core, PROMPTS, GREEDY)
    assert calls and all(calls)
    off = make_engine(tiny_llama_dir, dtype="bfloat16")
    off.backend._screen = None  # every logit, as ExecutionOptions(greedy_screen=False) plans
    reference = run_all(off, PROMPTS, GREEDY)
    assert {k: v.token_ids for k, v in screened.items()} == \
        {k: v.token_ids for k, v in reference.items()}


def test_amx_rows_match_the_decode_batch_limit():
    # the screen's exact pass calls the projection's kernel with the step's
    # rows: the AMX tile linear must take them (every_row) as forward does
    assert AMX_LINEAR_ROWS >= 4
