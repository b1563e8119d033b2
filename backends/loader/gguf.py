"""Load a GGUF file (llama.cpp's format) into a LoadedModel.

Every tensor is dequantized on the host (in torch, backends/loader/gguf_dequant.py)
to the requested dtype and renamed to its Hugging Face name, so the model code never learns where weights came from
(the quantized backend may ask for some projection weights' raw blocks instead).
Metadata is checked against the tensors before anything is dequantized: a file
Baton cannot run exactly fails fast with ModelLoadError instead of loading into
a model that produces wrong text.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from backends.config import (
    SUPPORTED_ARCHITECTURES,
    GenerationDefaults,
    LoadedModel,
    ModelConfig,
    RopeScaling,
    TokenizerSpec,
)
from backends.errors import ModelLoadError, UnsupportedArchitectureError
from backends.loader.gguf_dequant import dequantize as dequantize_tensor
from backends.loader.gguf_file import GGUFTensor as ReaderTensor
from backends.loader.gguf_file import read_gguf
from backends.models.weight_spec import checkpoint_shapes
from backends.loader.gguf_tokenizer import build_tokenizer_spec, field_value
from backends.progress import Progress

# general.architecture values Baton runs. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Per-dimension rotary frequency factors that llama.cpp writes for Llama 3.1+
# instead of rope-scaling metadata; it becomes ModelConfig.rope_scaling.
_ROPE_FREQS = "rope_freqs.weight"
_PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              progress: bool = False, keep_quantized: Collection[str] = ()) -> LoadedModel:
    """Read a GGUF file: config, weights under Hugging Face names in ``dtype``,
    tokenizer and generation defaults.

    ``progress`` reports how far dequantizing has got (backends/progress.py).
    ``keep_quantized`` names GGML block types (e.g. "Q4_1") whose layer
    projection weights and output layer (a tied model's embedding) are
    handed through undecoded, as
    ``backends.quantization.ggml.GGUFBlocks``, for the quantized backend.
    Raises ModelLoadError for a missing, truncated or inconsistent file and
    UnsupportedArchitectureError for an architecture Baton does not run.
    """
    path = pathlib.Path(path)
    source = str(path)
    reader = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    config = _model_config(reader.fields, tensors, path)
    _check_tensor_shapes(config, tensors, source)
    tokenizer = build_tokenizer_spec(reader.fields, source)
    weights = _read_weights(tensors.values(), config, dtype, progress, source,
                           frozenset(keep_quantized))
    formats = {_hf_name(t.name, config.num_layers, source): t.tensor_type.name
               for t in reader.tensors
               if t.name != _ROPE_FREQS and t.tensor_type.name not in _PLAIN_TYPES}
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        generation=_generation_defaults(reader.fields, tokenizer),
        source=source,
        source_formats=formats,
    )


def _open(path: pathlib.Path):
    return read_gguf(path)


def read_gguf_tokenizer(path: pathlib.Path) -> TokenizerSpec:
    """Only the tokenizer of a GGUF file (``--tokenizer``); no weight is read."""
    return build_tokenizer_spec(_open(path).fields, str(path))


# ------------------------------------------------------------------ config
def _model_config(fields: Mapping[str, Any], tensors: Mapping[str, ReaderTensor],
                  path: pathlib.Path) -> ModelConfig:
    source = str(path)
    arch = field_value(fields, "general.architecture")
    if arch is None:
        raise ModelLoadError(f"{source}: no general.architecture in the metadata")
    if arch not in GGUF_ARCHITECTURES:
        note = " in GGUF files (Mistral's say llama)"
        if arch in SUPPORTED_ARCHITECTURES:
            note += f"; serve {arch} from its Hugging Face folder"
        raise UnsupportedArchitectureError(arch, GGUF_ARCHITECTURES, note)

    def required(key: str) -> Any:
        value = _per_layer_constant(fields, f"{arch}.{key}", source)
        if value is None:
            raise ModelLoadError(f"{source}: missing metadata key {arch}.{key}")
        return value

    def optional(key: str, default: Any = None) -> Any:
        value = _per_layer_constant(fields, f"{arch}.{key}", source)
        return default if value is None else value

    hidden = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    num_kv_heads = int(optional("attention.head_count_kv", num_heads))
    head_dim = int(optional("attention.key_length", hidden // num_heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        other = optional(key)
        if other is not None and int(other) != head_dim:
            raise ModelLoadError(
                f"{source}: {arch}.{key}={other} differs from the head size {head_dim}; "
                f"Baton needs full-width rotary and equal key/value head sizes")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: {num_heads} attention heads cannot be shared by {num_kv_heads} KV heads")

    theta = _float32_value(optional("rope.freq_base", 10000.0))
    embed = tensors.get("token_embd.weight")
    vocab_size = optional("vocab_size")
    if vocab_size is None:
        # The embedding's rows are what the model indexes; the token list can be shorter.
        vocab_size = int(embed.shape[-1]) if embed is not None else len(
            field_value(fields, "tokenizer.ggml.tokens") or ())
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_layers=int(required("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float32_value(required("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_rope_scaling(fields, tensors, arch, head_dim, theta, source),
        max_position_embeddings=int(required("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=arch == "qwen3",
        name=field_value(fields, "general.name") or path.stem,
    )


def _per_layer_constant(fields: Mapping[str, Any], key: str, source: str) -> Any:
    """llama.cpp allows per-layer arrays for head counts and FFN sizes; Baton
    needs one value for all layers."""
    value = field_value(fields, key)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ModelLoadError(
                f"{source}: {key} varies across layers ({value}); Baton needs one value")
        return value[0]
    return value


def _float32_value(value: float) -> float:
    """GGUF stores these as float32; give back the decimal the author wrote
    (1e-05, not 9.999999747378752e-06). Both are the same float32."""
    return float(str(np.float32(value)))


def _rope_scaling(fields: Mapping[str, Any], tensors: Mapping[str, ReaderTensor], arch: str,
                  head_dim: int, theta: float, source: str) -> RopeScaling:
    kind = field_value(fields, f"{arch}.rope.scaling.type")
    factor = field_value(fields, f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = field_value(fields, f"{arch}.rope.scale_linear")  # older key
    original = int(field_value(fields, f"{arch}.rope.scaling.original_context_length", 8192))
    if _ROPE_FREQS in tensors:
        return _llama3_scaling(tensors[_ROPE_FREQS], head_dim, theta, original, source)
    if kind == "none" or (kind is None and factor in (None, 0.0, 1.0)):
        return RopeScaling()
    if kind in (None, "linear"):  # llama.cpp's default type when only a factor is given
        return RopeScaling(rope_type="linear", factor=_float32_value(factor or 1.0))
    raise ModelLoadError(
        f"{source}: rope scaling {kind!r} ({arch}.rope.scaling.type) not supported; "
        f"Baton supports linear and llama3")


def _llama3_scaling(tensor: ReaderTensor, head_dim: int, theta: float, original: int,
                    source: str) -> RopeScaling:
    """Recover Llama 3 rope-scaling parameters from llama.cpp's rope_freqs
    tensor, checking them by recomputing the tensor the way convert_hf_to_gguf
    does. Only Meta's published low/high factors (1, 4) are recognised."""
    stored = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    scaling = RopeScaling(rope_type="llama3", factor=float(stored.max()), low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=original)
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    expected = np.where(
        wavelen < original / scaling.high_freq_factor, 1.0,
        np.where(wavelen > original / scaling.low_freq_factor, scaling.factor,
                 1.0 / ((1 - smooth) / scaling.factor + smooth)))
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-4):
        raise ModelLoadError(
            f"{source}: the {_ROPE_FREQS} tensor does not match Llama 3 rope scaling "
            f"(factor {scaling.factor}, low 1, high 4, original context {original}); "
            f"Baton cannot reproduce these rotary frequencies")
    return scaling


# ----------------------------------------------------------------- tensors
def _hf_name(gguf_name: str, num_layers: int, source: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES or int(match.group(1)) >= num_layers:
        raise ModelLoadError(
            f"{source}: unexpected tensor {gguf_name!r}; Baton runs dense Llama/Qwen decoders "
            f"(mixture-of-experts and other variants are not supported)")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first: [576, 49152] is a [49152, 576] matrix.
    return tuple(int(d) for d in reversed(tensor.shape))


def _check_tensor_shapes(config: ModelConfig, tensors: Mapping[str, ReaderTensor], source: str) -> None:
    expected = checkpoint_shapes(config)
    found = {_hf_name(name, config.num_layers, source): t
             for name, t in tensors.items() if name != _ROPE_FREQS}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelLoadError(
            f"{source}: {len(missing)} weight(s) missing, e.g. {', '.join(missing[:3])}")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ModelLoadError(
            f"{source}: weight(s) the {config.architecture} model has no place for: "
            f"{', '.join(extra[:3])}")
    for name, tensor in found.items():
        if _torch_shape(tensor) != expected[name]:
            raise ModelLoadError(
                f"{source}: tensor {tensor.name} has shape {list(_torch_shape(tensor))}, "
                f"the metadata implies {list(expected[name])}")


def _unpermute_rotary_rows(weight, num_heads: int):
    """Undo llama.cpp's Q/K row order for Llama: within each head its converter
    interleaves the two rotary halves; Hugging Face keeps them as halves.
    Takes and gives a numpy array or a torch tensor."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _read_weights(tensors: Iterable[ReaderTensor], config: ModelConfig, dtype: torch.dtype,
                  progress: bool, source: str,
                  keep_quantized: frozenset[str] = frozenset()) -> dict[str, Any]:
    items = [t for t in tensors if t.name != _ROPE_FREQS]
    progress_bar = Progress(f"reading {pathlib.Path(source).name}",
                            sum(t.data.nbytes for t in items), "B", enabled=progress)
    # Only llama-architecture files were permuted by the converter; Qwen's were not.
    heads_by_part = ({"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
                     if config.architecture == "llama" else {})
    # The output layer (a tied model's embedding) is kept as blocks too: the
    # gguf mode may run a Q8_0 one on its codes.
    names = {t.name for t in items}
    output = "output.weight" if "output.weight" in names else "token_embd.weight"
    weights: dict[str, Any] = {}
    with progress_bar:
        for tensor in items:
            name = _hf_name(tensor.name, config.num_layers, source)
            if tensor.tensor_type.name in keep_quantized and (
                    _is_projection(tensor.name) or tensor.name == output):
                weights[name] = _raw_blocks(tensor, heads_by_part)
            else:
                weights[name] = _dequantized(tensor, heads_by_part, dtype, source)
            progress_bar.update(tensor.data.nbytes)
    return weights


def _dequantized(tensor: ReaderTensor, heads_by_part: Mapping[str, int], dtype: torch.dtype,
                 source: str) -> torch.Tensor:
    try:
        weight = dequantize_tensor(tensor.data, tensor.tensor_type, _torch_shape(tensor))
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(
            f"{source}: cannot dequantize tensor {tensor.name} "
            f"({tensor.tensor_type.name}): {exc}") from exc
    part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if part in heads_by_part:
        weight = _unpermute_rotary_rows(weight, heads_by_part[part]).contiguous()
    return weight.to(dtype)


def _is_projection(gguf_name: str) -> bool:
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return (match is not None and match.group(3) == "weight"
            and _LAYER_NAMES.get(match.group(2), "").endswith("_proj"))


def _raw_blocks(tensor: ReaderTensor, heads_by_part: Mapping[str, int]) -> Any:
    """The tensor's blocks as stored, one row of blocks per matrix row. Rows
    un-permute like dequantized ones: blocks lie along rows."""
    from backends.quantization.ggml import GGUFBlocks

    rows = np.array(tensor.data).reshape(_torch_shape(tensor)[0], -1)
    part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if part in heads_by_part:
        rows = np.ascontiguousarray(_unpermute_rotary_rows(rows, heads_by_part[part]))
    return GGUFBlocks(torch.from_numpy(rows), tensor.tensor_type.name, _torch_shape(tensor))


def _generation_defaults(fields: Mapping[str, Any], tokenizer: TokenizerSpec) -> GenerationDefaults:
    # End-of-turn / end-of-message ids also end generation (Llama 3's <|eot_id|>, <|eom_id|>).
    eos_ids: list[int] = []
    for candidate in (tokenizer.eos_token_id,
                      field_value(fields, "tokenizer.ggml.eot_token_id"),
                      field_value(fields, "tokenizer.ggml.eom_token_id")):
        if candidate is not None and int(candidate) not in eos_ids:
            eos_ids.append(int(candidate))
    return GenerationDefaults(eos_token_ids=tuple(eos_ids), bos_token_id=tokenizer.bos_token_id)
