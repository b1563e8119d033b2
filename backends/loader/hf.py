"""Load a Hugging Face model folder: config.json, safetensors weights,
tokenizer.json (+ tokenizer_config.json, chat_template.jinja) and
generation_config.json, into a ``LoadedModel``.

Every failure a user can cause (missing folder, bad JSON, a truncated shard, a
missing tensor, an architecture Baton does not run) surfaces as a
``ModelLoadError`` naming the file and the problem, never as another
library's traceback.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from backends.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    GenerationDefaults,
    LoadedModel,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    TokenizerSpec,
)
from backends.errors import ModelLoadError, UnsupportedArchitectureError
from backends.loader.generation_config import parse_generation_config
from backends.loader.pooling_config import read_pooling_config
from backends.progress import Progress
from backends.models.weight_spec import checkpoint_shapes

log = logging.getLogger("baton")

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# model_type values that name a family differently from Baton.
_ARCH_BY_MODEL_TYPE = {"gemma3_text": "gemma3"}
# Image-text models whose language model Baton serves alone: the class, and the
# text configuration class's defaults for what a hub config's (sparse)
# text_config leaves out (transformers' Gemma3TextConfig).
_MULTIMODAL = {"Gemma3ForConditionalGeneration"}
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True,
}
_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_GEMMA = ("gemma2", "gemma3")
# Families whose sliding window covers every layer (when set), and those
# whose layer_types say which layers it covers.
_WINDOW_ON_ALL_LAYERS = ("mistral", "mixtral", "phi3", "qwen3_moe")
_WINDOW_BY_LAYER_TYPE = ("gemma2", "gemma3", "qwen2", "qwen3")
# The configuration classes' defaults where config.json may leave a field out.
_TIED_BY_DEFAULT = _GEMMA
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_tanh": "gelu_tanh"}
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 10


def load_hf_folder(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                   progress: bool = False, shard=None,
                   tokenizer: TokenizerSpec | None = None) -> LoadedModel:
    """Load the model in Hugging Face folder ``path`` with weights in ``dtype``
    (``shard``: see ``backends.loader.load_model``; only that part of each
    tensor is read).

    Raises ModelLoadError (UnsupportedArchitectureError for a family Baton
    does not implement) when a file is missing, malformed or inconsistent.
    """
    folder = Path(path)
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder; expected a Hugging Face model folder")
    raw_config = _read_json(folder / "config.json")
    if raw_config is None:
        raise ModelLoadError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    config = parse_hf_config(raw_config, name=folder.resolve().name)
    tokenizer = tokenizer or load_tokenizer_folder(folder)
    sharder = shard(config) if shard is not None else None
    rename = _language_model_name if _is_multimodal(raw_config) else None
    weights = _load_weights(folder, dtype, progress, sharder, rename)
    if rename is not None:
        log.info("%s: serving the language model of %s; its vision tower is not loaded "
                 "(requests are text only)", folder.name, raw_config["architectures"][0])
    _validate_weights(weights, sharder.local_config if sharder is not None else config)
    generation = _load_generation(folder, raw_config, tokenizer)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       generation=generation, source=str(folder),
                       pooling=read_pooling_config(folder, raw_config))


# ---------------------------------------------------------------- config.json

def parse_hf_config(raw: dict[str, Any], name: str = "model") -> ModelConfig:
    """Build a ModelConfig from the contents of a Hugging Face config.json."""
    try:
        return _parse_config(raw, name)
    except (TypeError, ValueError) as exc:  # a malformed value, or ModelConfig's own checks
        raise ModelLoadError(f"config.json: {exc}") from None


def _is_multimodal(raw: dict[str, Any]) -> bool:
    classes = raw.get("architectures") or []
    return bool(classes) and classes[0] in _MULTIMODAL


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """An image-text model's language model configuration (its text_config
    over the text class's defaults), as a text-only model's config.json."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"config.json: {raw['architectures'][0]} without a text_config")
    merged = {**_GEMMA3_TEXT_DEFAULTS, **text}
    merged.pop("architectures", None)
    merged["model_type"] = "gemma3_text"
    if "tie_word_embeddings" in raw and "tie_word_embeddings" not in text:
        merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return merged


def _language_model_name(name: str) -> str | None:
    """An image-text checkpoint's tensor name as its language model's
    (None: a vision tower or projector tensor, not read). Both layouts:
    the hub's ``language_model.model.*`` and transformers 4.52+'s
    ``model.language_model.*``."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name in ("language_model.lm_head.weight", "lm_head.weight"):
        return "lm_head.weight"
    return None


def _parse_config(raw: dict[str, Any], name: str) -> ModelConfig:
    if _is_multimodal(raw):
        raw = _text_config(raw)
    arch = _architecture(raw)
    hidden_size = _require_int(raw, "hidden_size")
    num_heads = _require_int(raw, "num_attention_heads")
    num_layers = _require_int(raw, "num_hidden_layers")
    max_positions = _require_int(raw, "max_position_embeddings")
    head_dim = _optional_int(raw, "head_dim", None)
    if head_dim is None:
        if hidden_size % num_heads:
            raise ModelLoadError(
                f"config.json: hidden_size {hidden_size} is not divisible by "
                f"num_attention_heads {num_heads} and no head_dim is given")
        head_dim = hidden_size // num_heads
    rope = _rope_parameters(raw, arch)
    rope_theta, rope_scaling, rotary_dim = _rope(rope, raw, head_dim, max_positions)
    layer_types, window = _attention_layout(raw, arch, num_layers, max_positions)
    gemma = arch in _GEMMA
    return ModelConfig(
        architecture=arch,
        vocab_size=_require_int(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_require_int(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_optional_int(raw, "num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch in _TIED_BY_DEFAULT)),
        # Qwen2's q/k/v biases are hard-wired in its modelling code, not a config flag.
        attention_bias=True if arch == "qwen2" else bool(raw.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
        name=name,
        layer_types=layer_types,
        sliding_window=window,
        # Gemma 3's reference ignores attn_logit_softcapping (its configs set
        # it to null); Baton follows the reference.
        attn_logit_softcap=_config_float(raw, "attn_logit_softcapping")
        if arch == "gemma2" else None,
        final_logit_softcap=_config_float(raw, "final_logit_softcapping") if gemma else None,
        query_pre_attn_scalar=_config_float(raw, "query_pre_attn_scalar") if gemma else None,
        embedding_scale=hidden_size ** 0.5 if gemma else None,
        norm_weight_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        hidden_act=_activation(raw, arch),
        rotary_dim=rotary_dim,
        local_rope_theta=_local_rope_theta(raw, arch),
        packed_projections=arch == "phi3",
        moe=_moe(raw, num_layers) if arch == "qwen3_moe"
        else _mixtral_moe(raw) if arch == "mixtral" else None,
    )


def _architecture(raw: dict[str, Any]) -> str:
    model_type = raw.get("model_type")
    model_type = _ARCH_BY_MODEL_TYPE.get(model_type, model_type)
    classes = raw.get("architectures") or []
    if classes and classes[0] in _ARCH_BY_CLASS:
        return _ARCH_BY_CLASS[classes[0]]
    if not classes and model_type in SUPPORTED_ARCHITECTURES:
        return str(model_type)
    # A supported family with another head (e.g. Qwen2ForSequenceClassification):
    # the class is what Baton cannot run, so name it rather than the family.
    if classes and model_type in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(str(classes[0]), SUPPORTED_ARCHITECTURES)
    unknown = model_type or (classes[0] if classes else "<none given in config.json>")
    raise UnsupportedArchitectureError(str(unknown), SUPPORTED_ARCHITECTURES)


def _attention_layout(raw: dict[str, Any], arch: str, num_layers: int,
                      max_positions: int) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention kind and the sliding window, as the family's
    reference reads its config. A window as wide as the context is none."""
    window = raw.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    if arch == "llama" or window is None:
        return (), None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(
            f"config.json: 'sliding_window' must be a positive integer, got {window!r}")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("config.json: use_bidirectional_attention (an embedding model) "
                             "is not supported; Baton runs causal language models")
    if window >= max_positions:
        return (), None
    if arch in _WINDOW_ON_ALL_LAYERS:
        return (SLIDING_ATTENTION,) * num_layers, window
    types = raw.get("layer_types")
    if types is None:
        types = [_default_layer_type(raw, arch, i) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelLoadError(f"config.json: 'layer_types' must list the kind of each of the "
                             f"{num_layers} layers, got {types!r}")
    odd = sorted({str(t) for t in types} - {FULL_ATTENTION, SLIDING_ATTENTION})
    if odd:
        raise ModelLoadError(f"config.json: layer_types {odd} are not supported; Baton runs "
                             f"{FULL_ATTENTION} and {SLIDING_ATTENTION} layers")
    if SLIDING_ATTENTION not in types:
        return (), None
    return tuple(types), window


def _default_layer_type(raw: dict[str, Any], arch: str, i: int) -> str:
    """The configuration classes' defaults when config.json lists no layer_types."""
    if arch == "gemma2":
        sliding = (i + 1) % 2 != 0
    elif arch == "gemma3":
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        sliding = (i + 1) % int(pattern) != 0
    else:  # qwen2 / qwen3
        sliding = i >= int(raw.get("max_window_layers", 0))
    return SLIDING_ATTENTION if sliding else FULL_ATTENTION


def _activation(raw: dict[str, Any], arch: str) -> str:
    key = "hidden_activation" if arch in _GEMMA else "hidden_act"
    default = "gelu_pytorch_tanh" if arch in _GEMMA else "silu"
    name = raw.get(key) or default
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"config.json: {key} {name!r} is not supported; Baton runs "
                             f"{', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


def _moe(raw: dict[str, Any], num_layers: int) -> MoEConfig:
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if not isinstance(experts, int) or experts <= 0:
        raise ModelLoadError(f"config.json: 'num_experts' must be a positive integer, "
                             f"got {experts!r}")
    step = _optional_int(raw, "decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or [])
    # The reference's rule: layers off the sparse step are dense too.
    dense |= {i for i in range(num_layers) if (i + 1) % step}
    return MoEConfig(num_experts=experts,
                     experts_per_token=_require_int(raw, "num_experts_per_tok"),
                     intermediate_size=_require_int(raw, "moe_intermediate_size"),
                     normalize_weights=bool(raw.get("norm_topk_prob", False)),
                     dense_layers=tuple(sorted(dense)))


def _mixtral_moe(raw: dict[str, Any]) -> MoEConfig:
    """Mixtral: every layer's MLP is a mixture of num_local_experts experts
    of intermediate_size, the top num_experts_per_tok of a softmax over all
    of them, always renormalised (its reference divides by their sum)."""
    return MoEConfig(num_experts=_require_int(raw, "num_local_experts"),
                     experts_per_token=_require_int(raw, "num_experts_per_tok"),
                     intermediate_size=_require_int(raw, "intermediate_size"),
                     normalize_weights=True, block="block_sparse_moe",
                     projections=("w1", "w3", "w2"))


def _rope_parameters(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The rotary settings of full-attention layers, as one flat dict
    (rope_theta, rope_type and the scaling fields)."""
    # transformers 5 writes {"rope_theta", "rope_type", ...} under rope_parameters
    # (Gemma 3: one such dict per layer type); older configs have rope_theta at
    # top level and rope_scaling (possibly null).
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(FULL_ATTENTION), dict):
        params = params[FULL_ATTENTION]
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            params.setdefault("rope_theta", raw["rope_theta"])
        elif arch == "gemma3":
            params.setdefault("rope_theta", 1_000_000.0)  # Gemma3TextConfig's default
    params = dict(params)
    for key in ("original_max_position_embeddings", "partial_rotary_factor"):
        if key in raw:  # Phi-3 keeps these at top level
            params.setdefault(key, raw[key])
    return params


def _local_rope_theta(raw: dict[str, Any], arch: str) -> float | None:
    """Gemma 3's sliding-window layers' own rotary base (no scaling)."""
    if arch != "gemma3":
        return None
    params = raw.get("rope_parameters")
    local = params.get(SLIDING_ATTENTION) if isinstance(params, dict) else None
    if isinstance(local, dict):
        kind = local.get("rope_type") or local.get("type") or "default"
        if kind != "default":
            raise ModelLoadError(f"config.json: rope scaling {kind!r} on sliding-window "
                                 f"layers is not supported")
        return float(local.get("rope_theta", 10_000.0))
    return float(raw.get("rope_local_base_freq", 10_000.0))


def _rope(params: dict[str, Any], raw: dict[str, Any], head_dim: int,
          max_positions: int) -> tuple[float, RopeScaling, int | None]:
    """(theta, scaling, rotary_dim: None when the whole head rotates)."""
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial) if partial != 1.0 else None
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # Phi-3's early name
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope scaling type {rope_type!r} is not supported; "
            f"Baton supports {', '.join(_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling(), rotary_dim
    if rope_type == "longrope":
        return theta, _longrope(params, max_positions), rotary_dim
    defaults = RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(params.get(
            "original_max_position_embeddings", defaults.original_max_position_embeddings)),
    ), rotary_dim


def _longrope(params: dict[str, Any], max_positions: int) -> RopeScaling:
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original <= 0:
        raise ModelLoadError("config.json: longrope scaling needs "
                             "original_max_position_embeddings")
    try:
        short = tuple(float(f) for f in params["short_factor"])
        long = tuple(float(f) for f in params["long_factor"])
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError("config.json: longrope scaling needs short_factor and "
                             "long_factor lists") from None
    # The reference's defaults: the factor is the context's growth, and the
    # attention factor sqrt(1 + ln(factor) / ln(original context)).
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=float(factor),
                       original_max_position_embeddings=original, short_factor=short,
                       long_factor=long, attention_factor=float(attention))


def _config_float(raw: dict[str, Any], key: str) -> float | None:
    """A positive number field of config.json, or None when absent or null."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelLoadError(f"config.json: {key!r} must be a positive number, got {value!r}")
    return float(value)


def _require_int(raw: dict[str, Any], key: str) -> int:
    value = _optional_int(raw, key, None)
    if value is None:
        raise ModelLoadError(f"config.json is missing {key!r}")
    return value


def _optional_int(raw: dict[str, Any], key: str, default: int | None) -> int | None:
    """A positive integer field (every size in config.json is one), or ``default``."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


# ---------------------------------------------------------------- weights

def _load_weights(folder: Path, dtype: torch.dtype, progress: bool,
                  sharder=None, rename=None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, under its checkpoint
    name; ``rename`` maps a file's name to that (None: not read)."""
    names_by_file = _weight_files(folder)
    total = sum(len(names) for names in names_by_file.values())
    # A bar on a terminal, a line every few seconds elsewhere.
    bar = Progress(f"loading {folder.name}", total, "tensors", enabled=progress)
    weights: dict[str, torch.Tensor] = {}
    with bar:
        for file, names in names_by_file.items():
            weights.update(_read_safetensors(folder / file, names, dtype, bar, sharder,
                                             rename))
    return weights


def _weight_files(folder: Path) -> dict[str, list[str]]:
    """Map each safetensors file to the tensor names to read from it."""
    index = _read_json(folder / _INDEX_FILE)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{folder / _INDEX_FILE} has no 'weight_map'")
        grouped: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            grouped.setdefault(str(file), []).append(name)
        return grouped
    if (folder / _SINGLE_FILE).is_file():
        return {_SINGLE_FILE: _tensor_names(folder / _SINGLE_FILE)}
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ModelLoadError(
            f"{folder} holds PyTorch pickle weights only; Baton loads safetensors "
            f"({_SINGLE_FILE} or {_INDEX_FILE})")
    raise ModelLoadError(f"{folder} has no {_SINGLE_FILE} or {_INDEX_FILE}")


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise _corrupt(path, exc) from None


def _corrupt(path: Path, exc: Exception) -> ModelLoadError:
    return ModelLoadError(f"weights file {path} is corrupt or truncated ({exc}); re-download it")


def _read_safetensors(path: Path, names: list[str], dtype: torch.dtype,
                      bar: Any, sharder=None, rename=None) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ModelLoadError(f"weights file {path} is missing")
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            absent = sorted(set(names) - set(f.keys()))
            if absent:
                raise ModelLoadError(
                    f"{path.name} lacks tensors that {_INDEX_FILE} places in it: "
                    f"{_listing(absent)}")
            for name in names:
                bar.update(1)
                # Rotary frequencies are recomputed from the config.
                if name.endswith("inv_freq"):
                    continue
                target = name if rename is None else rename(name)
                if target is None:
                    continue
                tensor = (f.get_tensor(name) if sharder is None
                          else sharder.take(target, f.get_slice(name)))
                out[target] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    except (SafetensorError, OSError) as exc:
        raise _corrupt(path, exc) from None
    return out


def _validate_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    if config.tie_word_embeddings:
        # Some tied checkpoints store the shared matrix twice; the model reuses embed_tokens.
        weights.pop("lm_head.weight", None)
    expected = checkpoint_shapes(config)
    missing = [n for n in expected if n not in weights]
    misshaped = [f"{n} {tuple(weights[n].shape)} (expected {shape})"
                 for n, shape in expected.items()
                 if n in weights and tuple(weights[n].shape) != shape]
    # A tensor Baton's model would not read (an o_proj or MLP bias, say) means
    # the checkpoint computes something else; refuse rather than ignore it.
    unexpected = [n for n in weights if n not in expected]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if misshaped:
        problems.append(f"wrong shapes: {_listing(misshaped)}")
    if unexpected:
        problems.append(f"tensors this {config.architecture} configuration does not use: "
                        f"{_listing(unexpected)}")
    if problems:
        raise ModelLoadError(
            f"weights do not match config.json ({config.architecture}, "
            f"{config.num_layers} layers): " + "; ".join(problems))


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


# ---------------------------------------------------------------- tokenizer

def load_tokenizer_folder(folder: Path) -> TokenizerSpec:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{folder} has no tokenizer.json; Baton needs the fast (tokenizers) format")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for every parse error
        raise ModelLoadError(f"tokenizer.json in {folder} cannot be read: {exc}") from None
    tok_config = _read_json(folder / "tokenizer_config.json") or {}
    bos = _token_text(tok_config.get("bos_token"))
    eos = _token_text(tok_config.get("eos_token"))
    bos_id = _token_id(tokenizer, bos, "bos_token")
    special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        # Llama 3 style: no flag, but tokenizer.json's post-processor prepends BOS.
        ids = tokenizer.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(ids) and ids[0] == bos_id
    return TokenizerSpec(
        tokenizer=tokenizer,
        bos_token=bos,
        eos_token=eos,
        bos_token_id=bos_id,
        eos_token_id=_token_id(tokenizer, eos, "eos_token"),
        add_bos_token=bool(add_bos),
        chat_template=_chat_template(folder, tok_config),
        special_token_ids=special,
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_id(tokenizer: Tokenizer, token: str | None, role: str) -> int | None:
    if token is None:
        return None
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ModelLoadError(
            f"tokenizer_config.json names {role} {token!r}, which tokenizer.json does not contain")
    return int(token_id)


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------- generation defaults

def _load_generation(folder: Path, raw_config: dict[str, Any],
                     tokenizer: TokenizerSpec) -> GenerationDefaults:
    # generation_config.json first, then config.json, then the tokenizer's own.
    eos = _id_tuple(raw_config.get("eos_token_id"), "config.json")
    if not eos and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    bos = raw_config.get("bos_token_id")
    base = GenerationDefaults(
        eos_token_ids=eos, bos_token_id=bos if isinstance(bos, int) else tokenizer.bos_token_id)
    gen = _read_json(folder / "generation_config.json") or {}
    return parse_generation_config(gen, "generation_config.json", base)


def _id_tuple(value: Any, file: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(f"{file}: eos_token_id must be an integer or a list of integers, "
                             f"got {value!r}")
    return tuple(ids)


# ---------------------------------------------------------------- files

def _read_json(path: Path) -> dict[str, Any] | None:
    """Contents of a JSON object file, or None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data
