"""The greedy pick of plain greedy batches (backends/sampler.py ``greedy_pick``,
the native ``baton::row_max``): the same token as torch.argmax over the
float32 logits, ties, NaN and infinities included, for float32 and bfloat16
rows, on every CPU kind this CPU runs; and the backend takes it only where
nothing else needs the logits (logprobs, bias, penalties, sampling)."""

from __future__ import annotations

import pytest
import torch

from backends import kernels as native
from backends.execution import CPU_KINDS
from backends.interface import SamplingParams
from tests.engine_helpers import assert_all_free, make_engine, run_all
from tests.fault_backend import inject_faults
from tests.test_cpu_kernels import _kind_or_skip

VOCAB = 49152  # SmolLM2's: whole vectors, no tail
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=CPU_KINDS)
def row_max(request):
    k = native.kind_id(_kind_or_skip(request.param))
    return lambda x: torch.ops.baton.row_max(x, k)


def _check(row_max, x: torch.Tensor) -> None:
    values, indices = row_max(x)
    wide = x.float()
    expected = wide.argmax(dim=-1)
    assert indices.dtype == torch.long and values.dtype == torch.float32
    assert torch.equal(indices, expected), (indices, expected)
    torch.testing.assert_close(values, wide.gather(1, expected[:, None])[:, 0], rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, VOCAB), (3, 37), (32, VOCAB), (5, 1), (4, 100)])
def test_row_max_is_torch_argmax(row_max, dtype, rows, n):
    torch.manual_seed(rows * 1000 + n)
    _check(row_max, torch.randn(rows, n).to(dtype))
    # Few distinct values: many ties for the maximum, the first one wins.
    _check(row_max, torch.randint(-3, 4, (rows, n)).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_max_ties_nan_and_infinities(row_max, dtype):
    n = 100  # three whole vectors of 32 and a tail
    rows = torch.randn(12, n).clamp(-5, 5)
    rows[0, [7, 40, 99]] = 9.0           # tied maximum across vectors: the first
    rows[1, [99, 98]] = 9.0              # tied maximum in the tail
    rows[2] = 0.0
    rows[2, [3, 50]] = -0.0              # -0.0 and 0.0 tie: index 0
    rows[3, 0] = -0.0                    # ... whichever comes first
    rows[3, 1:] = 0.0
    rows[4, 20] = 9.0
    rows[4, 60] = float("nan")           # a NaN wins over the maximum
    rows[5, [10, 70]] = float("nan")     # the first NaN
    rows[6, 99] = float("nan")           # a NaN in the tail
    rows[7] = float("-inf")              # all -inf: index 0
    rows[8, [30, 31]] = float("inf")     # +inf wins, the first
    rows[9, 0] = float("nan")            # the very first element
    rows[10, 33] = float("inf")
    rows[10, 90] = float("nan")          # NaN beats +inf
    rows[11, :] = float("-inf")
    rows[11, 97] = -3.0                  # one finite value among -inf
    _check(row_max, rows.to(dtype))


def test_greedy_pick_of_the_plan_takes_slices_and_no_rows(tiny_llama_dir):
    """What the backend calls: a slice of a padded vocabulary (a
    tensor-parallel head's logits) and a step that samples no row."""
    from backends.ops import build_greedy_pick
    from backends.sampler import greedy_pick
    pick = build_greedy_pick(make_engine(tiny_llama_dir).backend.plan)
    if pick is None:
        pytest.skip("no native kernels here")
    padded = torch.randn(4, 130)
    padded[2, 127:] = 100.0  # the padding's values must not win
    ids, finite = greedy_pick(padded[:, :127], pick)
    assert torch.equal(ids, padded[:, :127].argmax(dim=-1)) and bool(finite.all())
    ids, finite = greedy_pick(torch.empty(0, 127, dtype=torch.bfloat16), pick)
    assert ids.shape == (0,) and finite.shape == (0,)


def test_row_max_checks_its_input(row_max):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        row_max(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="rows, n > 0"):
        row_max(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="contiguous"):
        row_max(torch.zeros(8, 4).t())


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = {"a": [5, 17, 99, 230, 41], "b": [8, 77, 300, 12], "c": [400, 3, 3, 9, 250, 61]}


def _engine(model, dtype, native_pick: bool, calls: list | None = None):
    core = make_engine(model, dtype=dtype)
    backend = core.backend
    # Plain greedy steps of <= 4 rows would go through the greedy screen
    # (tests/test_greedy_screen.py) instead of the pick over every logit.
    backend._screen = None
    assert backend.plan.greedy_pick == ("native" if backend.plan.kernels else "torch")
    if not native_pick:
        backend._greedy_pick = None
    elif backend._greedy_pick is None:
        pytest.skip(f"no native greedy pick here: {backend.plan.describe()}")
    elif calls is not None:
        pick = backend._greedy_pick

        def counted(logits):
            calls.append(logits.dtype)
            return pick(logits)
        backend._greedy_pick = counted
    return core


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backend_greedy_pick_gives_the_sampler_s_tokens(tiny_llama_dir, dtype):
    """Plain greedy batches take the native pick over logits in the model's
    dtype; a batch with a logprobs row, a logit bias or a sampled row takes
    the sampler; the tokens (and logprobs) are the sampler's either way."""
    calls: list = []
    plain = run_all(_engine(tiny_llama_dir, dtype, True, calls), PROMPTS, GREEDY)
    act = _engine(tiny_llama_dir, dtype, True).backend.plan.activation_dtype
    assert calls and set(calls) == {getattr(torch, act)}
    reference = run_all(_engine(tiny_llama_dir, dtype, False), PROMPTS, GREEDY)
    assert {k: v.token_ids for k, v in plain.items()} == \
        {k: v.token_ids for k, v in reference.items()}

    with_logprobs = {"a": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                         logprobs=2),
                     "b": GREEDY,
                     "c": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                         logit_bias=((7, 0.5),))}
    calls.clear()
    mixed = run_all(_engine(tiny_llama_dir, dtype, True, calls), PROMPTS, with_logprobs)
    assert calls == []  # every step had a row that needs the float32 logits
    assert mixed["b"].token_ids == reference["b"].token_ids
    assert mixed["a"].token_ids == reference["a"].token_ids
    assert len(mixed["a"].logprobs) == 6
    assert all(entry.token_id == t for entry, t in zip(mixed["a"].logprobs,
                                                        mixed["a"].token_ids))


def test_nan_row_fails_alone_on_the_greedy_pick(tiny_llama_dir):
    """A row whose logits come out NaN fails with its reason; the other
    greedy rows of the same plain greedy steps go on untouched."""
    calls: list = []
    reference = run_all(_engine(tiny_llama_dir, "float32", True), PROMPTS, GREEDY)
    core = _engine(tiny_llama_dir, "float32", True, calls)
    faults = inject_faults(core)
    faults.nan_for = {"b"}
    results = run_all(core, PROMPTS, GREEDY)
    assert calls
    assert results["b"].finish_reason == "error"
    for rid in ("a", "c"):
        assert results[rid].token_ids == reference[rid].token_ids, rid
    assert_all_free(core)
