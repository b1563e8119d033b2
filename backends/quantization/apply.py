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
from backends.models.weight_spec import layer_linears, weight_spec
from backends.quantization import kernels
from backends.quantization.ggml import BlockInt8Linear, GGUFBlocks, q4_to_int4, q8_0_to_int8
from backends.quantization.int4 import Int4Linear, Int4Weights
from backends.quantization.int8 import Int8Linear
from backends.quantization.spec import QuantizationSpec, check_spec

log = logging.getLogger("baton.quantization")


def load_quantized(model: nn.Module, weights: Mapping[str, Any], spec: QuantizationSpec,
                   device: torch.device, dtype: torch.dtype) -> Counter:
    """Fill ``model`` (a DecoderLM built on the meta device) from ``weights``
    with its projections quantized per ``spec``. Returns how many projections
    became each module kind. Raises QuantizationError / ModelLoadError before
    any forward pass."""
    config: ModelConfig = model.config
    check_spec(spec, config)
    for kind in _kernels_needed(spec, weights):
        kernels.probe(kind, device, dtype)
    # The model's own checks (missing, misshapen, unused tensors), on meta.
    model.load_weights({name: _meta(t) for name, t in weights.items()},
                       torch.device("meta"), dtype)

    kinds: Counter = Counter()
    linears = layer_linears(config)
    for name, (weight, bias_spec) in linears.items():
        tensors = [weights[source] for source in weight.sources]
        bias = None
        if bias_spec is not None:
            bias = torch.cat([weights[source] for source in bias_spec.sources])
        module = _projection(spec, tensors, bias, device, dtype)
        kinds[type(module).__name__] += 1
        model.set_submodule(name, module)

    swapped = {t.path for pair in linears.values() for t in pair if t is not None}
    state = {}
    for tensor in weight_spec(config):
        if tensor.path not in swapped:
            parts = [weights[source] for source in tensor.sources]
            value = parts[0] if len(parts) == 1 else torch.cat(parts)
            state[tensor.path] = value.to(device=device, dtype=dtype).contiguous()
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    left = [name for name, t in chain(model.named_parameters(), model.named_buffers())
            if t.is_meta]
    if left:  # DecoderLM grew a tensor the weight spec does not list
        raise ModelLoadError(f"quantized load left tensors unset: {left[:5]}")
    log.info("quantization %s: projections as %s", spec.describe(),
             ", ".join(f"{n} x{c}" for n, c in sorted(kinds.items())))
    return kinds


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (tied tensors once)."""
    seen: dict[int, int] = {}
    opaque = 0
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
                device: torch.device, dtype: torch.dtype) -> nn.Module:
    if spec.mode == "int8":
        return Int8Linear.from_float(torch.cat([_dense(t) for t in tensors]), bias, device, dtype)
    if spec.mode == "int4":
        return Int4Linear.from_float(torch.cat([_dense(t) for t in tensors]), bias,
                                     spec.group_size, device, dtype)
    return _gguf_projection(tensors, bias, device, dtype)


def _gguf_projection(tensors: list[Any], bias: torch.Tensor | None, device: torch.device,
                     dtype: torch.dtype) -> nn.Module:
    """Parts of one fused module share a kernel only if they share a family;
    a mix (say Q4_K q with Q8_0 v, or F16 beside Q4_0) runs dense."""
    types = {t.ggml_type if isinstance(t, GGUFBlocks) else "dense" for t in tensors}
    if types <= {"Q4_0", "Q4_1"}:
        return Int4Linear(Int4Weights.cat([q4_to_int4(t) for t in tensors]), bias,
                          device, dtype)
    if types == {"Q8_0"}:
        codes, scales = zip(*(q8_0_to_int8(t) for t in tensors))
        return BlockInt8Linear(torch.cat(codes).to(device), torch.cat(scales).to(device),
                               None if bias is None else bias.to(device=device, dtype=dtype))
    weight = torch.cat([_dense(t) for t in tensors]).to(device=device, dtype=dtype)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    return linear
