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
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from backends.config import (
    SUPPORTED_ARCHITECTURES,
    GenerationDefaults,
    LoadedModel,
    ModelConfig,
    RopeScaling,
    TokenizerSpec,
)
from backends.errors import ModelLoadError, UnsupportedArchitectureError
from backends.loader.generation_config import parse_generation_config
from backends.progress import Progress
from backends.models.weight_spec import checkpoint_shapes

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ROPE_TYPES = ("default", "linear", "llama3")
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 10


def load_hf_folder(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                   progress: bool = False, shard=None) -> LoadedModel:
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
    tokenizer = _load_tokenizer(folder)
    sharder = shard(config) if shard is not None else None
    weights = _load_weights(folder, dtype, progress, sharder)
    _validate_weights(weights, sharder.local_config if sharder is not None else config)
    generation = _load_generation(folder, raw_config, tokenizer)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       generation=generation, source=str(folder))


# ---------------------------------------------------------------- config.json

def parse_hf_config(raw: dict[str, Any], name: str = "model") -> ModelConfig:
    """Build a ModelConfig from the contents of a Hugging Face config.json."""
    try:
        return _parse_config(raw, name)
    except (TypeError, ValueError) as exc:  # a malformed value, or ModelConfig's own checks
        raise ModelLoadError(f"config.json: {exc}") from None


def _parse_config(raw: dict[str, Any], name: str) -> ModelConfig:
    arch = _architecture(raw)
    hidden_size = _require_int(raw, "hidden_size")
    num_heads = _require_int(raw, "num_attention_heads")
    max_positions = _require_int(raw, "max_position_embeddings")
    _reject_sliding_window(raw, arch, max_positions)
    head_dim = _optional_int(raw, "head_dim", None)
    if head_dim is None:
        if hidden_size % num_heads:
            raise ModelLoadError(
                f"config.json: hidden_size {hidden_size} is not divisible by "
                f"num_attention_heads {num_heads} and no head_dim is given")
        head_dim = hidden_size // num_heads
    rope_theta, rope_scaling = _rope(raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=_require_int(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_require_int(raw, "intermediate_size"),
        num_layers=_require_int(raw, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_optional_int(raw, "num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v biases are hard-wired in its modelling code, not a config flag.
        attention_bias=True if arch == "qwen2" else bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        name=name,
    )


def _architecture(raw: dict[str, Any]) -> str:
    model_type = raw.get("model_type")
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


def _reject_sliding_window(raw: dict[str, Any], arch: str, max_positions: int) -> None:
    # Baton's attention is full causal attention; a window narrower than the
    # context would silently change what every token attends to.
    window = raw.get("sliding_window")
    in_use = arch == "mistral" or bool(raw.get("use_sliding_window", False))
    if in_use and window is not None and int(window) < max_positions:
        raise ModelLoadError(
            f"config.json: sliding window attention is not supported (sliding_window "
            f"{window} < max_position_embeddings {max_positions})")
    layer_types = raw.get("layer_types") or []
    odd = sorted({str(t) for t in layer_types if t != "full_attention"})
    if odd:
        raise ModelLoadError(
            f"config.json: layer_types {odd} are not supported; Baton runs full attention only")


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers 5 writes {"rope_theta", "rope_type", ...} under rope_parameters;
    # older configs have rope_theta at top level and rope_scaling (possibly null).
    params = raw.get("rope_parameters")
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            params.setdefault("rope_theta", raw["rope_theta"])
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope scaling type {rope_type!r} is not supported; "
            f"Baton supports {', '.join(_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling()
    defaults = RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(params.get(
            "original_max_position_embeddings", defaults.original_max_position_embeddings)),
    )


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
                  sharder=None) -> dict[str, torch.Tensor]:
    names_by_file = _weight_files(folder)
    total = sum(len(names) for names in names_by_file.values())
    # A bar on a terminal, a line every few seconds elsewhere.
    bar = Progress(f"loading {folder.name}", total, "tensors", enabled=progress)
    weights: dict[str, torch.Tensor] = {}
    with bar:
        for file, names in names_by_file.items():
            weights.update(_read_safetensors(folder / file, names, dtype, bar, sharder))
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
                      bar: Any, sharder=None) -> dict[str, torch.Tensor]:
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
                tensor = (f.get_tensor(name) if sharder is None
                          else sharder.take(name, f.get_slice(name)))
                out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
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

def _load_tokenizer(folder: Path) -> TokenizerSpec:
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
