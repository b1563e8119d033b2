"""How a model runs on this machine: one decision, made once, before loading.

``make_plan`` is a pure function of the device, the serving dtype, the
quantization, what the CPU can do and which kernels are available; the
backend builds the model's ops and linear layers from the ``ExecutionPlan``
it returns and logs ``plan.describe()`` in one line. Nothing else in the
backend chooses an implementation.

Two kinds of decision, kept apart on purpose:

* numerics (activation dtype, the dtype weights are rounded to, the KV
  cache dtype) depend only on the device, the dtype, the quantization and the
  CPU kind, never on whether a compiler or oneDNN happens to be present;
* implementations (native kernels of an ISA, oneDNN prepacked linears, the
  portable torch ops) depend on availability too. They change speed and the
  float summation order, nothing else.

A CPU *kind* names what the hand-written kernels may use: ``portable``
(plain C, any CPU), ``avx2`` (AVX2 + FMA), ``avx512`` (AVX-512 F/BW/VL/DQ),
``avx512_bf16`` (plus AVX512_BF16: native bfloat16 arithmetic). AMX is not a
kind: oneDNN uses it for bfloat16 matmuls when present, and the avx512_bf16
build has an AMX tile linear (``amx_linear_rows``) that the plan takes where
the CPU and the OS allow tile data: for every bf16 call of up to
``AMX_PREFILL_ROWS`` rows there (linear ``bf16-amx+onednn``: a row's result
independent of the rows beside it, so a prefix-cache hit computes what a
cold prefill does), oneDNN for larger calls (a burst's prefill-only step). A lower kind can be
forced (``ExecutionOptions.cpu_kind``) to run and test its path on a CPU that
could do more; a kind the CPU cannot run is refused.

The model's architecture options (backends/config.py) are the third input:
where a native kernel cannot compute what an architecture asks for
(sliding-window or soft-capped attention, GeGLU, partial rotary, a mixture of
experts), the plan gives that step the torch implementation and says so in a
note. The model never asks what is available.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from backends.config import ModelConfig
from backends.errors import ModelLoadError

CPU_KINDS = ("portable", "avx2", "avx512", "avx512_bf16")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
QUANTIZED_LINEARS = ("int8", "int4", "gguf")
# Rows the AMX tile linear (backends/kernels/amx_bf16.c) takes per call
# (linear bf16-amx+onednn): every call of up to AMX_PREFILL_ROWS rows,
# decode batches and prefill chunks alike. Measured against oneDNN's bf16
# linear on a model's worth of streamed weights (docs/benchmarks.md): ahead
# at 8-32 rows, even at 64, level or ahead up to 512 rows, 13-31% ahead at
# 640-1024 with its row-major order, level at 1536 and ~1.1x behind at 2048
# (a burst's prefill-only step), so oneDNN keeps the calls above 1024 rows,
# and its packed copy of the weights stays.
AMX_PREFILL_ROWS = 1024
# Rows a decode step may hold and still read the weights about once: the
# bf16 gemv's (GemvBf16.max_rows, kernels.h's BATON_GEMV_MAX_ROWS), and a c=32
# step where the linears run on AMX tiles. The speculative budget
# (ExecutionPlan.few_rows).
GEMV_ROWS = 4
AMX_FEW_ROWS = 32


class ExecutionError(ModelLoadError):
    """An execution option this machine cannot honour (a CPU kind it lacks,
    native kernels it cannot build)."""


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """What the CPU offers, as far as Baton's choices go."""

    avx2: bool = False          # with FMA
    avx512: bool = False        # F, BW, VL, DQ
    avx512_bf16: bool = False
    amx_bf16: bool = False

    @classmethod
    def detect(cls, capped: bool = True) -> CpuFeatures:
        """The CPU's features, as far as this process's torch and oneDNN will
        use them: ATEN_CPU_CAPABILITY=avx2 (or default) and a
        ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 cap them, and one below
        AMX (AVX512_CORE_BF16, AVX512_CORE_FP16) leaves no tiles, so a
        machine capped that way plans (and its tests run) as a lower one
        would.
        ``capped=False``: the hardware's own."""
        import torch
        try:
            caps = torch.cpu.get_capabilities()
        except (AttributeError, RuntimeError):  # older torch, or not x86
            return cls()
        avx512 = all(caps.get(k, False) for k in ("avx512_f", "avx512_bw", "avx512_vl",
                                                   "avx512_dq"))
        cpu = cls(avx2=bool(caps.get("avx2") and caps.get("fma3")), avx512=avx512,
                  avx512_bf16=avx512 and bool(caps.get("avx512_bf16")),
                  amx_bf16=bool(caps.get("amx_bf16") and caps.get("amx_tile")))
        if not capped:
            return cpu
        aten = torch.backends.cpu.get_cpu_capability().upper()
        if aten not in ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX"):
            cpu = cpu.limited_to("avx2" if aten == "AVX2" and cpu.avx2 else "portable")
        onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").strip().upper()
        if cpu.native_bf16 and not (onednn == "ALL" or onednn.startswith(
                ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10"))):
            cpu = cpu.limited_to("avx512" if onednn.startswith("AVX512") else "avx2")
        # oneDNN's ISAs with tiles name AMX (AVX512_CORE_AMX, AVX10_1_512_AMX,
        # ...): a cap below them is an AVX-512 BF16 CPU without tiles.
        if cpu.amx_bf16 and onednn != "ALL" and "AMX" not in onednn:
            cpu = replace(cpu, amx_bf16=False)
        return cpu

    @property
    def kind(self) -> str:
        """The highest CPU kind this CPU runs."""
        if self.avx512_bf16:
            return "avx512_bf16"
        if self.avx512:
            return "avx512"
        return "avx2" if self.avx2 else "portable"

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every kind this CPU can run, lowest first."""
        return CPU_KINDS[:CPU_KINDS.index(self.kind) + 1]

    def limited_to(self, kind: str) -> CpuFeatures:
        """These features as a CPU of ``kind`` would have them."""
        if kind not in CPU_KINDS:
            raise ExecutionError(f"unknown CPU kind {kind!r}; one of {', '.join(CPU_KINDS)}")
        if kind not in self.kinds:
            raise ExecutionError(
                f"this CPU cannot run the {kind} path (it offers up to {self.kind})")
        rank = CPU_KINDS.index(kind)
        return CpuFeatures(avx2=rank >= 1, avx512=rank >= 2, avx512_bf16=rank >= 3,
                           amx_bf16=self.amx_bf16 and rank >= 3)

    @property
    def native_bf16(self) -> bool:
        """bfloat16 arithmetic in hardware (else torch emulates it, several
        times slower than float32)."""
        return self.avx512_bf16 or self.amx_bf16

    def describe(self) -> str:
        return self.kind + ("+amx" if self.amx_bf16 else "")


@dataclass(frozen=True, slots=True)
class ExecutionOptions:
    """User-facing choices (``baton serve --cpu-kind``, ``--no-fast-paths``).

    ``fast_paths=False`` runs the portable torch ops everywhere (the
    reference path: no native kernels, no oneDNN prepacking). ``cpu_kind``
    forces a lower CPU kind than the one detected; "auto" takes the CPU's own.
    ``tensor_parallel_size`` > 1: the model is sharded over that many ranks
    (backends/parallel), which rules out paths that cannot all-reduce
    between layers.
    """

    fast_paths: bool = True
    cpu_kind: str = "auto"
    tensor_parallel_size: int = 1
    amx: bool = True  # False: oneDNN takes every batch the gemv does not (tests, benchmarks)
    # Token-row steps run the model's compiled forward
    # (backends/compiled_step.py) where the plan can: the default, the faster
    # step on every CPU kind, dtype and quantization measured
    # (docs/benchmarks.md); False (``--enforce-eager``, ``BATON_COMPILE=0``):
    # a start without the compile.
    compile: bool = True

    def __post_init__(self) -> None:
        if self.cpu_kind != "auto" and self.cpu_kind not in CPU_KINDS:
            raise ExecutionError(
                f"unknown CPU kind {self.cpu_kind!r}; one of auto, {', '.join(CPU_KINDS)}")


@dataclass(frozen=True, slots=True)
class Availability:
    """What this process can run, probed once by the caller: the kinds of
    native kernels that built and loaded, and the dtypes oneDNN runs a
    prepacked linear in."""

    native_kernels: frozenset[str] = frozenset()
    onednn_dtypes: frozenset[str] = frozenset()
    reason: str = ""  # why native kernels are missing, for the log
    amx_tiles: bool = False  # the avx512_bf16 kernels' AMX tile linear runs here
    # A C++ compiler for torch.compile's generated code (Inductor builds it
    # at run time; the native kernels may have been built elsewhere).
    cpp_compiler: bool = False


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Which implementation each part of the model gets, and in which dtypes.

    Numerics: ``activation_dtype`` (hidden states, the dtype of every
    non-linear op), ``weight_dtype`` (the values the weights are rounded to:
    "bfloat16" while activations are float32 is the bf16-weights mode of CPUs
    without native bf16), ``kv_dtype``. Implementations: see ``describe``.
    """

    device: str
    dtype: str
    activation_dtype: str
    weight_dtype: str
    kv_dtype: str
    cpu: str | None                  # the CPU kind the plan targets (None on CUDA)
    quantization: str
    linear: str                      # torch | onednn | bf16-gemv+onednn | bf16-amx+onednn | onednn-f32-copy | int8 | int4 | gguf
    lm_head: str                     # torch | onednn | bf16-gemv+onednn | bf16-amx+onednn | bf16-gemv+torch | q8_0-native
    kernels: str | None              # the native kernels' kind, None for the torch ops
    norm: str                        # native | torch
    rope_kv_store: str               # native | torch
    decode_attention: str            # native | torch-sdpa
    # Decode rows that share a cached prefix (backends/attention.py): "cascade"
    # (the prefix once for all of them through SDPA, merged with each row's
    # rest from the native kernel) or "none".
    shared_prefix_decode: str = "none"
    activation: str = "torch"        # act(gate)*up: native | torch
    # Max rows of the AMX tile linear (linear bf16-amx+onednn: every call of
    # 1 to this many rows); 0 off.
    amx_linear_rows: int = 0
    # The native decode attention's bf16 scores (bf16 query and KV): "amx"
    # (TDPBF16PS tiles, where the avx512_bf16 kernels run and AMX tile data
    # is granted; paged_attention.c decides the same at run time and keeps
    # VDPBF16PS for shapes the tiles do not take) or "" (the vector path).
    attention_scores: str = ""
    # The 4-bit projections (int4, gguf Q4_*) of float32 activations on a CPU
    # without native bf16: "native" (backends/kernels/int4_linear.c, float32
    # arithmetic on the decoded weights), "native-q8" (the same kernels'
    # 8-bit rows: the bf16-weights mode's numerics, as llama.cpp computes a
    # GGUF; a gguf load's Q8_0 projections then run on the same kernels'
    # int8 weights) or "" (torch's int4 kernel, bf16 activations).
    int4_linear: str = ""
    notes: tuple[str, ...] = field(default=())
    weight_formats: tuple[str, ...] = ()  # a GGUF's projection formats (GGML types)
    # What the architecture adds (see ModelConfig); "none" where it has none.
    mlp_activation: str = "silu"     # silu | gelu_tanh
    sliding_attention: str = "none"  # sliding-window layers, decode and prefill: torch-sdpa
    softcap_attention: str = "none"  # soft-capped layers: torch-eager
    moe: str = "none"                # expert dispatch: torch-grouped
    # How token-row steps (decodes, verification rows, short prefill chunks where
    # every layer's attention is the native decode kernel) run: "compiled"
    # (the model's forward under torch.compile, backends/compiled_step.py) or
    # "eager".
    step: str = "eager"

    @property
    def few_rows(self) -> int:
        """Rows a decode step's linears take at about one row's cost (the
        weights read once): the AMX tile linear's AMX_FEW_ROWS, the bf16
        gemv's 4; 0 where neither runs."""
        if self.amx_linear_rows:
            return AMX_FEW_ROWS
        return GEMV_ROWS if self.linear == "bf16-gemv+onednn" else 0

    @property
    def torch_decode_masks(self) -> bool:
        """Whether some layer's decode attention reads the gathered-blocks
        masks (any layer not on the native decode kernel)."""
        return self.decode_attention != "native" or self.softcap_attention != "none"

    @property
    def bf16_weights(self) -> bool:
        return self.weight_dtype == "bfloat16" and self.activation_dtype == "float32"

    def describe(self) -> str:
        """The plan in one log line."""
        numerics = f"{self.activation_dtype} activations"
        if self.weight_dtype != self.activation_dtype:
            numerics += f", {self.weight_dtype} weights"
        numerics += f", {self.kv_dtype} KV"
        where = self.device + (f" ({self.cpu})" if self.cpu else "")
        kernels = f"native {self.kernels}" if self.kernels else "none"
        linear = self.linear + {"native": " (4-bit native)",
                                "native-q8": " (4-bit native, 8-bit rows)"}.get(self.int4_linear, "")
        parts = [f"{self.dtype} on {where}: {numerics}",
                 f"linear {linear}", f"lm_head {self.lm_head}",
                 f"kernels {kernels}", f"norm {self.norm}", f"rope+kv {self.rope_kv_store}",
                 f"decode attention {self.decode_attention}"
                 + (f" ({self.attention_scores} scores)" if self.attention_scores else ""),
                 f"{self.mlp_activation} {self.activation}"]
        if self.sliding_attention != "none":
            parts.append(f"sliding-window attention {self.sliding_attention}")
        if self.softcap_attention != "none":
            parts.append(f"soft-capped attention {self.softcap_attention}")
        if self.shared_prefix_decode != "none":
            parts.append(f"shared-prefix decode {self.shared_prefix_decode}")
        if self.moe != "none":
            parts.append(f"experts {self.moe}")
        parts.append(f"decode steps {self.step}")
        if self.amx_linear_rows:
            parts.append(f"amx-tile linear <= {self.amx_linear_rows} rows")
        if self.quantization != "none":
            formats = f" ({'+'.join(self.weight_formats)})" if self.weight_formats else ""
            parts.insert(1, f"quantization {self.quantization}{formats}")
        return "; ".join(parts + list(self.notes))


@dataclass(frozen=True, slots=True)
class _ModelNeeds:
    """What of an architecture decides implementations (None: a plain
    Llama / Qwen decoder)."""

    activation: str = "silu"
    sliding: bool = False
    softcap: bool = False
    partial_rotary: bool = False
    moe: bool = False
    final_softcap: bool = False  # logits soft-capped after the output projection
    head_dim: int = 64

    @classmethod
    def of(cls, model: ModelConfig | None) -> _ModelNeeds:
        if model is None:
            return cls()
        m = model
        partial = m.rotary_width != m.head_dim
        softcap = m.attn_logit_softcap is not None
        return cls(activation=m.hidden_act, sliding=m.has_sliding_layers, softcap=softcap,
                   partial_rotary=partial, moe=m.moe is not None,
                   final_softcap=m.final_logit_softcap is not None, head_dim=m.head_dim)

    def apply(self, plan: ExecutionPlan) -> ExecutionPlan:
        """``plan`` (made for a plain model) with the steps native kernels
        cannot do for this architecture moved to torch, and why."""
        notes = list(plan.notes)
        changes: dict = dict(mlp_activation=self.activation,
                             sliding_attention="torch-sdpa" if self.sliding else "none",
                             softcap_attention="torch-eager" if self.softcap else "none",
                             moe="torch-grouped" if self.moe else "none")
        if plan.kernels is not None:
            if self.activation != "silu":
                changes["activation"] = "torch"
                notes.append(f"{self.activation} on torch (the native kernel is silu)")
            if self.partial_rotary:
                changes["rope_kv_store"] = "torch"
                notes.append("rope+kv on torch (the native kernel rotates whole heads)")
            if self.sliding:
                notes.append("sliding-window layers on torch-sdpa (the native decode kernel "
                             "attends whole contexts)")
            if self.softcap:
                notes.append("soft-capped layers on torch-eager (no native soft-capping)")
        if plan.step == "compiled" and (self.sliding or self.softcap or self.moe):
            changes["step"] = "eager"
            what = ("sliding-window" if self.sliding else "soft-capped" if self.softcap
                    else "mixture-of-experts")
            notes.append(f"decode steps eager (the compiled step has no {what} layers)")
        return replace(plan, notes=tuple(notes), **changes)


def make_plan(device: str, dtype: str, quantization: str, cpu: CpuFeatures,
              available: Availability, options: ExecutionOptions = ExecutionOptions(),
              model: ModelConfig | None = None,
              weight_formats: frozenset[str] = frozenset(),
              output_format: str = "") -> ExecutionPlan:
    """Decide how to run: pure, so a table of inputs -> plans is testable.

    ``dtype`` is resolved already (no "auto"); ``cpu`` is the detected CPU
    (``options.cpu_kind`` limits it here). ``model``: the architecture to run
    (None plans for a plain Llama / Qwen decoder). ``weight_formats``: the
    GGML types of a GGUF file's projections (gguf quantization);
    ``output_format``: its output layer's ("" where plain numbers).
    """
    return _ModelNeeds.of(model).apply(
        _plain_plan(device, dtype, quantization, cpu, available, options, weight_formats,
                    output_format))


def _plain_plan(device: str, dtype: str, quantization: str, cpu: CpuFeatures,
                available: Availability, options: ExecutionOptions,
                weight_formats: frozenset[str] = frozenset(),
                output_format: str = "") -> ExecutionPlan:
    if dtype not in DTYPE_NAMES:
        raise ExecutionError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    if not device.startswith("cpu"):
        return ExecutionPlan(
            device=device, dtype=dtype, activation_dtype=dtype, weight_dtype=dtype,
            kv_dtype=dtype, cpu=None, quantization=quantization,
            linear=quantization if quantization in QUANTIZED_LINEARS else "torch",
            lm_head="torch", kernels=None, norm="torch", rope_kv_store="torch",
            decode_attention="torch-sdpa")
    if options.cpu_kind != "auto":
        cpu = cpu.limited_to(options.cpu_kind)
    quantized = quantization in QUANTIZED_LINEARS

    # Numerics: bfloat16 on a CPU without bf16 arithmetic keeps the bf16
    # weights and KV cache and computes in float32 (as llama.cpp does there);
    # torch would otherwise emulate every bf16 op, several times slower.
    # Quantized projections keep their codes; the rest of the model (the
    # embedding and output layer above all) is what is held in bf16.
    # A 4-bit model streams its codes: where there are no AMX tiles, the
    # native 4-bit kernel on float32 rows (rounded to int8 blocks) beats
    # torch's int4 kernel in bf16, so bfloat16 there takes the same
    # bf16-weights mode (Zen 4 EPYC, --quantization gguf: a one-row step
    # 1.2x as fast, median of eight pairs; 32 rows level in four of five
    # pairs; docs/benchmarks.md). AMX CPUs keep
    # bf16 activations (not measured this way). Numerics never depend on
    # what is available, so without native kernels too.
    int4_f32 = quantization in ("int4", "gguf") and cpu.native_bf16 and not cpu.amx_bf16
    bf16_weights = dtype == "bfloat16" and (not cpu.native_bf16 or int4_f32)
    activation = "float32" if bf16_weights else dtype
    kv = "bfloat16" if bf16_weights else activation

    fast = options.fast_paths
    kernels = cpu.kind if fast and cpu.kind in available.native_kernels else None
    # The native kernels take float32 or bfloat16 activations (computing in
    # float32 and rounding once per fused step) and a float32 or bf16 cache.
    native = kernels is not None and activation in ("float32", "bfloat16")
    onednn = fast and activation in available.onednn_dtypes
    if quantized:
        linear = quantization
    elif bf16_weights:
        linear = ("bf16-gemv+onednn" if native and onednn else
                  "onednn-f32-copy" if onednn else "torch")
    elif activation == "bfloat16" and native and onednn:
        # Native bf16: oneDNN's bf16 kernels (AMX where present) for batches,
        # the tiled bf16 gemv for a few rows (a second copy of the weights:
        # oneDNN's packed layout is opaque, and its kernels are slower than
        # the gemv at one row).
        linear = "bf16-gemv+onednn"
    else:
        linear = "onednn" if onednn else "torch"
    # The packed output projection is a second copy of the (often tied)
    # embedding: twice as fast, but quantized serving is about memory: no
    # oneDNN copy. With bf16 weights and native kernels, the gemv's bf16
    # tiles for a few rows (SmolLM2's output projection, 57 MB, is as many
    # bytes as its int4 layers, and the gemv streams it 2-4x faster than
    # torch's one-row matmul in bf16 or float32) and the weight itself (the
    # tied embedding) for more: one extra copy, the tiles.
    if quantized and native and (activation == "bfloat16" or bf16_weights):
        lm_head = "bf16-gemv+torch"
    elif quantized or not onednn:
        lm_head = "torch"
    else:
        lm_head = "bf16-gemv+onednn" if linear == "bf16-gemv+onednn" else "onednn"
    notes = []
    if fast and kernels is None and available.reason:
        notes.append(f"no native kernels: {available.reason}")
    # Decode batches above the gemv's rows: the AMX tile linear on the same
    # tiles (bf16 activations only; same rounding as oneDNN's bf16 linear).
    amx_rows = (AMX_PREFILL_ROWS if native and linear == "bf16-gemv+onednn"
                and activation == "bfloat16" and cpu.amx_bf16
                and kernels == "avx512_bf16" and available.amx_tiles and options.amx else 0)
    # On AMX the tile linear takes prefill chunks too (up to
    # AMX_PREFILL_ROWS rows a call), off the same tiles, and the gemv's few
    # rows: a row's bits then never depend on how many rows share its call
    # (oneDNN's bf16 linear sums a row in another order at other row counts;
    # the gemv's order is its own), so a prefix-cache hit that recomputes a
    # prompt's tail computes what the cold prefill did, wherever the cold
    # prefill's step held up to AMX_PREFILL_ROWS tokens.
    if amx_rows:
        linear = lm_head = "bf16-amx+onednn"
    # Decode scores and prefill chunks' attention on AMX tiles: bf16 query
    # and KV where the avx512_bf16 kernels run and tile data is granted.
    amx_attention = (native and kernels == "avx512_bf16" and cpu.amx_bf16
                     and available.amx_tiles and kv == "bfloat16" and activation == "bfloat16")
    # torch's int4 kernel is fast in bf16 only; without native bf16 it
    # emulates it: float32 rows take the native 4-bit kernel there, and on
    # an AVX512_BF16 CPU without AMX (above). In the
    # bf16-weights mode (auto) it rounds each block of 32 of a row to int8
    # and multiplies in integers (VPMADDUBSW: 1.5-2x the float32 decoding at
    # one row, AVX2 EPYC); --dtype float32 keeps float32 arithmetic.
    int4_native = (quantization in ("int4", "gguf") and native and activation == "float32"
                   and kernels in ("avx2", "avx512", "avx512_bf16") and not cpu.amx_bf16)
    # With 8-bit rows, a GGUF's Q8_0 output layer runs on its own codes too
    # (the same kernel's int8 weights: 30 MB a step for SmolLM2 against the
    # 57 MB of bf16 tiles).
    if (int4_native and bf16_weights and quantization == "gguf" and output_format == "Q8_0"
            and options.tensor_parallel_size == 1):
        lm_head = "q8_0-native"
    step = "eager"
    if options.compile and native:
        if available.cpp_compiler:
            step = "compiled"
        else:
            notes.append("decode steps eager (no C++ compiler for torch.compile)")
    if options.tensor_parallel_size > 1:
        notes.append(f"tensor parallel over {options.tensor_parallel_size} ranks"
                     + (" (decode steps eager)" if step == "compiled" else ""))
        step = "eager"
    return ExecutionPlan(
        device=device, dtype=dtype, activation_dtype=activation,
        weight_dtype="bfloat16" if bf16_weights else activation, kv_dtype=kv,
        cpu=cpu.describe(), quantization=quantization, linear=linear, lm_head=lm_head,
        kernels=kernels if native else None,
        norm="native" if native else "torch",
        rope_kv_store="native" if native else "torch",
        decode_attention="native" if native else "torch-sdpa",
        shared_prefix_decode="cascade" if native else "none",
        activation="native" if native else "torch",
        weight_formats=tuple(sorted(weight_formats)) if quantization == "gguf" else (),
        amx_linear_rows=amx_rows,
        attention_scores="amx" if amx_attention else "",
        int4_linear=("native-q8" if bf16_weights else "native") if int4_native else "",
        step=step, notes=tuple(notes))
