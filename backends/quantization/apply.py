"""Load a DecoderLM with quantized projections: a transform of the Hugging
Face-named weights plus a swap of each layer's four linear modules.

The model file never learns of it. Its own ``load_weights`` first checks names
and shapes on the meta device (nothing is copied); then the decoder layers'
linear modules the weight spec lists (q/k/v fused, o, gate/up fused, down)
become quantized modules built part by part, and every other tensor
(embedding, norms, lm_head, the q/k/v bias of unquantized layers) is placed in
the serving dtype where the spec puts it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn

from backends.config import ModelConfig
from backends.errors import ModelLoadError
from backends.models.weight_spec import assemble, layer_linears, weight_spec
from backends.quantization import kernels
from backends.quantization.ggml import (INT4_TYPES, BlockInt8Linear, GGUFBlocks, q4_to_int4,
                                        q8_0_to_int8)
from backends.quantization.int4 import Int4Linear, Int4Weights
from backends.quantization.int8 import Int8Linear
from backends.quantization.spec import (QuantizationError, QuantizationSpec, check_spec,
                                        resolve_group_size)

log = logging.getLogger("baton.quantization")


def load_quantized(model: nn.Module, weights: Mapping[str, Any], spec: QuantizationSpec,
                   device: torch.device, dtype: torch.dtype,
                   int4_native: str | None = None,
                   weight_dtype: torch.dtype | None = None, int4_q8: bool = False,
                   output_q8: bool = False) -> Counter:
    """Fill ``model`` (a DecoderLM built on the meta device) from ``weights``
    with its projections quantized per ``spec``. ``int4_native``: the native
    kernels' kind that runs the 4-bit projections (float32 activations; the
    plan's ``int4_linear``), or None for torch's int4 kernel; ``int4_q8``:
    that kernel rounds rows to int8 blocks (plan ``native-q8``), and runs a
    gguf load's Q8_0 projections on their codes too; ``output_q8``: the
    output layer as well, from the file's Q8_0 blocks (plan ``lm_head
    q8_0-native``; the embedding lookup keeps its dense copy).
    ``weight_dtype``: what every tensor outside the quantized codes (the
    embedding, output layer, norms, biases, projections a GGUF file holds
    in a layout without a kernel) is rounded to before it is held in
    ``dtype`` (bfloat16 in the bf16-weights mode of CPUs without native
    bf16); None: ``dtype``. Returns how many projections became each module
    kind. Raises QuantizationError / ModelLoadError before any forward
    pass."""
    config: ModelConfig = model.config
    spec, why = resolve_group_size(spec, config)
    if why:
        log.info(why)
    check_spec(spec, config)
    for kind in _kernels_needed(spec, weights):
        if not (kind == "int4" and int4_native):
            kernels.probe(kind, device, dtype)
    # The model's own checks (missing, misshapen, unused tensors), on meta.
    model.load_weights({name: _meta(t) for name, t in weights.items()},
                       torch.device("meta"), dtype)

    kinds: Counter = Counter()
    outcomes: Counter = Counter()  # gguf: what each kind of projection became
    linears = layer_linears(config)
    for name, (weight, bias_spec) in linears.items():
        tensors = [weights[source] for source in weight.sources]
        bias = None
        if bias_spec is not None:
            bias = torch.cat([weights[source] for source in bias_spec.sources])
            bias = bias if weight_dtype is None else bias.to(weight_dtype)
        if spec.mode == "gguf":
            module, outcome = _gguf_projection(tensors, bias, device, dtype, int4_native,
                                               weight_dtype, int4_q8)
            outcomes[outcome] += 1
        else:
            module = _projection(spec, tensors, bias, device, dtype, int4_native, int4_q8)
        kinds[type(module).__name__] += 1
        model.set_submodule(name, module)

    swapped = {t.path for pair in linears.values() for t in pair if t is not None}
    state = {}
    for tensor in weight_spec(config):
        if tensor.path not in swapped:
            value = assemble(tensor, [_dense(weights[source]) for source in tensor.sources])
            value = value if weight_dtype is None else value.to(weight_dtype)
            state[tensor.path] = value.to(device=device, dtype=dtype).contiguous()
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if output_q8:
        head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
        if not (isinstance(head, GGUFBlocks) and head.ggml_type == "Q8_0"):
            raise QuantizationError("the plan runs a Q8_0 output layer, but the file's is not")
        codes, scales = q8_0_to_int8(head)
        model.lm_head = BlockInt8Linear(codes.to(device), scales.to(device), None, int4_native)
        log.info("gguf: output layer Q8_0 kept as int8 codes for the native %s kernel's "
                 "8-bit rows (exact; %.0f MB)", int4_native,
                 (codes.numel() + 2 * scales.numel()) / 1e6)
    left = [name for name, t in chain(model.named_parameters(), model.named_buffers())
            if t.is_meta]
    if left:  # DecoderLM grew a tensor the weight spec does not list
        raise ModelLoadError(f"quantized load left tensors unset: {left[:5]}")
    log.info("quantization %s: projections as %s", spec.describe(),
             ", ".join(f"{n} x{c}" for n, c in sorted(kinds.items())))
    for outcome, count in sorted(outcomes.items()):
        log.info("gguf: %d projection(s) %s", count, outcome)
    return kinds


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (tied tensors once),
    and by oneDNN-packed weights (backends.linear.PackedWeight)."""
    seen: dict[int, int] = {}
    opaque = sum(m.packed.nbytes for m in model.modules()
                 if hasattr(getattr(m, "packed", None), "nbytes"))
    for t in chain(model.parameters(), model.buffers()):
        if t.is_meta:
            continue
        if t.is_mkldnn:  # oneDNN-packed: no strided storage to ask
            opaque += t.numel() * t.element_size()
            continue
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return opaque + sum(seen.values())


# ------------------------------------------------------------------ pieces
def _kernels_needed(spec: QuantizationSpec, weights: Mapping[str, Any]) -> set[str]:
    if spec.mode in ("int8", "int4"):
        return {spec.mode}
    if any(isinstance(t, GGUFBlocks) and t.ggml_type.startswith("Q4") for t in weights.values()):
        return {"int4"}
    return set()


def _meta(t: Any) -> torch.Tensor:
    if isinstance(t, GGUFBlocks):
        return torch.empty(t.shape, device="meta")
    return t.to("meta")


def _dense(t: Any) -> torch.Tensor:
    return t.dequantize() if isinstance(t, GGUFBlocks) else t


def _projection(spec: QuantizationSpec, tensors: list[Any], bias: torch.Tensor | None,
                device: torch.device, dtype: torch.dtype, int4_native: str | None,
                int4_q8: bool = False) -> nn.Module:
    """An int8 or int4 projection quantized from the float weights (gguf mode
    keeps the file's blocks: _gguf_projection)."""
    if spec.mode == "int8":
        return Int8Linear.from_float(torch.cat([_dense(t) for t in tensors]), bias, device, dtype)
    return Int4Linear.from_float(torch.cat([_dense(t) for t in tensors]), bias,
                                 spec.group_size, device, dtype, int4_native, int4_q8)


# What torch lacks for the GGUF types the gguf mode dequantizes.
_NO_KERNEL = {"Q5_0": "5-bit", "Q5_1": "5-bit", "Q5_K": "5-bit", "Q6_K": "6-bit",
              "Q2_K": "2-bit", "Q3_K": "3-bit"}


def _gguf_projection(tensors: list[Any], bias: torch.Tensor | None, device: torch.device,
                     dtype: torch.dtype, int4_native: str | None = None,
                     weight_dtype: torch.dtype | None = None,
                     int4_q8: bool = False) -> tuple[nn.Module, str]:
    """The module for one (possibly fused) projection of a gguf-mode load,
    and what it became, for the load log. Parts of one fused module share a
    kernel only if they share a family; a mix (say Q5_0 q with Q8_0 v, or F16
    beside Q4_0) runs dense."""
    types = {t.ggml_type if isinstance(t, GGUFBlocks) else "unquantized" for t in tensors}
    named = "+".join(sorted(types))
    if types <= INT4_TYPES:
        module = Int4Linear(Int4Weights.cat([q4_to_int4(t) for t in tensors]), bias,
                            device, dtype, int4_native, int4_q8)
        if int4_native:
            rows = "rows rounded to int8 blocks of 32" if int4_q8 else "float32 arithmetic"
            return module, (f"{named} kept as int4 groups of 32 for the native {int4_native} "
                            f"int4 kernel (codes exact; scales and minimums in "
                            f"{str(module.scales.dtype).removeprefix('torch.')}; {rows})")
        return module, (f"{named} kept as int4 groups of 32 for torch's int4 kernel (codes "
                        f"exact; scales and zeros in {module.scales_and_zeros.dtype})")
    if types == {"Q8_0"}:
        codes, scales = zip(*(q8_0_to_int8(t) for t in tensors))
        native = int4_native if int4_q8 else None
        module = BlockInt8Linear(torch.cat(codes).to(device), torch.cat(scales).to(device),
                                 None if bias is None else bias.to(device=device, dtype=dtype),
                                 native)
        if native:
            return module, (f"Q8_0 kept as int8 codes with a scale per 32 for the native "
                            f"{native} kernel (exact; rows rounded to int8 blocks of 32)")
        return module, ("Q8_0 kept as int8 codes with an fp16 scale per 32 (exact; torch has "
                        "no block-scaled int8 kernel, so each call expands them)")
    weight = torch.cat([_dense(t) for t in tensors])
    weight = weight.to(device=device, dtype=weight_dtype or dtype).to(dtype)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    name = str(dtype).removeprefix("torch.")
    if weight_dtype not in (None, dtype):
        name = f"{str(weight_dtype).removeprefix('torch.')} values in {name}"
    if types == {"unquantized"}:
        return linear, f"unquantized in the file, held in {name}"
    lacking = sorted(types - INT4_TYPES - {"Q8_0", "unquantized"})
    if not lacking:
        return linear, (f"{named} dequantized to {name}: the parts of one fused module "
                        f"differ in type, and one kernel takes one layout")
    widths = sorted({_NO_KERNEL.get(t, f"{t}-layout") for t in lacking})
    return linear, (f"{named} dequantized to {name}: torch has no kernel for "
                    f"{' or '.join(widths)} weights")
