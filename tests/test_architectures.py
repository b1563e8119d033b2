"""The families beyond Llama / Qwen2 / Qwen3 (conftest.NEW_ARCHITECTURES:
Mistral with a sliding window, Phi-3 / Phi-4-mini, Gemma 2, Gemma 3,
Qwen3-MoE, Mixtral) token for token against transformers in float32, through the
whole engine, with windows of a few tokens that every prompt outgrows."""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import make_engine, run_all
from tests.test_engine_agreement import (GREEDY, PREEMPTION_LENGTHS, SCENARIOS, _prompts,
                                         _reference, assert_matches_reference)


# The portable torch ops (CUDA's path too) in one scenario: the layers these
# families add run the same torch code on both paths.
CASES = [(scenario, True) for scenario in SCENARIOS] + [("chunked_prefill", False)]
# The quick loop (./scripts/test.sh --quick) runs each family's chunked prefill on
# the fast paths (prefill, chunks and decode); the other cases are `slow`.
QUICK_CASE = ("chunked_prefill", True)


@pytest.mark.parametrize("scenario,fast_paths", [
    pytest.param(s, f, id=f"{s}-{'fast-paths' if f else 'torch-ops'}",
                 marks=() if (s, f) == QUICK_CASE else pytest.mark.slow) for s, f in CASES])
def test_greedy_matches_transformers(tiny_new_arch_dir, scenario, fast_paths):
    arch, path = tiny_new_arch_dir
    core = make_engine(path, fast_paths=fast_paths, **SCENARIOS[scenario])
    lengths = PREEMPTION_LENGTHS if scenario == "preemption" else None
    prompts = _prompts(core.vocab_size, seed=len(arch), **({"lengths": lengths}
                                                            if lengths else {}))
    results = run_all(core, prompts, GREEDY)
    if scenario == "preemption":
        assert core.scheduler.num_preemptions_total > 0, "the tiny pool forced no preemption"
    assert_matches_reference(results, _reference(path, prompts), f"{arch}/{scenario}")


@pytest.mark.parametrize("mode", ["int8", pytest.param("int4", marks=pytest.mark.slow),
                                  pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_quantized_linears(tiny_new_arch_dir, mode):
    """int8 (per channel) and int4 (groups of 32) replace every projection
    the weight spec lists, Qwen3-MoE's experts and Phi-3's fused tensors
    included (the router stays float); teacher-forced top-1 along a fixed
    text mostly agrees with float32 (bounds as tests/test_quantization.py
    measured them on random weights), and so does bfloat16 serving."""
    from backends.models.weight_spec import layer_linears
    from backends.quantization.int4 import Int4Linear
    from backends.quantization.int8 import Int8Linear
    from tests.test_quantization import _top1_along
    arch, path = tiny_new_arch_dir
    if mode == "bfloat16":
        core = make_engine(path, dtype="bfloat16")
    else:
        core = make_engine(path, quantization=mode, quantization_group_size=32)
    model = core.backend.model
    kind = {"int8": Int8Linear, "int4": Int4Linear}.get(mode)
    quantized = {name for name, module in model.named_modules()
                 if kind is not None and isinstance(module, kind)}
    assert quantized == (set() if kind is None else set(layer_linears(model.config))), arch
    if model.config.moe is not None and kind is not None:
        # q/k/v + o in 3 layers; Qwen3-MoE: the dense layer's MLP and 4 experts
        # x 2 in two layers; Mixtral: 4 experts x 2 in all three
        dense = len(model.config.moe.dense_layers)
        assert len(quantized) == 3 * 2 + 2 * dense + (3 - dense) * 4 * 2
        assert model.layers[0].router.dtype == torch.float32
    ids = torch.randint(3, 512, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    got = _top1_along(core, ids)
    exact = _top1_along(make_engine(path), ids)
    bound = {"int8": 0.8, "int4": 0.25, "bfloat16": 0.8}[mode]
    assert sum(a == b for a, b in zip(got, exact)) >= bound * len(exact), arch


def test_int4_group_size_fits_dense_and_expert_layers():
    """The automatic int4 group divides every layer's widths: a Qwen3-MoE
    whose layer 0 has experts of 128 rows and layer 1 a dense MLP of 96."""
    from backends.config import ModelConfig, MoEConfig
    from backends.quantization.spec import QuantizationSpec, resolve_group_size
    config = ModelConfig("qwen3_moe", vocab_size=100, hidden_size=128, intermediate_size=96,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                         moe=MoEConfig(num_experts=4, experts_per_token=2,
                                       intermediate_size=128, dense_layers=(1,)))
    spec, why = resolve_group_size(QuantizationSpec("int4"), config)
    assert spec.group_size == 32 and "96" in why
