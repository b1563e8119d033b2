"""bf16 on AMX machines: a prompt served with a prefix-cache hit computes what
it computes cold, bit for bit. A hit recomputes only the prompt's tail, so
its rows pass through the linears in batches of another size than the cold
prefill's; a linear whose per-row result depends on how many rows share its
call (oneDNN's bf16 linear does, above a few dozen columns) then gives the
tail and the KV of its prefix other bits, and a near tie between two tokens
can tip (session 7 saw "Say hello." answered differently when cached). On
AMX machines every bf16 call of up to AMX_PREFILL_ROWS (1024) rows goes
through the AMX tile linear, whose rows do not depend on the batch (larger
calls, a burst's prefill-only step, take oneDNN: not covered). Elsewhere (no
AMX: the gemv and oneDNN split the rows by count) this consistency is not
promised, and the test skips."""

from __future__ import annotations

import pytest
import torch

from backends.interface import SamplingParams
from tests.conftest import ENDOFTEXT_ID, IM_END_ID, build_tiny_model, _quiet_transformers
from tests.engine_helpers import make_engine, run_all
from tests.test_amx_linear import _amx_or_skip

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
PROMPT_LEN = 70
# (block size, cached prefix lengths): blocks of 4, tails of 2 (the gemv's
# rows on machines without AMX), 22 and 54 rows (above the decode batch of
# 32); blocks of 16, tails of 6, 22 and 54 rows. The prompts' attention is
# torch's SDPA, whose rows do not depend on the chunk either.
CASES = [(4, (68, 48, 16)), (16, (64, 48, 16))]


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Llama with SmolLM2-135M's widths (hidden 576, intermediate 1536), two
    layers: wide enough that oneDNN's bf16 linear sums a row in an order that
    depends on the row count."""
    _quiet_transformers()
    return build_tiny_model(tmp_path_factory.mktemp("wide-llama"), tiny_tokenizer_dir,
                            arch="llama", seed=11, tie=False,
                            generation={"bos_token_id": ENDOFTEXT_ID,
                                        "eos_token_id": IM_END_ID},
                            hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3, head_dim=64)


@pytest.mark.parametrize("block_size,cached", CASES, ids=["blocks-4", "blocks-16"])
def test_bf16_prefix_cache_hit_computes_what_cold_computes(wide_llama_dir, block_size, cached):
    _amx_or_skip()
    gen = torch.Generator().manual_seed(5)
    prompts = {f"p{k}": torch.randint(3, 512, (PROMPT_LEN,), generator=gen).tolist()
               for k in cached}
    config = dict(dtype="bfloat16", block_size=block_size, max_num_batched_tokens=256)
    cold_core = make_engine(wide_llama_dir, enable_prefix_caching=False, **config)
    assert "amx" in cold_core.backend.plan.describe()
    cold = run_all(cold_core, prompts, GREEDY)
    hot_core = make_engine(wide_llama_dir, **config)
    for k in cached:
        # another prompt that shares exactly the first k tokens
        other = prompts[f"p{k}"][:k] + [7, 8, 9, 10, 11]
        run_all(hot_core, {f"q{k}": other}, GREEDY)
        hot = run_all(hot_core, {f"p{k}": prompts[f"p{k}"]}, GREEDY)[f"p{k}"]
        ref = cold[f"p{k}"]
        assert hot.num_cached_tokens == k and ref.num_cached_tokens == 0
        assert hot.token_ids == ref.token_ids, k
        for a, b in zip(hot.logprobs, ref.logprobs, strict=True):
            assert a.logprob == b.logprob and a.top == b.top, k
