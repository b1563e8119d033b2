"""The Hugging Face loader on the families beyond Llama / Qwen2 / Qwen3
(conftest.NEW_ARCHITECTURES): their config options and weights against
transformers' own reading of the same folders, the rotary tables against its
rotary embedding, and the config variants hub checkpoints ship."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.config import FULL_ATTENTION, SLIDING_ATTENTION, RopeScaling
from backends.errors import ModelLoadError
from backends.loader.hf import load_hf_folder, parse_hf_config
from backends.rope import local_rope_table, rope_table

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


def _raw(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def test_config_matches_transformers(tiny_new_arch_dir: tuple[str, Path]) -> None:
    arch, folder = tiny_new_arch_dir
    ref = transformers.AutoConfig.from_pretrained(folder)
    cfg = load_hf_folder(folder).config
    assert cfg.architecture == arch
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim) == (
        ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers,
        ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert cfg.num_kv_heads < cfg.num_heads
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    # The window of each layer, as the reference masks it.
    layer_types = getattr(ref, "layer_types", None) if arch.startswith("gemma") else None
    expected = [ref.sliding_window if layer_types is None or layer_types[i] == SLIDING_ATTENTION
                else None for i in range(ref.num_hidden_layers)]
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == expected
    gemma = arch.startswith("gemma")
    assert cfg.sandwich_norms == gemma and cfg.norm_weight_offset == (1.0 if gemma else 0.0)
    assert cfg.hidden_act == ("gelu_tanh" if gemma else "silu")
    assert cfg.packed_projections == (arch == "phi3")
    assert cfg.qk_norm == (arch in ("gemma3", "qwen3_moe"))
    if gemma:
        assert cfg.query_pre_attn_scalar == ref.query_pre_attn_scalar
        assert cfg.embedding_scale == ref.hidden_size ** 0.5
        assert cfg.final_logit_softcap == ref.final_logit_softcapping
        # Gemma 3's reference never passes its attention soft-cap on.
        assert cfg.attn_logit_softcap == (ref.attn_logit_softcapping if arch == "gemma2"
                                          else None)
    else:
        assert cfg.query_pre_attn_scalar is cfg.embedding_scale is None
    if arch == "gemma3":
        full, local = ref.rope_parameters[FULL_ATTENTION], ref.rope_parameters[SLIDING_ATTENTION]
        assert (cfg.rope_theta, cfg.local_rope_theta) == (full["rope_theta"],
                                                          local["rope_theta"])
        assert cfg.rope_scaling == RopeScaling(rope_type="linear", factor=full["factor"])
    if arch == "phi3":
        rope = ref.rope_parameters
        assert cfg.rotary_dim == int(ref.head_dim * rope["partial_rotary_factor"]) == 12
        assert cfg.rope_scaling.rope_type == "longrope"
        assert cfg.rope_scaling.short_factor == tuple(rope["short_factor"])
        assert cfg.rope_scaling.long_factor == tuple(rope["long_factor"])
        assert cfg.rope_scaling.original_max_position_embeddings == 112
    if arch == "qwen3_moe":
        moe = cfg.moe
        assert (moe.num_experts, moe.experts_per_token, moe.intermediate_size,
                moe.normalize_weights) == (ref.num_experts, ref.num_experts_per_tok,
                                           ref.moe_intermediate_size, ref.norm_topk_prob)
        assert moe.dense_layers == tuple(ref.mlp_only_layers) == (1,)
    elif arch == "mixtral":
        moe = cfg.moe
        assert (moe.num_experts, moe.experts_per_token, moe.intermediate_size,
                moe.normalize_weights, moe.dense_layers) == (
            ref.num_local_experts, ref.num_experts_per_tok, ref.intermediate_size, True, ())
        assert (moe.block, moe.projections) == ("block_sparse_moe", ("w1", "w3", "w2"))
    else:
        assert cfg.moe is None


def test_weights_equal_transformers_state_dict(tiny_new_arch_dir: tuple[str, Path]) -> None:
    """Every tensor bit for bit; transformers holds Qwen3-MoE's and
    Mixtral's experts as one [experts, 2 * intermediate, hidden] tensor per
    layer, the checkpoint (and Baton) one gate, up and down matrix per expert
    (Mixtral's w1, w3 and w2, in its block_sparse_moe module)."""
    arch, folder = tiny_new_arch_dir
    weights = load_hf_folder(folder).weights
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = model.state_dict()
    if model.config.tie_word_embeddings:
        ref.pop("lm_head.weight")
    gate_name, up_name, down_name = (("w1", "w3", "w2") if arch == "mixtral"
                                     else ("gate_proj", "up_proj", "down_proj"))
    for name, tensor in ref.items():
        if arch == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if ".experts." not in name:
            assert torch.equal(weights.pop(name), tensor), name
            continue
        prefix, kind = name.rsplit(".", 1)
        for e, fused in enumerate(tensor):
            if kind == "gate_up_proj":
                gate, up = fused.chunk(2)
                assert torch.equal(weights.pop(f"{prefix}.{e}.{gate_name}.weight"), gate)
                assert torch.equal(weights.pop(f"{prefix}.{e}.{up_name}.weight"), up)
            else:
                assert torch.equal(weights.pop(f"{prefix}.{e}.{down_name}.weight"), fused)
    assert not weights, sorted(weights)[:5]


def test_rotary_tables_match_transformers(tiny_new_arch_dir: tuple[str, Path]) -> None:
    """cos/sin of every position as transformers computes them: Gemma 3's
    two bases, Phi-3's partial rotary, longrope's attention factor and, from
    the original context on, its long factors (transformers switches to them
    once a sequence outgrows it)."""
    arch, folder = tiny_new_arch_dir
    cfg = load_hf_folder(folder).config
    rotary = transformers.AutoModelForCausalLM.from_pretrained(folder).model.rotary_emb
    n = 160
    cos, sin = rope_table(cfg, n, torch.float32, torch.device("cpu"))
    assert cos.shape == (n, cfg.rotary_width)
    x = torch.zeros(1)
    kinds = {FULL_ATTENTION: (cos, sin)}
    if arch == "gemma3":
        kinds[SLIDING_ATTENTION] = local_rope_table(cfg, n, torch.float32, torch.device("cpu"))
    for kind, (c, s) in kinds.items():
        extra = (kind,) if arch == "gemma3" else ()
        if cfg.rope_scaling.rope_type == "longrope":
            split = cfg.rope_scaling.original_max_position_embeddings
            short = rotary(x, torch.arange(split)[None], *extra)
            long = rotary(x, torch.arange(n)[None], *extra)
            ref_cos = torch.cat([short[0][0], long[0][0, split:]])
            ref_sin = torch.cat([short[1][0], long[1][0, split:]])
            assert not torch.allclose(short[0][0, -1], long[0][0, split - 1])
        else:
            ref_cos, ref_sin = (t[0] for t in rotary(x, torch.arange(n)[None], *extra))
        assert torch.equal(c, ref_cos), (arch, kind)
        assert torch.equal(s, ref_sin), (arch, kind)


# ------------------------------------------------------- hub config variants

@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "mistral", "qwen3_moe",
                                  "mixtral"])
def test_gemma_is_tied_when_config_says_nothing(new_arch_dirs, arch) -> None:
    raw = _raw(new_arch_dirs(arch))
    raw.pop("tie_word_embeddings")
    assert parse_hf_config(raw).tie_word_embeddings == arch.startswith("gemma")


def test_gemma3_legacy_rope_fields_and_window_pattern() -> None:
    """Gemma 3 configs on the hub predate rope_parameters and layer_types:
    rope_theta / rope_local_base_freq / rope_scaling and a pattern of five
    sliding layers to one full one."""
    raw = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
               hidden_size=64, intermediate_size=128, num_hidden_layers=12,
               num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=512,
               max_position_embeddings=32768, rope_theta=1_000_000.0,
               rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=16,
               final_logit_softcapping=None, attn_logit_softcapping=None)
    cfg = parse_hf_config(raw)
    ref = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items()
                                            if k not in ("architectures", "model_type")})
    assert [cfg.layer_window(i) for i in range(12)] == [
        512 if t == SLIDING_ATTENTION else None for t in ref.layer_types]
    assert cfg.layer_window(5) is None and cfg.layer_window(4) == 512
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert cfg.rope_scaling == RopeScaling(rope_type="linear", factor=8.0)
    assert cfg.tie_word_embeddings and cfg.embedding_scale == 8.0


def test_phi3_legacy_su_scaling(new_arch_dirs) -> None:
    """Phi-3's early configs: rope_scaling {"type": "su"} with
    original_max_position_embeddings and partial_rotary_factor at top level."""
    folder = new_arch_dirs("phi3")
    raw = _raw(folder)
    rope = raw.pop("rope_parameters")
    raw.update(rope_theta=rope["rope_theta"], rope_scaling={
        "type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]})
    legacy, current = parse_hf_config(raw), load_hf_folder(folder).config
    assert legacy.rope_scaling == current.rope_scaling
    assert legacy.rotary_dim == current.rotary_dim == 12
    # The reference's attention factor: sqrt(1 + ln(512 / 112) / ln(112)).
    assert math.isclose(legacy.rope_scaling.attention_factor,
                        math.sqrt(1 + math.log(512 / 112) / math.log(112)))


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "mistral", "mixtral"])
@pytest.mark.parametrize("window, sliding", [(4096, False), (511, True)])
def test_window_as_wide_as_the_context_is_none(new_arch_dirs, arch, window, sliding) -> None:
    """Phi-3-mini-128k's 262144-token window over a 131072-token context
    masks nothing: its layers run as full attention (and keep the native
    decode kernel)."""
    raw = _raw(new_arch_dirs(arch))
    raw["sliding_window"] = window
    assert parse_hf_config(raw).has_sliding_layers == sliding


def test_qwen2_sliding_window_above_max_window_layers(tiny_qwen2_dir: Path) -> None:
    raw = _raw(tiny_qwen2_dir)
    raw.pop("layer_types")
    raw.update(use_sliding_window=True, sliding_window=32, max_window_layers=1)
    cfg = parse_hf_config(raw)
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [None, 32]
    raw["use_sliding_window"] = False
    assert not parse_hf_config(raw).has_sliding_layers


@pytest.mark.parametrize("edit, message", [
    (dict(hidden_activation="relu"), "hidden_activation 'relu' is not supported"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     r"layer_types \['chunked_attention'\] are not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(sliding_window=-4), "'sliding_window' must be a positive integer"),
])
def test_gemma_config_errors(new_arch_dirs, edit, message) -> None:
    raw = {**_raw(new_arch_dirs("gemma2")), **edit}
    with pytest.raises(ModelLoadError, match=message):
        parse_hf_config(raw)


@pytest.mark.parametrize("layout", ["hub", "transformers"])
def test_gemma3_image_text_checkpoint_serves_its_language_model(new_arch_dirs, tmp_path,
                                                                 layout) -> None:
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: a sparse
    text_config over Gemma3TextConfig's defaults, the language model's
    tensors under ``language_model.model.*`` (the hub's files) or
    ``model.language_model.*`` (transformers 4.52+), a vision tower beside
    them. Baton reads the language model alone: the same config and weights
    as the text-only folder (whose tokens tests/test_architectures.py checks
    against transformers), the vision tensors left unread."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    from backends.loader.hf import _GEMMA3_TEXT_DEFAULTS
    defaults = transformers.Gemma3TextConfig().to_dict()
    for key, value in _GEMMA3_TEXT_DEFAULTS.items():
        if key == "rope_theta":
            assert defaults["rope_parameters"][FULL_ATTENTION]["rope_theta"] == value
        elif key == "rope_local_base_freq":
            assert defaults["rope_parameters"][SLIDING_ATTENTION]["rope_theta"] == value
        else:
            assert defaults[key] == value, key

    src = new_arch_dirs("gemma3")
    text = _raw(src)
    sparse = {k: v for k, v in text.items()
              if k not in ("architectures", "dtype", "torch_dtype", "transformers_version")
              and defaults.get(k, object()) != v}
    assert "vocab_size" in sparse and "max_position_embeddings" in sparse
    out = tmp_path / layout
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": sparse, "mm_tokens_per_image": 4,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}}))
    model, outer = (("language_model.model.", "") if layout == "hub"
                    else ("model.language_model.", "model."))
    tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        if name == "lm_head.weight":
            tensors["language_model.lm_head.weight" if layout == "hub" else name] = value
        else:
            tensors[model + name.removeprefix("model.")] = value
    tensors[outer + "vision_tower.vision_model.embeddings.patch_embedding.weight"] = \
        torch.zeros(8, 3, 2, 2)
    tensors[outer + "multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
    save_file(tensors, out / "model.safetensors")

    got, want = load_hf_folder(out), load_hf_folder(src)
    assert got.config == dataclasses.replace(want.config, name=got.config.name)
    assert got.weights.keys() == want.weights.keys()
    for name, value in want.weights.items():
        assert torch.equal(got.weights[name], value), name
