"""Shared fixtures: tiny random-weight Llama / Qwen2 / Qwen3 models saved as
Hugging Face folders by transformers itself, with a real byte-level BPE
tokenizer, so loaders and model code can be checked against the reference
implementation without any download.

All folders are built once per session under one tmp dir; tests must treat
them as read-only (copy a folder before breaking it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch

# Engines and servers the tests build run their steps eagerly (the default is
# the compiled step), unless a test asks for the compiled step (compile=True
# or None): compiling costs seconds per engine. Backends built from an
# ExecutionOptions of their own pass compile=False for the same reason.
# tests/test_compiled_step.py covers the compiled step and that default.
os.environ["BATON_COMPILE"] = "0"


@pytest.fixture(autouse=True)
def _compiled_steps_check_guards(monkeypatch):
    """Every compiled step a test runs checks, at every step, the guards
    Dynamo would have checked (a served step skips them: its inputs keep
    them by construction); a step whose inputs break them fails the test."""
    from backends.compiled_step import CompiledStep
    monkeypatch.setattr(CompiledStep, "check_guards", True)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2  # trainer assigns special tokens first
TOKENIZER_VOCAB_SIZE = 512

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's split regex. transformers 5's Qwen2Tokenizer rebuilds its
# pre-tokenizer with this regardless of tokenizer.json, so the fixture uses it
# too: AutoTokenizer then agrees with tokenizer.json for every model type.
_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today?",
    "A language model predicts the next token from the ones before it.",
    "The scheduler decides which requests run in each step of the engine.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Once upon a time there was a little robot who loved to read books.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "What is the capital of France? The capital of France is Paris.",
    "Please write a short poem about the ocean, the moon and the stars.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 65536 3.14159 2.71828",
    "Dates and times: 2024-01-31 12:30:45, version 1.2.3, port 8080.",
    "Café, naïve, résumé, über, façade, jalapeño, crème brûlée, Ångström.",
    "Smart “quotes”, an em — dash, an ellipsis… and ‘single’ quotes.",
    "日本語のテキストです。東京は日本の首都です。",
    "中文文本：北京是中国的首都。你好，世界！",
    "한국어 텍스트: 안녕하세요, 세계!",
    "Emoji: 🙂 🚀 🎉 👍 ❤️ 🤖 🌍",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tcontinue\n",
    '{"name": "baton", "version": "0.1.0", "tags": ["llm", "inference"]}',
    "The rain in Spain stays mainly in the plain; the wind in the willows whistles.",
    "Ask not what your country can do for you, ask what you can do for your country.",
)

# Small but not trivial: GQA (4 query heads, 2 KV heads), explicit head_dim.
_DIMS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
    rms_norm_eps=1e-6, bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID,
    pad_token_id=ENDOFTEXT_ID,
)
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _train_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
        show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json (byte-level BPE, 512 tokens, ChatML specials at ids 0-2)
    and tokenizer_config.json (bos <|endoftext|>, eos <|im_end|>, ChatML template)."""
    out = tmp_path_factory.mktemp("tokenizer")
    tok = _train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        # The older dict form, as many hub models still ship it.
        "eos_token": {"__type": "AddedToken", "content": EOS_TOKEN, "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "pad_token": BOS_TOKEN,
        "add_bos_token": False,
        "model_max_length": 512,
        "chat_template": CHATML_TEMPLATE,
    }, indent=2))
    return out


def _randomize(model: torch.nn.Module, seed: int, norm_center: float = 1.0) -> None:
    # transformers' own init (std 0.02, unit norms, zero biases) gives nearly
    # tied logits and lets a loader that drops norms or biases go unnoticed.
    # Std 0.2 everywhere keeps greedy decoding varied (no one-token loops, even
    # with tied embeddings) and top-1 margins wide enough that bf16 mostly agrees.
    # Gemma stores norm weights as w - 1 (norm_center 0).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(norm_center + 0.2 * noise if name.endswith("norm.weight")
                        else 0.2 * noise)


def build_tiny_model(out: Path, tokenizer_dir: Path, arch: str, *, seed: int,
                     tie: bool, generation: dict[str, Any],
                     max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a seeded random ``arch`` model plus tokenizer files into ``out``."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    config = config_cls(**{**_DIMS, "vocab_size": TOKENIZER_VOCAB_SIZE,
                           "tie_word_embeddings": tie, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize(model, seed, norm_center=0.0 if arch.startswith("gemma") else 1.0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    # save_pretrained derives generation_config.json from the model config;
    # replace it with what a model author would ship.
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


_LLAMA = dict(arch="llama", seed=1, tie=False,
              generation={"bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID})


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Llama, 2 layers, hidden 64, 4 heads / 2 KV heads, head_dim 16, vocab 512,
    untied lm_head; generation_config eos_token_id is an int (2)."""
    _quiet_transformers()
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer_dir, **_LLAMA)


@pytest.fixture(scope="session")
def tiny_llama_sharded_dir(tmp_path_factory: pytest.TempPathFactory,
                           tiny_tokenizer_dir: Path) -> Path:
    """The same weights as tiny_llama_dir, saved in ~50 KB shards with
    model.safetensors.index.json."""
    _quiet_transformers()
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-sharded"), tiny_tokenizer_dir,
                            max_shard_size="50KB", **_LLAMA)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory,
                         tiny_tokenizer_dir: Path) -> Path:
    """Llama as tiny_llama_dir but with llama3 rope scaling (factor 8, original
    context 64), so positions past 64 exercise the scaled frequencies."""
    _quiet_transformers()
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama3-rope"), tiny_tokenizer_dir,
                            arch="llama", seed=4, tie=False,
                            generation={"eos_token_id": IM_END_ID},
                            rope_scaling=dict(LLAMA3_ROPE_SCALING))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Qwen2, 2 layers, dims as llama, q/k/v biases, untied lm_head;
    generation_config eos_token_id is a list ([2, 0])."""
    _quiet_transformers()
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), tiny_tokenizer_dir,
                            arch="qwen2", seed=2, tie=False,
                            generation={"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]})


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """Qwen3, 3 layers, dims as llama, q/k RMSNorm, tied lm_head; generation_config
    with eos [2, 0] and Qwen3's sampling defaults (temperature 0.6, top_p 0.95,
    top_k 20). No repetition_penalty: transformers' generate() would apply it even
    with do_sample=False and so change the greedy reference."""
    _quiet_transformers()
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), tiny_tokenizer_dir,
                            arch="qwen3", seed=3, tie=True, num_hidden_layers=3,
                            generation={"bos_token_id": ENDOFTEXT_ID,
                                        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
                                        "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                        "top_k": 20})


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_model_dir(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """(architecture, folder) for each tiny model in turn."""
    arch: str = request.param
    return arch, request.getfixturevalue(f"tiny_{arch}_dir")


# The families added to the first three, each with what sets it apart and a
# sliding window of a few tokens where it has one, so prompts of 17-90 tokens
# cross it in prefill, chunked prefill and decode alike. Three layers each.
NEW_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "mistral": dict(seed=5, tie=False, sliding_window=6),
    # Phi-4-mini's shape: partial rotary (12 of 16 dims), longrope (original
    # context 112: the prompts and their decodes stay inside it, where Baton
    # and transformers rotate alike; see backends/rope.py), fused qkv / gate_up
    # tensors in the checkpoint, tied embeddings; and Phi-3-mini's sliding
    # window.
    "phi3": dict(seed=6, tie=True, sliding_window=10, partial_rotary_factor=0.75,
                 original_max_position_embeddings=112,
                 rope_scaling={"type": "longrope",
                               "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                               "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 12.0]}),
    # Soft-capping low enough to bite on these random weights. Gemma ties its
    # embeddings, but tied random ones (scaled by sqrt(hidden)) make every
    # prompt repeat its last token: the fixtures are untied.
    "gemma2": dict(seed=7, tie=False, sliding_window=6, query_pre_attn_scalar=24,
                   attn_logit_softcapping=3.0, final_logit_softcapping=3.0),
    # Local layers on base 1e4, the global one on 1e6 with linear scaling.
    "gemma3": dict(seed=8, tie=False, sliding_window=5, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                          "rope_theta": 1_000_000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # Four experts, two per token, renormalised; the middle layer dense.
    "qwen3_moe": dict(seed=9, tie=False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    # Mistral's attention (a window) with four experts of 32 rows in every
    # layer, the top two of a softmax over all four, renormalised.
    "mixtral": dict(seed=10, tie=False, sliding_window=6, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32),
}


@pytest.fixture(scope="session")
def new_arch_dirs(tmp_path_factory: pytest.TempPathFactory,
                  tiny_tokenizer_dir: Path) -> Callable[[str], Path]:
    """arch -> the folder of NEW_ARCHITECTURES[arch] (3 layers, dims as
    llama: GQA 4/2, head_dim 16, vocab 512), built on first use."""
    built: dict[str, Path] = {}

    def folder(arch: str) -> Path:
        if arch not in built:
            _quiet_transformers()
            options = dict(NEW_ARCHITECTURES[arch])
            built[arch] = build_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{arch}"), tiny_tokenizer_dir, arch,
                seed=options.pop("seed"), tie=options.pop("tie"), num_hidden_layers=3,
                generation={"eos_token_id": IM_END_ID}, **options)
        return built[arch]

    return folder


@pytest.fixture(scope="session", params=list(NEW_ARCHITECTURES))
def tiny_new_arch_dir(request: pytest.FixtureRequest,
                      new_arch_dirs: Callable[[str], Path]) -> tuple[str, Path]:
    """(architecture, folder) for each family of NEW_ARCHITECTURES in turn."""
    return request.param, new_arch_dirs(request.param)
