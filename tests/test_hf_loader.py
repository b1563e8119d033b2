"""The Hugging Face folder loader against transformers' own reading of the
same folders: config fields, every weight bit for bit, tokenizer ids, and the
typed errors a user sees for broken folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from backends.config import SUPPORTED_ARCHITECTURES, RopeScaling
from backends.errors import ModelLoadError, UnsupportedArchitectureError
from backends.loader.hf import load_hf_folder

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

# Ids of the fixture tokenizer's special tokens (see conftest.py).
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

TEXTS = (
    "Hello, world! The capital of France is Paris.",
    "Numbers 1234567 and 3.14159, dates 2024-01-31.",
    "Café naïve résumé — “quotes” 日本語のテキスト 안녕하세요 🙂🚀",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "",
)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _reference_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.state_dict()


# ---------------------------------------------------------------- config


def test_config_matches_transformers(tiny_model_dir: tuple[str, Path]) -> None:
    arch, folder = tiny_model_dir
    ref = transformers.AutoConfig.from_pretrained(folder)
    cfg = load_hf_folder(folder).config

    assert cfg.architecture == arch
    assert cfg.name == folder.name
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        ref.num_hidden_layers, ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert cfg.num_kv_heads < cfg.num_heads  # the fixtures exercise GQA
    assert cfg.rms_norm_eps == ref.rms_norm_eps
    # transformers 5 keeps rope_theta under rope_parameters; 4.x at top level.
    ref_rope = getattr(ref, "rope_parameters", None) or {"rope_theta": ref.rope_theta}
    assert cfg.rope_theta == ref_rope["rope_theta"] == 10000.0
    assert cfg.rope_scaling == RopeScaling()
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.qk_norm == (arch == "qwen3")


def test_llama3_rope_scaling_comes_through(tiny_llama3_rope_dir: Path) -> None:
    cfg = load_hf_folder(tiny_llama3_rope_dir).config
    assert cfg.rope_theta == 10000.0
    assert cfg.rope_scaling == RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)


def test_legacy_rope_fields_are_read(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Configs written before transformers 5 keep rope_theta at top level and
    # the scaling under rope_scaling, sometimes with "type" instead of "rope_type".
    folder = _copy(tiny_llama_dir, tmp_path)

    def to_legacy(cfg: dict[str, Any]) -> None:
        del cfg["rope_parameters"]
        cfg["rope_theta"] = 500000.0
        cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}

    _edit_json(folder / "config.json", to_legacy)
    cfg = load_hf_folder(folder).config
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling.rope_type == "linear"
    assert cfg.rope_scaling.factor == 2.0


def test_head_dim_and_kv_heads_defaults(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "config.json", lambda c: c.pop("head_dim"))
    assert load_hf_folder(folder).config.head_dim == 64 // 4

    # Without num_key_value_heads the model is MHA, so the 2-KV-head weights no longer fit.
    _edit_json(folder / "config.json", lambda c: c.pop("num_key_value_heads"))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight \(32, 64\) \(expected \(64, 64\)\)"):
        load_hf_folder(folder)


# ---------------------------------------------------------------- weights


def test_weights_equal_transformers_state_dict(tiny_model_dir: tuple[str, Path]) -> None:
    arch, folder = tiny_model_dir
    weights = load_hf_folder(folder).weights
    ref = _reference_state_dict(folder)
    tied = arch == "qwen3"

    expected_names = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(weights) == expected_names
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), name


def test_family_specific_tensors(tiny_model_dir: tuple[str, Path]) -> None:
    arch, folder = tiny_model_dir
    weights = load_hf_folder(folder).weights
    has_bias = "model.layers.0.self_attn.q_proj.bias" in weights
    has_qk_norm = "model.layers.0.self_attn.k_norm.weight" in weights
    assert has_bias == (arch == "qwen2")
    assert has_qk_norm == (arch == "qwen3")
    if has_bias:
        assert weights["model.layers.1.self_attn.v_proj.bias"].shape == (2 * 16,)
        assert "model.layers.0.self_attn.o_proj.bias" not in weights
    if has_qk_norm:
        assert weights["model.layers.2.self_attn.q_norm.weight"].shape == (16,)


def test_untied_lm_head_is_its_own_matrix(tiny_llama_dir: Path) -> None:
    loaded = load_hf_folder(tiny_llama_dir)
    assert not loaded.config.tie_word_embeddings
    assert not torch.equal(loaded.weights["lm_head.weight"],
                           loaded.weights["model.embed_tokens.weight"])


def test_tied_checkpoint_storing_lm_head_drops_it(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_qwen3_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, folder / "model.safetensors")

    weights = load_hf_folder(folder).weights
    assert "lm_head.weight" not in weights
    assert not any(name.endswith("inv_freq") for name in weights)


def test_sharded_folder_loads_identically(tiny_llama_dir: Path,
                                          tiny_llama_sharded_dir: Path) -> None:
    index = json.loads((tiny_llama_sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tiny_llama_sharded_dir / "model.safetensors").exists()

    whole = load_hf_folder(tiny_llama_dir).weights
    sharded = load_hf_folder(tiny_llama_sharded_dir).weights
    assert set(sharded) == set(whole)
    for name in whole:
        assert torch.equal(sharded[name], whole[name]), name


def test_bfloat16_conversion(tiny_qwen2_dir: Path) -> None:
    fp32 = load_hf_folder(tiny_qwen2_dir).weights
    bf16 = load_hf_folder(tiny_qwen2_dir, dtype=torch.bfloat16).weights
    assert set(bf16) == set(fp32)
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_encodes_like_transformers(tiny_model_dir: tuple[str, Path]) -> None:
    _, folder = tiny_model_dir
    spec = load_hf_folder(folder).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = spec.tokenizer.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert spec.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_special_tokens_and_template(tiny_llama_dir: Path) -> None:
    spec = load_hf_folder(tiny_llama_dir).tokenizer
    assert (spec.bos_token, spec.bos_token_id) == ("<|endoftext|>", ENDOFTEXT_ID)
    # eos_token is written in tokenizer_config.json's {"content": ...} dict form.
    assert (spec.eos_token, spec.eos_token_id) == ("<|im_end|>", IM_END_ID)
    assert spec.add_bos_token is False
    assert spec.special_token_ids == {ENDOFTEXT_ID, IM_START_ID, IM_END_ID}
    tok_config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    assert spec.chat_template == tok_config["chat_template"]

    messages = [{"role": "user", "content": "Hi there"}]
    ref = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    rendered = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_jinja_file_overrides(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    override = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "chat_template.jinja").write_text(override)
    assert load_hf_folder(folder).tokenizer.chat_template == override


def test_named_chat_templates_pick_default(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "tokenizer_config.json", lambda c: c.update(chat_template=[
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT"},
    ]))
    assert load_hf_folder(folder).tokenizer.chat_template == "DEFAULT"


def test_add_bos_token_inferred_from_post_processor(tiny_llama_dir: Path,
                                                    tmp_path: Path) -> None:
    # Llama 3 style: no add_bos_token flag, tokenizer.json's post-processor prepends BOS.
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "tokenizer_config.json", lambda c: c.pop("add_bos_token"))
    _edit_json(folder / "tokenizer.json", lambda t: t.update(post_processor={
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [ENDOFTEXT_ID],
                                             "tokens": ["<|endoftext|>"]}},
    }))
    assert load_hf_folder(folder).tokenizer.add_bos_token is True
    assert load_hf_folder(tiny_llama_dir).tokenizer.add_bos_token is False


# ---------------------------------------------------------------- generation defaults


def test_generation_config_eos_int_and_list(tiny_llama_dir: Path, tiny_qwen2_dir: Path,
                                            tiny_qwen3_dir: Path) -> None:
    llama = load_hf_folder(tiny_llama_dir).generation
    assert llama.eos_token_ids == (IM_END_ID,)
    assert llama.bos_token_id == ENDOFTEXT_ID
    assert llama.temperature is None

    assert load_hf_folder(tiny_qwen2_dir).generation.eos_token_ids == (IM_END_ID, ENDOFTEXT_ID)

    qwen3 = load_hf_folder(tiny_qwen3_dir).generation
    assert (qwen3.temperature, qwen3.top_p, qwen3.top_k, qwen3.repetition_penalty) == (
        0.6, 0.95, 20, None)


def test_generation_config_repetition_penalty(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "generation_config.json", lambda g: g.update(repetition_penalty=1.05))
    assert load_hf_folder(folder).generation.repetition_penalty == 1.05


def test_eos_falls_back_to_config_then_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / "generation_config.json").unlink()
    _edit_json(folder / "config.json", lambda c: c.update(eos_token_id=[IM_START_ID, IM_END_ID]))
    assert load_hf_folder(folder).generation.eos_token_ids == (IM_START_ID, IM_END_ID)

    _edit_json(folder / "config.json", lambda c: c.update(eos_token_id=None))
    assert load_hf_folder(folder).generation.eos_token_ids == (IM_END_ID,)


# ---------------------------------------------------------------- errors


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_folder(tmp_path / "nope")


def test_missing_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_folder(folder)


def test_invalid_config_json(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON \(line 1"):
        load_hf_folder(folder)


def test_unsupported_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "config.json",
               lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_hf_folder(folder)
    assert info.value.architecture == "gpt2"
    assert info.value.supported == SUPPORTED_ARCHITECTURES
    assert "'gpt2'" in str(info.value) and "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, phi3, gemma2, gemma3" in str(info.value)


def test_unsupported_rope_type(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "config.json", lambda c: c.update(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}))
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'"):
        load_hf_folder(folder)


@pytest.mark.parametrize("window, windowed", [(None, False), (512, False), (128, True)])
def test_mistral_sliding_window(tiny_llama_dir: Path, tmp_path: Path,
                                window: int | None, windowed: bool) -> None:
    """A window narrower than the context covers every layer; one as wide
    (or none) leaves full attention."""
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "config.json", lambda c: c.update(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window))
    cfg = load_hf_folder(folder).config
    assert cfg.architecture == "mistral"
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == (
        [128] * cfg.num_layers if windowed else [None] * cfg.num_layers)


def test_truncated_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is corrupt or truncated"):
        load_hf_folder(folder)


def test_missing_weights_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"has no model\.safetensors"):
        load_hf_folder(folder)


def test_missing_shard(tiny_llama_sharded_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_sharded_dir, tmp_path)
    (folder / "model-00002-of-00010.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00010\.safetensors is missing"):
        load_hf_folder(folder)


def test_missing_tensor_is_named(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_qwen2_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError) as info:
        load_hf_folder(folder)
    message = str(info.value)
    assert "missing tensors" in message
    assert "model.layers.1.mlp.up_proj.weight" in message
    assert "model.layers.0.self_attn.k_proj.bias" in message


def test_misshaped_and_unexpected_tensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(63)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError) as info:
        load_hf_folder(folder)
    message = str(info.value)
    assert "model.norm.weight (63,) (expected (64,))" in message
    assert "does not use: model.layers.0.self_attn.o_proj.bias" in message


def test_missing_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_hf_folder(folder)
