"""The execution plan is a pure function: a table of machines and requests
against the plan each one must get. Numerics never depend on what happens to
be available (a compiler, oneDNN); implementations do."""

from __future__ import annotations

import pytest

from backends.execution import (Availability, CpuFeatures, ExecutionError, ExecutionOptions,
                                make_plan)

AVX2 = CpuFeatures(avx2=True)
AVX512 = CpuFeatures(avx2=True, avx512=True)
AMX = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, amx_bf16=True)
ZEN4 = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True)  # AVX512_BF16, no AMX
ALL = Availability(native_kernels=frozenset({"portable", "avx2", "avx512", "avx512_bf16"}),
                   onednn_dtypes=frozenset({"float32", "bfloat16"}))
F32_ONEDNN = Availability(native_kernels=ALL.native_kernels, onednn_dtypes=frozenset({"float32"}))
NO_CC = Availability(onednn_dtypes=frozenset({"float32"}), reason="no C compiler")
OFF = ExecutionOptions(fast_paths=False)

# (id, device, dtype, quantization, cpu, available, options) ->
#   (activation, weights, kv, linear, lm_head, kernels, decode attention, few rows)
TABLE = [
    ("avx2-f32", "cpu", "float32", "none", AVX2, F32_ONEDNN, ExecutionOptions(),
     ("float32", "float32", "float32", "onednn", "onednn", "avx2", "native", 0)),
    ("avx2-bf16", "cpu", "bfloat16", "none", AVX2, F32_ONEDNN, ExecutionOptions(),
     ("float32", "bfloat16", "bfloat16", "bf16-gemv+onednn", "bf16-gemv+onednn", "avx2",
      "native", 4)),
    ("avx2-bf16-no-compiler", "cpu", "bfloat16", "none", AVX2, NO_CC, ExecutionOptions(),
     ("float32", "bfloat16", "bfloat16", "onednn-f32-copy", "onednn", None, "torch-sdpa", 0)),
    ("avx2-bf16-fast-paths-off", "cpu", "bfloat16", "none", AVX2, ALL, OFF,
     ("float32", "bfloat16", "bfloat16", "torch", "torch", None, "torch-sdpa", 0)),
    # Native bf16: the bf16 gemv for a few rows, oneDNN's bf16 linears
    # (AMX) for batches.
    ("amx-bf16", "cpu", "bfloat16", "none", AMX, ALL, ExecutionOptions(),
     ("bfloat16", "bfloat16", "bfloat16", "bf16-gemv+onednn", "bf16-gemv+onednn",
      "avx512_bf16", "native", 4)),
    ("amx-bf16-no-compiler", "cpu", "bfloat16", "none", AMX,
     Availability(onednn_dtypes=frozenset({"float32", "bfloat16"}), reason="no C compiler"),
     ExecutionOptions(),
     ("bfloat16", "bfloat16", "bfloat16", "onednn", "onednn", None, "torch-sdpa", 0)),
    ("amx-bf16-fast-paths-off", "cpu", "bfloat16", "none", AMX, ALL, OFF,
     ("bfloat16", "bfloat16", "bfloat16", "torch", "torch", None, "torch-sdpa", 0)),
    ("amx-bf16-tensor-parallel", "cpu", "bfloat16", "none", AMX, ALL,
     ExecutionOptions(tensor_parallel_size=2),
     ("bfloat16", "bfloat16", "bfloat16", "bf16-gemv+onednn", "bf16-gemv+onednn",
      "avx512_bf16", "native", 4)),
    ("amx-bf16-no-onednn-bf16", "cpu", "bfloat16", "none", AMX, F32_ONEDNN, ExecutionOptions(),
     ("bfloat16", "bfloat16", "bfloat16", "torch", "torch", "avx512_bf16", "native", 0)),
    ("amx-f16", "cpu", "float16", "none", AMX, ALL, ExecutionOptions(),
     ("float16", "float16", "float16", "torch", "torch", None, "torch-sdpa", 0)),
    ("amx-f32", "cpu", "float32", "none", AMX, ALL, ExecutionOptions(),
     ("float32", "float32", "float32", "onednn", "onednn", "avx512_bf16", "native", 0)),
    ("amx-bf16-forced-avx2", "cpu", "bfloat16", "none", AMX, ALL,
     ExecutionOptions(cpu_kind="avx2"),
     ("float32", "bfloat16", "bfloat16", "bf16-gemv+onednn", "bf16-gemv+onednn", "avx2",
      "native", 4)),
    ("avx512-bf16", "cpu", "bfloat16", "none", AVX512, F32_ONEDNN, ExecutionOptions(),
     ("float32", "bfloat16", "bfloat16", "bf16-gemv+onednn", "bf16-gemv+onednn", "avx512",
      "native", 4)),
    ("amx-forced-portable", "cpu", "float32", "none", AMX, ALL,
     ExecutionOptions(cpu_kind="portable"),
     ("float32", "float32", "float32", "onednn", "onednn", "portable", "native", 0)),
    ("avx2-int8", "cpu", "float32", "int8", AVX2, F32_ONEDNN, ExecutionOptions(),
     ("float32", "float32", "float32", "int8", "torch", "avx2", "native", 0)),
    # Quantized without native bf16: the projections keep their codes, the
    # rest is held in bf16 (the output layer on the gemv's tiles) with
    # float32 arithmetic; float32 asked for, float32 everything.
    ("avx2-gguf-bf16", "cpu", "bfloat16", "gguf", AVX2, F32_ONEDNN, ExecutionOptions(),
     ("float32", "bfloat16", "bfloat16", "gguf", "bf16-gemv+torch", "avx2", "native", 0)),
    ("avx2-gguf-f32", "cpu", "float32", "gguf", AVX2, F32_ONEDNN, ExecutionOptions(),
     ("float32", "float32", "float32", "gguf", "torch", "avx2", "native", 0)),
    ("avx512-int4-bf16-no-compiler", "cpu", "bfloat16", "int4", AVX512, NO_CC,
     ExecutionOptions(),
     ("float32", "bfloat16", "bfloat16", "int4", "torch", None, "torch-sdpa", 0)),
    # Native bf16 without AMX: a 4-bit model takes the bf16-weights mode
    # (float32 rows for the native 4-bit kernel); unquantized, bf16 rows.
    ("avx512bf16-gguf-bf16", "cpu", "bfloat16", "gguf", ZEN4, ALL, ExecutionOptions(),
     ("float32", "bfloat16", "bfloat16", "gguf", "bf16-gemv+torch", "avx512_bf16", "native",
      0)),
    ("avx512bf16-bf16", "cpu", "bfloat16", "none", ZEN4, ALL, ExecutionOptions(),
     ("bfloat16", "bfloat16", "bfloat16", "bf16-gemv+onednn", "bf16-gemv+onednn",
      "avx512_bf16", "native", 4)),
    ("amx-gguf-bf16", "cpu", "bfloat16", "gguf", AMX, ALL, ExecutionOptions(),
     ("bfloat16", "bfloat16", "bfloat16", "gguf", "bf16-gemv+torch", "avx512_bf16", "native",
      0)),
    ("cuda-bf16", "cuda", "bfloat16", "none", CpuFeatures(), Availability(), ExecutionOptions(),
     ("bfloat16", "bfloat16", "bfloat16", "torch", "torch", None, "torch-sdpa", 0)),
    ("cuda-int4", "cuda:1", "bfloat16", "int4", AMX, ALL, ExecutionOptions(),
     ("bfloat16", "bfloat16", "bfloat16", "int4", "torch", None, "torch-sdpa", 0)),
]


@pytest.mark.parametrize("case", TABLE, ids=[row[0] for row in TABLE])
def test_plan_table(case):
    _id, device, dtype, quant, cpu, available, options, expected = case
    plan = make_plan(device, dtype, quant, cpu, available, options)
    got = (plan.activation_dtype, plan.weight_dtype, plan.kv_dtype, plan.linear, plan.lm_head,
           plan.kernels, plan.decode_attention, plan.few_rows)
    assert got == expected
    # The native ops come and go together; the plan never mixes their dtypes.
    native = plan.kernels is not None
    assert {plan.norm, plan.rope_kv_store, plan.activation} == {
        "native" if native else "torch"}
    line = plan.describe()
    assert "\n" not in line and dtype in line and plan.linear in line


@pytest.mark.parametrize("quant", ["int4", "gguf", "int8"])
def test_4bit_projections_of_float32_rows_go_native_without_native_bf16(quant):
    """torch's int4 kernel computes in bf16, which a CPU without it emulates:
    there (AVX2, AVX-512, and a native-bf16 CPU capped to them) float32 rows
    take the native 4-bit kernel; elsewhere, and without native kernels,
    torch's kernel runs, and int8 always does. Asking for bfloat16 there
    gets float32 rows on bf16 weights, so the native kernel too, with its
    rows rounded to int8 blocks (the bf16-weights mode's numerics); so does
    an AVX512_BF16 CPU without AMX (its one-row steps faster so), float32
    or bfloat16 asked for."""
    four_bit = quant != "int8"

    def native(cpu, available=F32_ONEDNN, options=ExecutionOptions(), dtype="float32"):
        plan = make_plan("cpu", dtype, quant, cpu, available, options)
        assert ("4-bit native" in plan.describe()) == bool(plan.int4_linear)
        # float32 asked for: float32 arithmetic; bf16 weights: 8-bit rows
        assert plan.int4_linear in ("", "native" if dtype == "float32" else "native-q8")
        assert ("8-bit rows" in plan.describe()) == (plan.int4_linear == "native-q8")
        return bool(plan.int4_linear)

    assert native(AVX2) == native(AVX512) == four_bit
    assert native(AMX, ALL, ExecutionOptions(cpu_kind="avx2")) == four_bit
    assert not native(AMX, ALL)                      # native bf16: torch's kernel in bf16
    assert native(AVX2, dtype="bfloat16") == four_bit  # bf16 weights, float32 rows
    assert not native(AMX, ALL, dtype="bfloat16")    # bf16 rows: torch's kernel
    assert native(ZEN4, ALL) == four_bit             # no AMX: the native kernel
    assert native(ZEN4, ALL, dtype="bfloat16") == four_bit
    assert not native(ZEN4, NO_CC, dtype="bfloat16")
    assert not native(AVX2, NO_CC)                   # no native kernels
    assert not native(AVX2, ALL, OFF)
    assert not native(AMX, ALL, ExecutionOptions(cpu_kind="portable"))


def test_a_gguf_q8_0_output_layer_runs_on_its_codes_with_8bit_rows():
    """Where the 4-bit projections take 8-bit rows (gguf, bf16 weights,
    native kernels without native bf16 or without AMX), a Q8_0 output layer
    runs on the native kernel's int8 weights; any other format, float32
    asked for, an AMX CPU, no native kernels, or tensor parallelism keep the
    dense head."""
    def head(cpu=AVX2, available=F32_ONEDNN, dtype="bfloat16", fmt="Q8_0", quant="gguf",
             options=ExecutionOptions()):
        return make_plan("cpu", dtype, quant, cpu, available, options,
                         output_format=fmt).lm_head

    assert head() == "q8_0-native"
    assert head(AVX512) == "q8_0-native"
    assert head(AMX, ALL, options=ExecutionOptions(cpu_kind="avx2")) == "q8_0-native"
    assert head(fmt="F16") == head(fmt="") == head(fmt="Q6_K") == "bf16-gemv+torch"
    assert head(dtype="float32") == "torch"
    assert head(AMX, ALL) == "bf16-gemv+torch"                  # bf16 rows
    assert head(ZEN4, ALL) == "q8_0-native"                     # no AMX: 8-bit rows
    assert head(available=NO_CC) == "torch"                     # no native kernels
    assert head(quant="int4") == "bf16-gemv+torch"              # not a GGUF's blocks
    assert head(options=ExecutionOptions(tensor_parallel_size=2)) != "q8_0-native"


@pytest.mark.parametrize("quant", ["none", "gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("cpu", [AVX2, AVX512, ZEN4, AMX],
                         ids=["avx2", "avx512", "avx512_bf16", "amx"])
def test_numerics_do_not_depend_on_what_is_available(dtype, cpu, quant):
    """A compiler, oneDNN or the fast-path switch change implementations, never
    the dtypes values are computed and stored in."""
    plans = [make_plan("cpu", dtype, quant, cpu, available, options)
             for available in (ALL, F32_ONEDNN, NO_CC, Availability())
             for options in (ExecutionOptions(), OFF)]
    numerics = {(p.activation_dtype, p.weight_dtype, p.kv_dtype) for p in plans}
    assert len(numerics) == 1, numerics


def test_a_kind_the_cpu_lacks_is_refused():
    with pytest.raises(ExecutionError, match="cannot run the avx512_bf16 path"):
        make_plan("cpu", "float32", "none", AVX2, ALL, ExecutionOptions(cpu_kind="avx512_bf16"))
    with pytest.raises(ExecutionError, match="unknown CPU kind"):
        ExecutionOptions(cpu_kind="sse9")


def test_cpu_kinds_nest():
    assert AMX.kinds == ("portable", "avx2", "avx512", "avx512_bf16")
    assert AVX2.kinds == ("portable", "avx2")
    assert AMX.limited_to("avx2") == AVX2
    assert not AMX.limited_to("avx512").native_bf16 and AMX.native_bf16
    assert CpuFeatures().kind == "portable"


@pytest.mark.parametrize("isa, kind, amx", [
    ("ALL", "avx512_bf16", True),
    ("AVX512_CORE_AMX", "avx512_bf16", True),
    ("avx10_1_512_amx", "avx512_bf16", True),
    ("AVX512_CORE_FP16", "avx512_bf16", False),
    ("AVX512_CORE_BF16", "avx512_bf16", False),
    ("AVX512_CORE", "avx512", False),
    ("AVX2", "avx2", False),
])
def test_a_onednn_cap_plans_as_the_machine_it_names(monkeypatch, isa, kind, amx):
    """ONEDNN_MAX_CPU_ISA below AMX plans as an AVX-512 BF16 CPU without AMX
    tiles would (an EPYC of that kind): Baton's tile kernels step down with
    oneDNN's, so a capped AMX Xeon measures and tests that kind."""
    import torch
    flags = {"avx2": True, "fma3": True, "avx512_f": True, "avx512_bw": True,
             "avx512_vl": True, "avx512_dq": True, "avx512_bf16": True,
             "amx_bf16": True, "amx_tile": True}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    cpu = CpuFeatures.detect()
    assert (cpu.kind, cpu.amx_bf16) == (kind, amx)
    assert CpuFeatures.detect(capped=False).amx_bf16


def test_detected_features_match_the_cpu_flags():
    """torch's cpuinfo and /proc/cpuinfo agree on what this CPU offers."""
    from pathlib import Path
    cpu = CpuFeatures.detect()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                  if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("/proc/cpuinfo lists no x86 flags")
    assert cpu.avx2 == ({"avx2", "fma"} <= flags)
    assert cpu.avx512 == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)
    assert cpu.avx512_bf16 == (cpu.avx512 and "avx512_bf16" in flags)
    assert cpu.amx_bf16 == ({"amx_bf16", "amx_tile"} <= flags)


# ------------------------------------------------- architecture options

def _model(**options):
    from backends.config import ModelConfig
    return ModelConfig(architecture="test", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, **options)


def test_a_plain_model_gets_the_plain_plan():
    for cpu, dtype in ((AVX2, "bfloat16"), (AMX, "float32")):
        assert (make_plan("cpu", dtype, "none", cpu, ALL, model=_model(qk_norm=True))
                == make_plan("cpu", dtype, "none", cpu, ALL))


def test_what_native_kernels_cannot_do_goes_to_torch():
    """Gemma 2's options on the AVX2 bf16 plan (native everything): the
    numerics stay, each step the kernels lack moves to torch,
    and the plan says why."""
    from backends.config import FULL_ATTENTION, SLIDING_ATTENTION
    plain = make_plan("cpu", "bfloat16", "none", AVX2, F32_ONEDNN)
    gemma = make_plan("cpu", "bfloat16", "none", AVX2, F32_ONEDNN, model=_model(
        layer_types=(SLIDING_ATTENTION, FULL_ATTENTION), sliding_window=8,
        attn_logit_softcap=50.0, hidden_act="gelu_tanh", sandwich_norms=True))
    assert (gemma.activation_dtype, gemma.weight_dtype, gemma.kv_dtype, gemma.linear) == (
        plain.activation_dtype, plain.weight_dtype, plain.kv_dtype, plain.linear)
    assert (gemma.norm, gemma.rope_kv_store, gemma.decode_attention) == ("native",) * 3
    assert (gemma.activation, gemma.mlp_activation) == ("torch", "gelu_tanh")
    assert (gemma.sliding_attention, gemma.softcap_attention) == ("torch-sdpa", "torch-eager")
    assert gemma.torch_decode_masks and not plain.torch_decode_masks
    line = gemma.describe()
    for words in ("gelu_tanh torch", "sliding-window attention torch-sdpa",
                  "soft-capped attention torch-eager"):
        assert words in line


def test_partial_rotary_and_experts():
    phi = make_plan("cpu", "float32", "none", AMX, ALL, model=_model(rotary_dim=12))
    assert (phi.rope_kv_store, phi.norm, phi.activation) == ("torch", "native", "native")
    from backends.config import MoEConfig
    moe_model = _model(moe=MoEConfig(
        num_experts=4, experts_per_token=2, intermediate_size=32))
    moe = make_plan("cuda", "bfloat16", "none", AMX, ALL, model=moe_model)
    assert moe.moe == "torch-grouped" and "experts torch-grouped" in moe.describe()
    # Without native kernels nothing needs moving, and nothing is noted.
    torch_only = make_plan("cpu", "float32", "none", AMX, ALL, OFF, model=_model(rotary_dim=12))
    assert torch_only.rope_kv_store == "torch" and not torch_only.notes
