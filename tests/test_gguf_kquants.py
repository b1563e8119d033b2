"""GGUF K-quants and the int4 group size.

- Q4_K becomes torch's int4 format with groups of 32 exactly (the file's
  codes; scale d*sc exact in float32; zero 8*scale - dmin*m one float32
  rounding away), and the CPU kernel then computes with scales and zeros
  rounded to bfloat16 and nothing worse: what is exact and what is not, as
  docs/quantization.md states it.
- The gguf mode keeps Q4_K projections as int4, dequantizes Q5_0 / Q6_K (no
  kernel) and mixed fused modules, and says so in the load log.
- --quantization int4 without a group size picks the largest that divides
  every projection, or 32 where the projections already are 4-bit groups
  of 32 (the embedded model: test_quantization.py runs it there), and says
  which.
"""

from __future__ import annotations

import logging
import zlib

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from backends.config import ModelConfig
from backends.interface import SamplingParams
from backends.quantization import QuantizationSpec, resident_weight_bytes, resolve_group_size
from backends.quantization.ggml import GGUFBlocks, q4_to_int4
from backends.quantization.int4 import Int4Linear
from tests.engine_helpers import make_engine, run_all
from tests.test_gguf_dequant import random_blocks
from tests.test_gguf_loader import TINY_TOKENS, tiny_llama_writer

BF16_UNIT = 2.0 ** -8  # bfloat16 rounds to nearest within this relative error


def small_q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks with small d and dmin, as a trained model's are."""
    data = random_blocks(T.Q4_K, rows, cols, seed).reshape(-1, 144)
    rng = np.random.default_rng(seed)
    for at in (0, 2):
        values = rng.uniform(2e-4, 1e-3, data.shape[0]).astype(np.float16)
        data[:, at:at + 2] = values.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def _gguf_matrix(data: np.ndarray, kind: T, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf_dequantize(data, kind), np.float32)
                            .reshape(rows, cols))


def test_q4_k_becomes_int4_groups_of_32_exactly():
    rows, cols = 6, 512
    data = small_q4_k(rows, cols, seed=1)
    weights = q4_to_int4(GGUFBlocks(torch.from_numpy(data), "Q4_K", (rows, cols)))
    assert weights.group_size == 32 and weights.scales.shape == (rows, cols // 32)
    raw = data.reshape(rows, 2, 144)
    # codes: per 64 weights, the low nibbles of 32 bytes, then their high nibbles
    qs = raw[..., 16:].reshape(rows, 2, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, cols)
    assert np.array_equal(weights.codes().numpy(), codes)
    exact = _gguf_matrix(data, T.Q4_K, rows, cols)
    torch.testing.assert_close(weights.dequantize(), exact, rtol=0, atol=2e-7)


def test_the_cpu_kernel_rounds_scales_and_zeros_to_bfloat16_and_nothing_else():
    rows, cols = 32, 512
    data = small_q4_k(rows, cols, seed=2)
    weights = q4_to_int4(GGUFBlocks(torch.from_numpy(data), "Q4_K", (rows, cols)))
    module = Int4Linear(weights, None, torch.device("cpu"), torch.float32)
    assert module.scales_and_zeros.dtype == torch.bfloat16
    # What the kernel is given: scales and zeros rounded to bfloat16.
    s = weights.scales.to(torch.bfloat16).float().repeat_interleave(32, dim=1)
    z = weights.zeros.to(torch.bfloat16).float().repeat_interleave(32, dim=1)
    q = weights.codes().float()
    given = (q - 8) * s + z
    exact = _gguf_matrix(data, T.Q4_K, rows, cols)
    # The rounding bound, weight by weight: 2^-8 of |s|(q-8) and of |z|.
    bound = BF16_UNIT * ((q - 8).abs() * weights.scales.abs().repeat_interleave(32, 1)
                               + weights.zeros.abs().repeat_interleave(32, 1)) + 1e-7
    assert ((given - exact).abs() <= bound).all()
    assert (given != exact).any()  # not bit-exact: bf16 has 8 significant bits
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y = module(x.float())
    # ... and beyond that rounding the kernel adds only float32 accumulation
    # and the bfloat16 rounding of its output.
    ref = x.float() @ given.T
    assert ((y - ref).abs() <= 2 * BF16_UNIT * ref.abs() + 1e-4 * ref.abs().max()).all()


# ----------------------------------------------------- a K-quant tiny model
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 4, 2, 64, 512
VOCAB = len(TINY_TOKENS)


def _block_data(kind: T, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == T.Q4_K:
        return small_q4_k(rows, cols, seed)
    if kind == T.Q6_K:
        data = random_blocks(kind, rows, cols, seed).reshape(-1, 210)
        data[:, 192:208] = rng.integers(-6, 7, (data.shape[0], 16)).astype(np.int8).view(np.uint8)
        data[:, 208:210] = rng.uniform(5e-4, 2e-3, data.shape[0]).astype(np.float16) \
            .view(np.uint8).reshape(-1, 2)
        return data.reshape(rows, -1)
    array = (0.05 * rng.standard_normal((rows, cols))).astype(np.float32)
    return gguf.quants.quantize(array, kind)  # Q5_0, Q8_0


# layer 0: Q4_K everywhere but a Q6_K down; layer 1: Q5_0 beside a Q8_0 v,
# and a Q4_K down (llama.cpp's Q4_K_M mixes these).
KQUANT_TYPES = {
    "blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q4_K, "blk.0.attn_v.weight": T.Q4_K,
    "blk.0.attn_output.weight": T.Q4_K, "blk.0.ffn_gate.weight": T.Q4_K,
    "blk.0.ffn_up.weight": T.Q4_K, "blk.0.ffn_down.weight": T.Q6_K,
    "blk.1.attn_q.weight": T.Q5_0, "blk.1.attn_k.weight": T.Q5_0, "blk.1.attn_v.weight": T.Q8_0,
    "blk.1.attn_output.weight": T.Q5_0, "blk.1.ffn_gate.weight": T.Q5_0,
    "blk.1.ffn_up.weight": T.Q5_0, "blk.1.ffn_down.weight": T.Q4_K,
}
SHAPES = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("kquants") / "tiny-llama.Q4_K_M.gguf"
    writer = tiny_llama_writer(path, "tiny-kquants", hidden=HIDDEN, ffn=FFN, heads=HEADS,
                               kv_heads=KV_HEADS)
    writer.add_tensor("token_embd.weight",
                      (0.5 * rng.standard_normal((VOCAB, HIDDEN))).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
        for part, (rows, cols) in SHAPES.items():
            name = f"blk.{i}.{part}.weight"
            kind = KQUANT_TYPES[name]
            data = _block_data(kind, rows, cols, seed=zlib.crc32(name.encode()) % 1000)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_mode_keeps_q4_k_and_says_what_became_of_the_rest(kquant_gguf, caplog):
    none = make_engine(kquant_gguf, num_kv_blocks=16)
    with caplog.at_level(logging.INFO, logger="baton.quantization"):
        core = make_engine(kquant_gguf, num_kv_blocks=16, quantization="gguf")
    kinds = [[type(m).__name__ for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                         layer.down_proj)]
             for layer in core.backend.model.layers]
    assert kinds[0][:3] == ["Int4Linear"] * 3 and kinds[0][3] != "Int4Linear"
    assert kinds[1][:3] == [k for k in kinds[1][:3] if k != "Int4Linear"]
    assert kinds[1][3] == "Int4Linear"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "4 projection(s) Q4_K kept as int4 groups of 32" in text
    assert "Q6_K dequantized to float32: torch has no kernel for 6-bit weights" in text
    assert "Q5_0+Q8_0 dequantized to float32: torch has no kernel for 5-bit weights" in text
    assert "2 projection(s) Q5_0 dequantized to float32" in text
    assert resident_weight_bytes(core.backend.model) < resident_weight_bytes(none.backend.model)
    # Both run; the Q4_K layers compute in bfloat16 inside the kernel, so the
    # two agree closely on every next-token distribution.
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    got = {}
    for label, engine in (("none", none), ("gguf", core)):
        [result] = run_all(engine, {"p": prompt}, params).values()
        got[label] = result
    # Greedy picks the same token unless the float32 model's top two are a near
    # tie that the kernel's bfloat16 arithmetic may order either way: the token
    # the gguf engine picks must be one the float32 model ranks within 0.05 nats
    # of its best, and the two logprobs of that token must agree closely.
    ref, quant = got["none"].logprobs[0], got["gguf"].logprobs[0]
    ref_top = dict(ref.top)
    assert quant.token_id in ref_top, (quant.token_id, ref.top)
    assert ref.logprob - ref_top[quant.token_id] <= 0.05
    assert abs(quant.logprob - ref_top[quant.token_id]) <= 0.1


# ------------------------------------------------------------ int4 group size

def _config(hidden: int, intermediate: int, heads: int = 9, kv_heads: int = 3,
            head_dim: int = 64) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=100, hidden_size=hidden,
                       intermediate_size=intermediate, num_layers=1, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=64)


def test_int4_group_size_auto():
    auto = QuantizationSpec("int4")
    smollm2 = _config(576, 1536)  # 576 = 4.5 x 128
    spec, why = resolve_group_size(auto, smollm2)
    assert spec.group_size == 64
    assert "group size 64: the largest of 128, 64, 32" in why and "576 and 1536" in why
    spec, why = resolve_group_size(auto, smollm2, frozenset({"Q4_1", "Q8_0"}))
    assert spec.group_size == 32 and "already are Q4_1" in why
    assert "--quantization-group-size 64 forces it" in why
    assert resolve_group_size(auto, _config(4096, 11008, 32, 8, 128))[0].group_size == 128
    explicit = QuantizationSpec("int4", 64)
    assert resolve_group_size(explicit, smollm2, frozenset({"Q4_1"})) == (explicit, "")


def test_int4_without_a_group_size_runs_and_logs_its_choice(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO):
        core = make_engine(tiny_llama_dir, num_kv_blocks=16, quantization="int4")
    assert {layer.qkv_proj.group_size for layer in core.backend.model.layers} == {64}
    assert any("int4 group size 64: the largest" in r.getMessage() for r in caplog.records)
    [result] = run_all(core, {"a": [5, 6, 7]}, SamplingParams(max_tokens=3)).values()
    assert len(result.token_ids) == 3
