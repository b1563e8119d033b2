"""Load a DecoderLM with quantized projections: a transform of the Hugging
Face-named weights plus a swap of each layer's four linear modules.

The model file never learns of it. Its own ``load_weights`` first checks names
and shapes on the meta device (nothing is copied); then the projections
(q/k/v fused, o, gate/up fused, down) become quantized modules built part by
part, and every other tensor (embedding, norms, lm_head, q/k/v bias) is placed
in the serving dtype exactly where ``load_weights`` would put it.
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
from backends.quantization import kernels
from backends.quantization.ggml import BlockInt8Linear, GGUFBlocks, q4_to_int4, q8_0_to_int8
from backends.quantization.int4 import Int4Linear, Int4Weights
from backends.quantization.int8 import Int8Linear
from backends.quantization.spec import QuantizationSpec, check_spec

log = logging.getLogger("baton.quantization")

# Module of each decoder layer -> the Hugging Face projections fused into it,
# in DecoderLM.load_weights' order.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


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
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        for module_name, parts in PROJECTIONS.items():
            tensors = [weights[f"{prefix}{part}.weight"] for part in parts]
            bias = None
            if module_name == "qkv_proj" and config.attention_bias:
                bias = torch.cat([weights[f"{prefix}{part}.bias"] for part in parts])
            module = _projection(spec, tensors, bias, device, dtype)
            kinds[type(module).__name__] += 1
            setattr(layer, module_name, module)

    state = {path: weights[name].to(device=device, dtype=dtype).contiguous()
             for path, name in _plain_tensor_names(config).items()}
    model.load_state_dict(state, strict=False, assign=True)
    left = [name for name, t in chain(model.named_parameters(), model.named_buffers())
            if t.is_meta]
    if left:  # DecoderLM grew a tensor this loader does not know of
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


def _plain_tensor_names(config: ModelConfig) -> dict[str, str]:
    """Model state-dict name -> Hugging Face name of every tensor outside the
    projections, as DecoderLM.load_weights places them. The check for meta
    tensors left behind catches any drift from it."""
    names = {"embed_tokens.weight": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head"] = "lm_head.weight"
    for i in range(config.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        names[p + "input_norm"] = h + "input_layernorm.weight"
        names[p + "post_attention_norm"] = h + "post_attention_layernorm.weight"
        if config.qk_norm:
            names[p + "q_norm"] = h + "self_attn.q_norm.weight"
            names[p + "k_norm"] = h + "self_attn.k_norm.weight"
    return names
