"""What to quantize and how: the mode, the int4 group size, and the checks
that refuse an impossible combination before any weight is touched.

Pure Python (no torch): service/ builds a QuantizationSpec from CLI flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from backends.config import ModelConfig
from backends.errors import ModelLoadError
from backends.models.weight_spec import layer_linears

MODES = ("none", "int8", "int4", "gguf")
GROUP_SIZES = (32, 64, 128)
# None: the largest of GROUP_SIZES that divides every projection's input
# width (resolve_group_size says which and why).
DEFAULT_GROUP_SIZE = None
# GGUF block types the gguf mode keeps quantized in memory: the 4-bit ones as
# int4 groups of 32 for torch's int4 kernel, Q8_0 as block-scaled int8.
# Every other type is dequantized, and the load log says so and why.
GGUF_KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
GGUF_BLOCK = 32  # elements per Q8_0 / Q4_0 / Q4_1 block, and per Q4_K sub-block
# 4-bit GGUF types whose weights already lie on a grid of groups of 32.
GGUF_4BIT_G32 = ("Q4_0", "Q4_1", "Q4_K")
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})


class QuantizationError(ModelLoadError):
    """A quantization mode cannot run this model as asked (a group size that
    does not divide a layer's input width, gguf on a non-GGUF model, a torch
    build without the kernel). Raised while loading, before any forward."""


@dataclass(frozen=True, slots=True)
class QuantizationSpec:
    """``mode``: none, int8 (per output channel), int4 (groups of
    ``group_size`` along the input dimension) or gguf (keep a GGUF file's
    Q8_0 / Q4_0 / Q4_1 blocks). ``group_size`` only matters for int4."""

    mode: str = "none"
    group_size: int | None = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise QuantizationError(
                f"unknown quantization {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise QuantizationError(
                f"quantization group size must be one of "
                f"{', '.join(map(str, GROUP_SIZES))}, got {self.group_size}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def describe(self) -> str:
        if self.mode != "int4":
            return self.mode
        return f"int4 (group {self.group_size or 'auto'})"


def gguf_block_types() -> frozenset[str]:
    """Every GGML tensor type that is blocks rather than plain numbers: what
    the loader hands the gguf mode undecoded, so it can say what each became."""
    from gguf import GGMLQuantizationType
    return frozenset(t.name for t in GGMLQuantizationType) - _FLOAT_TYPES


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each kind of linear module of the
    decoder layers (the weight spec's names less the layer, e.g. "qkv_proj",
    "experts.0.down_proj"): every layer's, as a mixture of experts may keep
    dense MLPs in some layers (Qwen3-MoE's ``mlp_only_layers``)."""
    return {weight.linear.partition(".")[2].partition(".")[2]: weight.shape
            for weight, _bias in layer_linears(config).values()}


def projection_formats(source_formats: Mapping[str, str]) -> frozenset[str]:
    """The storage formats (GGML type names) of a file's projection weights,
    from ``LoadedModel.source_formats``."""
    return frozenset(fmt for name, fmt in source_formats.items() if name.endswith("_proj.weight"))


def output_format(source_formats: Mapping[str, str], tied: bool) -> str:
    """The storage format (GGML type name) of a file's output layer (a tied
    model's embedding), or "" where it is plain numbers."""
    return source_formats.get("model.embed_tokens.weight" if tied else "lm_head.weight", "")


def resolve_group_size(spec: QuantizationSpec, config: ModelConfig,
                       source_formats: frozenset[str] = frozenset()) -> tuple[QuantizationSpec, str]:
    """``spec`` with an int4 group size chosen when it has none, and why.

    The rule: the largest of 128, 64, 32 that divides every projection's
    input width. One exception: projections that already are 4-bit groups of
    32 (``source_formats``, a GGUF's Q4_0 / Q4_1 / Q4_K) stay on their own
    grid, group 32, where requantizing finds the same 16 levels again;
    groups of 64 would put two of the file's groups on one grid (on the
    embedded SmolLM2 that takes perplexity from 20.3 to 32.0,
    docs/quantization.md)."""
    if spec.mode != "int4" or spec.group_size is not None:
        return spec, ""
    widths = sorted({k for _n, k in projection_shapes(config).values()})
    fits = [g for g in sorted(GROUP_SIZES, reverse=True) if all(k % g == 0 for k in widths)]
    if not fits:
        raise QuantizationError(
            f"no int4 group size ({', '.join(map(str, GROUP_SIZES))}) divides the "
            f"projections' input widths ({', '.join(map(str, widths))}); use int8")
    width_text = " and ".join(map(str, widths))
    already = sorted(source_formats & set(GGUF_4BIT_G32))
    if already and 32 in fits and fits[0] != 32:
        why = (f"int4 group size 32: the projections already are {'/'.join(already)}, "
               f"4-bit in groups of 32, and stay on that grid (group {fits[0]}, the "
               f"largest that divides {width_text}, would requantize them coarser; "
               f"--quantization-group-size {fits[0]} forces it, --quantization gguf "
               f"keeps the file's blocks as they are)")
        return QuantizationSpec("int4", 32), why
    why = (f"int4 group size {fits[0]}: the largest of "
           f"{', '.join(map(str, sorted(GROUP_SIZES, reverse=True)))} that divides the "
           f"projections' input widths ({width_text})")
    return QuantizationSpec("int4", fits[0]), why


def check_spec(spec: QuantizationSpec, config: ModelConfig) -> None:
    """Raise QuantizationError if ``spec`` cannot apply to ``config``'s shapes."""
    if spec.mode != "int4" or spec.group_size is None:
        return
    widths = {name: k for name, (_n, k) in projection_shapes(config).items()}
    bad = {name: k for name, k in widths.items() if k % spec.group_size}
    if bad:
        fits = [g for g in GROUP_SIZES if all(k % g == 0 for k in widths.values())]
        hint = (f"use --quantization-group-size {' or '.join(map(str, fits))}" if fits
                else "no supported group size divides them; use int8")
        listed = ", ".join(f"{name} ({k})" for name, k in bad.items())
        raise QuantizationError(
            f"int4 group size {spec.group_size} does not divide the input width of "
            f"{listed}; {hint}")
