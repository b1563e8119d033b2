"""The greedy pick of plain greedy batches (backends/sampler.py
``greedy_pick``: one ``max`` over the logits in the model's dtype): the same
token as torch.argmax over the float32 logits, ties, NaN and infinities
included, for float32 and bfloat16 rows; and the backend takes it only where
nothing else needs the logits (logprobs, bias, penalties, sampling)."""

from __future__ import annotations

import pytest
import torch

from backends.interface import SamplingParams
from backends.sampler import greedy_pick
from tests.engine_helpers import assert_all_free, make_engine, run_all
from tests.fault_backend import inject_faults

VOCAB = 49152  # SmolLM2's
DTYPES = [torch.float32, torch.bfloat16]


def _check(x: torch.Tensor) -> None:
    indices, finite = greedy_pick(x)
    wide = x.float()
    expected = wide.argmax(dim=-1)
    assert indices.dtype == torch.long
    assert torch.equal(indices, expected), (indices, expected)
    assert torch.equal(finite, torch.isfinite(wide.gather(1, expected[:, None])[:, 0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, VOCAB), (3, 37), (32, VOCAB), (5, 1), (4, 100)])
def test_greedy_pick_is_torch_argmax(dtype, rows, n):
    torch.manual_seed(rows * 1000 + n)
    _check(torch.randn(rows, n).to(dtype))
    # Few distinct values: many ties for the maximum, the first one wins.
    _check(torch.randint(-3, 4, (rows, n)).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_pick_ties_nan_and_infinities(dtype):
    n = 100
    rows = torch.randn(12, n).clamp(-5, 5)
    rows[0, [7, 40, 99]] = 9.0           # tied maximum: the first
    rows[1, [99, 98]] = 9.0
    rows[2] = 0.0
    rows[2, [3, 50]] = -0.0              # -0.0 and 0.0 tie: index 0
    rows[3, 0] = -0.0                    # ... whichever comes first
    rows[3, 1:] = 0.0
    rows[4, 20] = 9.0
    rows[4, 60] = float("nan")           # a NaN wins over the maximum
    rows[5, [10, 70]] = float("nan")     # the first NaN
    rows[6, 99] = float("nan")
    rows[7] = float("-inf")              # all -inf: index 0, not finite
    rows[8, [30, 31]] = float("inf")     # +inf wins, the first
    rows[9, 0] = float("nan")            # the very first element
    rows[10, 33] = float("inf")
    rows[10, 90] = float("nan")          # NaN beats +inf
    rows[11, :] = float("-inf")
    rows[11, 97] = -3.0                  # one finite value among -inf
    _check(rows.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_pick_over_blocks_and_the_tail(dtype):
    """Rows wide enough for the blocked pick (1,024-value blocks and a
    shorter tail): ties across blocks, NaN and infinities in a later block
    or in the tail, rows of only -inf."""
    n = VOCAB + 37
    rows = torch.randn(9, n).clamp(-5, 5)
    rows[0, [5000, 2000, n - 1]] = 9.0    # tied across blocks and the tail: the first
    rows[1, n - 3] = 9.0                  # the maximum in the tail
    rows[2, 3000] = 9.0
    rows[2, 40000] = float("nan")         # a NaN in a later block wins
    rows[3, n - 1] = float("nan")         # ... and in the tail
    rows[4] = float("-inf")               # all -inf: index 0, not finite
    rows[5, [1024, n - 2]] = float("inf")  # +inf at a block's first value
    rows[6, :] = float("-inf")
    rows[6, VOCAB + 5] = -3.0             # one finite value, in the tail
    rows[7, 1023] = 9.0                   # a block's last value
    rows[8, [0, 1024]] = 9.0              # block starts: the first
    _check(rows.to(dtype))
    _check(rows[:, :VOCAB].to(dtype))     # no tail


def test_greedy_pick_takes_slices_and_no_rows():
    """What the backend passes: a slice of a padded vocabulary (a
    tensor-parallel head's logits) and a step that samples no row."""
    padded = torch.randn(4, 130)
    padded[2, 127:] = 100.0  # the padding's values must not win
    ids, finite = greedy_pick(padded[:, :127])
    assert torch.equal(ids, padded[:, :127].argmax(dim=-1)) and bool(finite.all())
    ids, finite = greedy_pick(torch.empty(0, 127, dtype=torch.bfloat16))
    assert ids.shape == (0,) and finite.shape == (0,)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = {"a": [5, 17, 99, 230, 41], "b": [8, 77, 300, 12], "c": [400, 3, 3, 9, 250, 61]}


def _engine(model, dtype, calls: list | None = None):
    core = make_engine(model, dtype=dtype)
    if calls is not None:
        import backends.torch_backend as tb
        pick = tb.greedy_pick

        def counted(logits):
            calls.append(logits.dtype)
            return pick(logits)
        tb.greedy_pick = counted
    return core


@pytest.fixture
def restore_pick():
    import backends.torch_backend as tb
    pick = tb.greedy_pick
    yield
    tb.greedy_pick = pick


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backend_greedy_pick_gives_the_sampler_s_tokens(tiny_llama_dir, dtype, restore_pick):
    """Plain greedy batches take the pick over logits in the model's dtype; a
    batch with a logprobs row, a logit bias or a sampled row takes the
    sampler; the tokens (and logprobs) are the sampler's either way."""
    calls: list = []
    core = _engine(tiny_llama_dir, dtype, calls)
    plain = run_all(core, PROMPTS, GREEDY)
    assert calls and set(calls) == {getattr(torch, core.backend.plan.activation_dtype)}
    with_logprobs = {rid: SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                         logprobs=2) for rid in PROMPTS}
    calls.clear()
    reference = run_all(_engine(tiny_llama_dir, dtype), PROMPTS, with_logprobs)
    assert calls == []  # every step had a row that needs the float32 logits
    assert {k: v.token_ids for k, v in plain.items()} == \
        {k: v.token_ids for k, v in reference.items()}

    mixed_params = {"a": with_logprobs["a"], "b": GREEDY,
                    "c": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                        logit_bias=((7, 0.5),))}
    mixed = run_all(_engine(tiny_llama_dir, dtype), PROMPTS, mixed_params)
    assert calls == []
    assert mixed["b"].token_ids == reference["b"].token_ids
    assert mixed["a"].token_ids == reference["a"].token_ids
    assert len(mixed["a"].logprobs) == 6
    assert all(entry.token_id == t for entry, t in zip(mixed["a"].logprobs,
                                                        mixed["a"].token_ids))


def test_nan_row_fails_alone_on_the_greedy_pick(tiny_llama_dir, restore_pick):
    """A row whose logits come out NaN fails with its reason; the other
    greedy rows of the same plain greedy steps go on untouched."""
    calls: list = []
    reference = run_all(_engine(tiny_llama_dir, "float32"), PROMPTS, GREEDY)
    core = _engine(tiny_llama_dir, "float32", calls)
    faults = inject_faults(core)
    faults.nan_for = {"b"}
    results = run_all(core, PROMPTS, GREEDY)
    assert calls
    assert results["b"].finish_reason == "error"
    for rid in ("a", "c"):
        assert results[rid].token_ids == reference[rid].token_ids, rid
    assert_all_free(core)
