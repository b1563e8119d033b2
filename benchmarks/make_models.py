"""Write random-weight models with the shapes users run, for benchmarks.

SmolLM2-135M (the embedded model) is small enough that a decode step is
bound by dispatch; the models users serve (0.5-8B) are bound by streaming
their weights. This writes Llama models with the shapes of SmolLM2-360M and
SmolLM2-1.7B, random bf16 weights (normal, std 0.02) and the embedded
model's tokenizer, as a Hugging Face folder (what `baton serve` and vLLM
take) and a bf16 GGUF beside it (what llama.cpp's server takes, written with
the `gguf` package as llama.cpp's converter lays Llama out: its Q/K rows
permuted per head), plus the embedded model itself exported as a folder.

    .venv/bin/python benchmarks/make_models.py OUT [--models 135m 360m 1.7b] [--seed 0]

Writes OUT/<name>/ (config.json, model.safetensors, tokenizer files) and
OUT/<name>.gguf for 360m and 1.7b; OUT/smollm2-135m/ is the embedded model
(`baton export`) and OUT/smollm2-135m-bf16.gguf its bf16 GGUF. Sizes: 360m 0.72 GB, 1.7b 3.4 GB, each twice (folder and
GGUF). Prints each file's path and size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.loader import load_model, resolve_model_path  # noqa: E402
from backends.loader.export import export_hf_folder  # noqa: E402

# SmolLM2's published configurations (Hugging Face, HuggingFaceTB/SmolLM2-*).
SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                 num_attention_heads=15, num_key_value_heads=5, rope_theta=100000.0),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=32, rope_theta=130000.0),
}
VOCAB = 49152
CONTEXT = 8192
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def hf_config(shape: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": VOCAB, "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
            "head_dim": shape["hidden_size"] // shape["num_attention_heads"], **shape}


def random_weights(shape: dict, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face names, bf16, tied embeddings."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = h // heads

    def normal(*size):
        return (torch.randn(*size, generator=gen) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(VOCAB, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, h),
            p + "self_attn.k_proj.weight": normal(kv * head_dim, h),
            p + "self_attn.v_proj.weight": normal(kv * head_dim, h),
            p + "self_attn.o_proj.weight": normal(h, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        })
    return weights


def write_folder(out: Path, shape: dict, weights: dict[str, torch.Tensor],
                 tokenizer_from: Path) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)


def _permute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for Llama (the inverse of
    backends/loader/gguf.py's _unpermute_rotary_rows)."""
    rows = w.shape[0]
    return (w.reshape(heads, 2, rows // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: Path, name: str, shape: dict, weights: dict[str, torch.Tensor],
               embedded_gguf: Path) -> None:
    import gguf
    reader = gguf.GGUFReader(str(embedded_gguf))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"{name} (SmolLM2-{name} shape)")
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(shape["hidden_size"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(shape["num_attention_heads"])
    writer.add_head_count_kv(shape["num_key_value_heads"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(shape["hidden_size"] // shape["num_attention_heads"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    # The tokenizer as the embedded file holds it (the same vocabulary).
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for hf_name, tensor in weights.items():
        if hf_name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gguf_name = f"blk.{layer}.{layer_names[module]}.weight"
        data = tensor.view(torch.int16).numpy().view(np.uint16)
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = (shape["num_attention_heads"] if "attn_q" in gguf_name
                     else shape["num_key_value_heads"])
            data = np.ascontiguousarray(_permute_rotary_rows(data, heads))
        if data.ndim == 1:  # norms: float32, as llama.cpp's converter keeps them
            writer.add_tensor(gguf_name, tensor.float().numpy())
        else:
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", nargs="+", default=["135m", "360m", "1.7b"],
                    choices=sorted({"135m", *SHAPES}))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    embedded = resolve_model_path(None)
    base = args.out / "smollm2-135m"
    if not (base / "config.json").exists():
        export_hf_folder(load_model(embedded, dtype=torch.bfloat16), base, torch.bfloat16)
    print(f"{base}: {_size(base)}")
    for name in args.models:
        if name == "135m":  # the embedded model's bf16 weights as a bf16 GGUF
            gguf_path = args.out / "smollm2-135m-bf16.gguf"
            if not gguf_path.exists():
                weights = load_model(embedded, dtype=torch.bfloat16).weights
                weights.pop("lm_head.weight", None)  # tied
                write_gguf(gguf_path, name, SHAPES[name], weights, embedded)
            print(f"{gguf_path}: {_size(gguf_path)}")
            continue
        shape = SHAPES[name]
        folder, gguf_path = args.out / f"random-{name}", args.out / f"random-{name}.gguf"
        weights = random_weights(shape, args.seed)
        if not (folder / "config.json").exists():
            write_folder(folder, shape, weights, base)
        if not gguf_path.exists():
            write_gguf(gguf_path, name, shape, weights, embedded)
        print(f"{folder}: {_size(folder)}\n{gguf_path}: {_size(gguf_path)}")


def _size(path: Path) -> str:
    files = [path] if path.is_file() else list(path.rglob("*"))
    return f"{sum(f.stat().st_size for f in files if f.is_file()) / 1e9:.2f} GB"


if __name__ == "__main__":
    main()
