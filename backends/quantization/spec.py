"""What to quantize and how: the mode, the int4 group size, and the checks
that refuse an impossible combination before any weight is touched.

Pure Python (no torch): service/ builds a QuantizationSpec from CLI flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.config import ModelConfig
from backends.errors import ModelLoadError
from backends.models.weight_spec import layer_linears

MODES = ("none", "int8", "int4", "gguf")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128
# GGUF block types kept quantized in memory by the gguf mode; every other
# type is dequantized at load as in the default path.
GGUF_KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
GGUF_BLOCK = 32  # elements per Q8_0 / Q4_0 / Q4_1 block


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
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise QuantizationError(
                f"unknown quantization {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.group_size not in GROUP_SIZES:
            raise QuantizationError(
                f"quantization group size must be one of "
                f"{', '.join(map(str, GROUP_SIZES))}, got {self.group_size}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def describe(self) -> str:
        return f"int4 (group {self.group_size})" if self.mode == "int4" else self.mode


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear module of a decoder layer
    (the weight spec's, e.g. "qkv_proj")."""
    return {weight.linear.partition(".")[2].partition(".")[2]: weight.shape
            for weight, _bias in layer_linears(config).values()
            if weight.linear.startswith("layers.0.")}


def check_spec(spec: QuantizationSpec, config: ModelConfig) -> None:
    """Raise QuantizationError if ``spec`` cannot apply to ``config``'s shapes."""
    if spec.mode != "int4":
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
