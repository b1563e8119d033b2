"""What a loaded model is: its shape, its tokenizer and its defaults.

Built by the loaders (Hugging Face folder or GGUF file) and read by the model
code, the backend and the engine. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary embedding scaling; ``rope_type`` is one of default, linear, llama3."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a decoder-only transformer of the Llama / Qwen family.

    ``architecture`` is the lower-case family name (see SUPPORTED_ARCHITECTURES).
    ``attention_bias``: q/k/v projections have biases (Qwen2). ``qk_norm``: per
    head RMSNorm on q and k before rotary (Qwen3).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    name: str = "model"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """From generation_config.json or GGUF metadata: EOS ids and default
    sampling values the model's authors recommend."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # A server-wide cap on output tokens (vLLM's reading of max_new_tokens).
    max_new_tokens: int | None = None


@dataclass(slots=True)
class TokenizerSpec:
    """A ready ``tokenizers.Tokenizer`` plus what the files say around it."""

    tokenizer: Any  # tokenizers.Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    special_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class LoadedModel:
    """Output of a loader. ``weights`` use Hugging Face parameter names
    (``model.layers.0.self_attn.q_proj.weight`` ...) as torch tensors on the
    host, already in the requested dtype."""

    config: ModelConfig
    weights: dict[str, Any]
    tokenizer: TokenizerSpec
    generation: GenerationDefaults
    source: str = ""
    # Weight name -> how the file stored it, where that was not plain floats
    # (a GGUF's "Q4_1", "Q4_K" ...): what quantization may build on.
    source_formats: dict[str, str] = field(default_factory=dict)
