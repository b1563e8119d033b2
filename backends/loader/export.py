"""Write a loaded model out as a Hugging Face folder (`baton export`).

Peers that read only Hugging Face folders (vLLM, transformers without GGUF
support) can then run exactly the weights Baton runs, for comparisons.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from backends.config import LoadedModel
from backends.errors import ModelLoadError

_HF_CLASSES = {"llama": ("LlamaForCausalLM", "llama"),
               "mistral": ("MistralForCausalLM", "mistral"),
               "qwen2": ("Qwen2ForCausalLM", "qwen2"),
               "qwen3": ("Qwen3ForCausalLM", "qwen3")}


def hf_config(loaded: LoadedModel, dtype: torch.dtype) -> dict:
    c = loaded.config
    if c.architecture not in _HF_CLASSES:
        # The families GGUF files bring; the others are Hugging Face folders already.
        raise ModelLoadError(f"baton export writes {', '.join(_HF_CLASSES)} models, "
                             f"not {c.architecture}")
    arch, model_type = _HF_CLASSES[c.architecture]
    rope: dict = {"rope_type": c.rope_scaling.rope_type}
    if c.rope_scaling.rope_type != "default":
        rope.update(factor=c.rope_scaling.factor)
    if c.rope_scaling.rope_type == "llama3":
        rope.update(low_freq_factor=c.rope_scaling.low_freq_factor,
                    high_freq_factor=c.rope_scaling.high_freq_factor,
                    original_max_position_embeddings=c.rope_scaling.original_max_position_embeddings)
    eos = list(loaded.generation.eos_token_ids)
    config = {
        "architectures": [arch], "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": loaded.generation.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    if c.architecture == "qwen3":
        config["attention_bias"] = False
    if c.architecture == "mistral":
        config["sliding_window"] = c.sliding_window
    return config


def export_hf_folder(loaded: LoadedModel, out: str | os.PathLike,
                     dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json, model.safetensors, tokenizer files and
    generation_config.json into ``out`` (created if needed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(dtype).contiguous() for name, t in loaded.weights.items()}
    if loaded.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(loaded, dtype), indent=2))
    tok = loaded.tokenizer
    tok.tokenizer.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                  "add_bos_token": tok.add_bos_token,
                  "model_max_length": loaded.config.max_position_embeddings}
    if tok.chat_template:
        tok_config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    gen = loaded.generation
    eos = list(gen.eos_token_ids)
    generation = {"bos_token_id": gen.bos_token_id,
                  "eos_token_id": eos[0] if len(eos) == 1 else eos}
    for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if getattr(gen, key) is not None:
            generation[key] = getattr(gen, key)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out
