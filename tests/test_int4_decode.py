"""The native int4 gemv (backends/kernels/gemv_q4.c) and the whole-step
decode of int4 weights (``--quantization gguf`` on a Q4 file, ``int4``):
bit-identical to torch's int4 kernel (what Int4Linear runs), each CPU kind
forced where it runs; the plan says when it runs and why not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from backends import kernels as native
from backends.execution import (CPU_KINDS, Availability, CpuFeatures, ExecutionOptions,
                                make_plan)
from backends.factory import BackendConfig, create_backend
from backends.loader import load_model
from backends.loader.gguf import load_gguf
from backends.quantization import QuantizationSpec, gguf_block_types, resident_weight_bytes
from backends.quantization.int4 import Int4Linear, int4_panels, quantize_int4
from tests.test_cpu_kernels import _assert_whole_step_matches_layers
from tests.test_cpu_kernels import _kind_or_skip as _cpu_kind_or_skip
from tests.test_gguf_loader import llama_cpp_permute, tiny_llama_writer, write_typed_tensors

ROOT = Path(__file__).resolve().parents[1]
CPU = CpuFeatures.detect()
FORM = native.torch_int4_form()


def _kind_or_skip(kind: str) -> str:
    _cpu_kind_or_skip(kind)
    if FORM is None:
        pytest.skip(f"torch's int4 kernel runs at capability "
                    f"{torch.backends.cpu.get_cpu_capability()}: no native int4 gemv "
                    "reproduces its rounding")
    return kind


@pytest.fixture(scope="module", params=CPU_KINDS)
def kind(request) -> str:
    return _kind_or_skip(request.param)


# ------------------------------------------------------------------ the gemv
SHAPES = [(96, 64, 32), (37, 128, 32), (200, 256, 64), (130, 96, 32)]


def _gemv_cases(gen: torch.Generator):
    for n, k, group in SHAPES:
        weights = quantize_int4(torch.randn(n, k, generator=gen), group, torch.bfloat16)
        for bias in (None, torch.randn(n, generator=gen).to(torch.bfloat16)):
            linear = Int4Linear(weights, bias, torch.device("cpu"), torch.bfloat16)
            for rows in (1, 2, 3, 4):
                x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
                yield (n, k, group, bias, rows), linear, int4_panels(weights), x


def test_int4_gemv_is_bit_identical_to_torch_s_int4_kernel(kind):
    """Every kind's build (the portable one with fmaf) against Int4Linear
    with bf16 activations: N not a multiple of the 64-row panel, groups of
    32 and 64, with and without bias (added after the bf16 rounding)."""
    gemv = native.GemvQ4(kind, FORM)
    for case, linear, panels, x in _gemv_cases(torch.Generator().manual_seed(3)):
        n, k, group, bias, rows = case
        assert torch.equal(gemv(x, panels, n, group, bias), linear(x)), case


_FORM1_SCRIPT = """
import torch
from backends import kernels as native
from tests.test_int4_decode import _gemv_cases
assert native.torch_int4_form() == 1, native.torch_int4_form()
for kind in {kinds!r}:
    gemv = native.GemvQ4(kind, 1)
    for case, linear, panels, x in _gemv_cases(torch.Generator().manual_seed(4)):
        n, k, group, bias, rows = case
        assert torch.equal(gemv(x, panels, n, group, bias), linear(x)), (kind, case)
print("ok")
"""


def test_int4_gemv_reproduces_torch_s_avx2_rounding_too():
    """torch's int4 kernel at its AVX2 capability dequantizes as
    fma(q, s, fma(s, -8, z)), not fma(q - 8, s, z): with torch forced to AVX2
    (ATEN_CPU_CAPABILITY), every kind's form-1 gemv matches it bit for bit."""
    if not CPU.avx2:
        pytest.skip(f"this CPU ({CPU.describe()}) has no AVX2: torch never runs its "
                    "AVX2 int4 kernel here")
    kinds = [k for k in CPU.kinds if native.available(k)[0]]
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _FORM1_SCRIPT.format(kinds=kinds)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_int4_gemv_checks_its_inputs(kind):
    gemv = native.GemvQ4(kind, FORM)
    weights = quantize_int4(torch.randn(64, 64), 32, torch.bfloat16)
    panels = int4_panels(weights)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 rows"):
        gemv(x.float(), panels, 64, 32)
    with pytest.raises(ValueError, match="do not hold"):
        gemv(x, panels, 64, 64)
    with pytest.raises(RuntimeError, match="refused 5 rows"):
        gemv(torch.zeros(5, 64, dtype=torch.bfloat16), panels, 64, 32)


# ------------------------------------------------------------------ the plan
NATIVE = Availability(native_kernels=frozenset(CPU_KINDS), onednn_dtypes=frozenset(
    {"float32", "bfloat16"}))
XEON = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, amx_bf16=True)
EPYC_AVX2 = CpuFeatures(avx2=True)


@pytest.mark.parametrize("cpu,dtype", [(XEON, "bfloat16"), (EPYC_AVX2, "float32")])
def test_plan_streams_int4_panels_for_4bit_gguf_files_and_int4(cpu, dtype):
    plan = make_plan("cpu", dtype, "gguf", cpu, NATIVE, weight_formats=frozenset({"Q4_1"}))
    assert (plan.linear, plan.whole_step_decode, plan.whole_step_weights) == ("gguf", 4, "int4")
    # bf16 activations: the output projection's bf16 tiles for a few rows;
    # float32 ones keep the float32 (unrounded) weight in F.linear
    assert plan.lm_head == ("bf16-gemv+torch" if dtype == "bfloat16" else "torch")
    assert "quantization gguf (Q4_1)" in plan.describe()
    assert "whole-step decode <= 4 rows of int4 panels" in plan.describe()
    mixed = make_plan("cpu", dtype, "gguf", cpu, NATIVE,
                      weight_formats=frozenset({"Q4_0", "Q4_K", "Q4_1"}))
    assert mixed.whole_step_decode == 4
    int4 = make_plan("cpu", dtype, "int4", cpu, NATIVE)
    assert (int4.whole_step_decode, int4.whole_step_weights) == (4, "int4")


def test_plan_says_why_a_gguf_file_gets_no_whole_step_decode():
    plan = make_plan("cpu", "bfloat16", "gguf", XEON, NATIVE,
                     weight_formats=frozenset({"Q4_1", "Q6_K"}))
    assert plan.whole_step_decode == 0
    assert "no whole-step decode (projections Q4_1+Q6_K are not all 4-bit groups)" \
        in plan.describe()
    scalar = Availability(native_kernels=NATIVE.native_kernels,
                          onednn_dtypes=NATIVE.onednn_dtypes, torch_int4="default")
    plan = make_plan("cpu", "bfloat16", "gguf", XEON, scalar,
                     weight_formats=frozenset({"Q4_1"}))
    assert plan.whole_step_decode == 0
    assert "torch's int4 kernel at capability default" in plan.describe()
    for opts in (ExecutionOptions(fast_paths=False), ExecutionOptions(tensor_parallel_size=2)):
        available = NATIVE if opts.fast_paths else Availability()
        assert make_plan("cpu", "bfloat16", "gguf", XEON, available, opts,
                         weight_formats=frozenset({"Q4_1"})).whole_step_decode == 0
    assert make_plan("cpu", "bfloat16", "int8", XEON, NATIVE).whole_step_decode == 0


# ------------------------------------------------------- the whole-step decode
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 96, 6, 2, 16, 160, 2


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory) -> Path:
    """Llama, every projection Q4_1 (as the embedded SmolLM2 file), widths
    that are not multiples of the 64-row panel, Q8_0 embedding tied to the
    output."""
    from tests.test_gguf_loader import TINY_TOKENS
    rng = np.random.default_rng(11)
    vocab = len(TINY_TOKENS)

    def r(*shape, norm=False):
        noise = 0.3 * rng.standard_normal(shape, dtype=np.float32)
        return (1.0 + noise if norm else noise).astype(np.float32)

    path = tmp_path_factory.mktemp("q4-gguf") / "tiny.Q4_1.gguf"
    writer = tiny_llama_writer(path, "tiny-q4", hidden=HIDDEN, ffn=FFN, heads=HEADS,
                               kv_heads=KV_HEADS, layers=LAYERS)
    tensors = {"token_embd.weight": (r(vocab, HIDDEN), T.Q8_0),
               "output_norm.weight": (r(HIDDEN, norm=True), T.F32)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        tensors |= {
            p + "attn_norm.weight": (r(HIDDEN, norm=True), T.F32),
            p + "ffn_norm.weight": (r(HIDDEN, norm=True), T.F32),
            p + "attn_q.weight": (llama_cpp_permute(r(HEADS * HEAD_DIM, HIDDEN), HEADS), T.Q4_1),
            p + "attn_k.weight": (llama_cpp_permute(r(KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS),
                                  T.Q4_1),
            p + "attn_v.weight": (r(KV_HEADS * HEAD_DIM, HIDDEN), T.Q4_1),
            p + "attn_output.weight": (r(HIDDEN, HEADS * HEAD_DIM), T.Q4_1),
            p + "ffn_gate.weight": (r(FFN, HIDDEN), T.Q4_1),
            p + "ffn_up.weight": (r(FFN, HIDDEN), T.Q4_1),
            p + "ffn_down.weight": (r(HIDDEN, FFN), T.Q4_1)}
    write_typed_tensors(writer, tensors)
    return path


def _quantized_backend(path: Path, mode: str, dtype: str, fast_paths: bool = True):
    if mode == "gguf":
        loaded = load_gguf(path, dtype=getattr(torch, dtype), keep_quantized=gguf_block_types())
        spec = QuantizationSpec("gguf")
    else:
        loaded = load_model(path, dtype=getattr(torch, dtype))
        spec = QuantizationSpec("int4", 32)
    return create_backend(loaded, BackendConfig(
        dtype=dtype, block_size=4, num_kv_blocks=64, quantization=spec,
        execution=ExecutionOptions(fast_paths=fast_paths)))


CASES = [("gguf", "q4_gguf", "bfloat16"), ("gguf", "q4_gguf", "float32"),
         ("int4", "tiny_qwen2_dir", "bfloat16"), ("int4", "tiny_qwen3_dir", "float32")]


@pytest.mark.parametrize("mode,fixture,dtype", CASES)
def test_int4_whole_step_decode_agrees_with_its_layer_path(kind, request, mode, fixture,
                                                           dtype):
    """Up to four decode rows as one native call that streams int4 panels
    (each kind's build forced) against the same plan layer by layer (torch's
    int4 kernel): the same greedy tokens and logprobs. The projections are
    bit-identical; in bf16 the rest rounds where the layers round. A Q4_1
    GGUF (llama, Q8_0 tied embedding) and int4 (qwen2: q/k/v bias added
    after the rounding; qwen3: q/k norms), in bf16 and float32 activations."""
    path = request.getfixturevalue(fixture)
    fast = _quantized_backend(path, mode, dtype)
    plan = fast.plan
    assert (plan.quantization, plan.whole_step_decode, plan.whole_step_weights) == (
        mode, 4, "int4"), plan.describe()
    layered = _quantized_backend(path, mode, dtype)
    # float32 activations too: the int4 kernel rounds its input and output to
    # bf16, so a last-bit difference of a float32 norm can move a logprob by a
    # bf16 step (seen: 0.002); the helper allows 0.01.
    _assert_whole_step_matches_layers(fast, layered, kind, seed=23, vocab_hi=250)


def test_int4_panels_cost_what_the_int4_weights_cost(q4_gguf, caplog):
    """The whole-step decode's panels are a second copy of the int4
    projections, no bigger than torch's (codes, bf16 scale and zero per group
    of 32, plus rows padded to 64); the load log says what it streams."""
    caplog.set_level("INFO")
    fast = _quantized_backend(q4_gguf, "gguf", "bfloat16")
    if not fast.plan.whole_step_decode:
        pytest.skip(f"no whole-step decode on this machine: {fast.plan.describe()}")
    assert "streams the layers' int4 panels (groups of 32" in caplog.text
    panels = torch_copy = 0
    for layer in fast.model.layers:
        for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            assert isinstance(m, Int4Linear)
            panels += m.panels.numel()
            torch_copy += m.weight.numel() * m.weight.element_size() \
                + m.scales_and_zeros.numel() * m.scales_and_zeros.element_size()
            rows = -(-m.out_features // 64) * 64
            assert m.panels.numel() == rows * m.in_features // 2 + rows * m.in_features // 32 * 4
    assert panels <= 1.5 * torch_copy
    # the output projection's one extra copy is its tiles: F.linear for more
    # than four rows uses the tied embedding itself
    head = fast.model.lm_head
    assert type(head).__name__ == "TiledHeadLinear"
    assert head.weight.data_ptr() == fast.model.embed_tokens.weight.data_ptr()
    layered = _quantized_backend(q4_gguf, "gguf", "bfloat16", fast_paths=False)
    assert layered.plan.whole_step_decode == 0  # no native kernels: no panels
    assert all(m.panels is None for layer in layered.model.layers
               for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
    assert resident_weight_bytes(fast.model) > resident_weight_bytes(layered.model)
