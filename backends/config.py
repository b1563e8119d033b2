"""What a loaded model is: its shape, its tokenizer and its defaults.

Built by the loaders (Hugging Face folder or GGUF file) and read by the model
code, the backend and the engine. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe",
                           "phi3", "gemma2", "gemma3")
# Layer kinds (Hugging Face's layer_types values).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary embedding scaling; ``rope_type`` is one of default, linear,
    llama3, longrope.

    longrope (Phi-3's "su"): per-frequency divisors, ``short_factor`` for
    positions below ``original_max_position_embeddings`` and ``long_factor``
    from there on, and cos/sin multiplied by ``attention_factor``.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral).

    Each token's router logits (a [num_experts, hidden] matrix) go through a
    float32 softmax; the ``experts_per_token`` largest probabilities pick the
    experts, renormalised to sum to one when ``normalize_weights``; the
    token's MLP output is the weighted sum of those experts' SwiGLU MLPs
    (``intermediate_size`` wide each). Layers listed in ``dense_layers`` keep
    an ordinary MLP of ModelConfig.intermediate_size.

    Checkpoint names: ``block`` is the layer's module holding the router
    (``gate``) and the experts (``experts.E``); ``projections`` an expert's
    gate, up and down matrices. Qwen3-MoE: ``mlp`` and gate_proj / up_proj /
    down_proj; Mixtral: ``block_sparse_moe`` and w1 / w3 / w2.
    """

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    normalize_weights: bool = True
    dense_layers: tuple[int, ...] = ()
    block: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token ({self.experts_per_token}) must be between 1 "
                             f"and the number of experts ({self.num_experts})")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a decoder-only transformer, and the options that set its
    families apart (the one forward in backends/models/decoder.py reads them).

    ``architecture`` is the lower-case family name (see SUPPORTED_ARCHITECTURES).
    ``attention_bias``: q/k/v projections have biases (Qwen2). ``qk_norm``: per
    head RMSNorm on q and k before rotary (Qwen3, Gemma 3).

    ``layer_types``: each layer's attention, full or sliding window (empty:
    all full). A sliding-window layer's query at position p attends positions
    p - sliding_window + 1 .. p (Mistral, Phi-3, Gemma 2 and 3).
    ``attn_logit_softcap``: attention scores become cap * tanh(score / cap)
    before the softmax (Gemma 2); ``final_logit_softcap`` the same on the
    output logits. ``query_pre_attn_scalar``: attention scale is its inverse
    square root instead of head_dim's (Gemma). ``embedding_scale``: the token
    embeddings are multiplied by it, rounded to the activation dtype (Gemma:
    sqrt(hidden_size)). ``norm_weight_offset``: RMSNorm multiplies by
    (offset + weight): Gemma stores its norm weights as w - 1; the loaders
    add the offset once. ``sandwich_norms``: the attention and MLP outputs are
    normalised before they join the residual stream (Gemma's post-attention
    and post-feed-forward norms). ``hidden_act``: silu (SwiGLU) or gelu_tanh
    (GeGLU). ``rotary_dim``: the leading dimensions of each head that rotary
    embedding turns (Phi-4-mini's partial rotary); the rest pass through.
    ``local_rope_theta``: the rotary base of sliding-window layers when it
    differs from full-attention layers' (Gemma 3), without scaling.
    ``packed_projections``: the checkpoint stores q/k/v and gate/up already
    fused (Phi-3). ``moe``: the MLP is a mixture of experts (Qwen3-MoE, Mixtral).
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
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    embedding_scale: float | None = None
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    rotary_dim: int | None = None
    local_rope_theta: float | None = None
    packed_projections: bool = False
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model "
                             f"has {self.num_layers}")
        odd = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if odd:
            raise ValueError(f"layer types {odd} are not supported; Baton runs "
                             f"{FULL_ATTENTION} and {SLIDING_ATTENTION}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {self.hidden_act!r} is not supported; Baton runs "
                             f"{', '.join(ACTIVATIONS)}")
        rot = self.rotary_dim
        if rot is not None and not (0 < rot <= self.head_dim and rot % 2 == 0):
            raise ValueError(f"rotary_dim {rot} must be even and at most head_dim "
                             f"{self.head_dim}")
        for cap in (self.attn_logit_softcap, self.final_logit_softcap):
            if cap is not None and cap <= 0:
                raise ValueError(f"soft-capping values must be positive, got {cap}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def rotary_width(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def options(self) -> list[str]:
        """The architecture options in use, in words, for the load log."""
        out = []
        if self.attention_bias:
            out.append("q/k/v bias")
        if self.qk_norm:
            out.append("q/k norm")
        if self.has_sliding_layers:
            n = self.layer_types.count(SLIDING_ATTENTION)
            out.append(f"sliding window {self.sliding_window} on {n} of {self.num_layers} layers")
        if self.attn_logit_softcap is not None:
            out.append(f"attention soft-cap {self.attn_logit_softcap:g}")
        if self.final_logit_softcap is not None:
            out.append(f"final logit soft-cap {self.final_logit_softcap:g}")
        if self.query_pre_attn_scalar is not None:
            out.append(f"attention scale 1/sqrt({self.query_pre_attn_scalar:g})")
        if self.embedding_scale is not None:
            out.append(f"embedding scale {self.embedding_scale:g}")
        if self.norm_weight_offset:
            out.append(f"norm weight offset {self.norm_weight_offset:g}")
        if self.sandwich_norms:
            out.append("post-attention and post-MLP norms")
        if self.hidden_act != "silu":
            out.append(f"{self.hidden_act} MLP")
        if self.rotary_dim is not None and self.rotary_dim != self.head_dim:
            out.append(f"rotary on {self.rotary_dim} of {self.head_dim} head dims")
        if self.rope_scaling.rope_type != "default":
            out.append(f"{self.rope_scaling.rope_type} rope scaling")
        if self.local_rope_theta is not None:
            out.append(f"rope base {self.rope_theta:g} (full) / {self.local_rope_theta:g} "
                       f"(sliding)")
        if self.moe is not None:
            m = self.moe
            dense = f", dense layers {list(m.dense_layers)}" if m.dense_layers else ""
            out.append(f"{m.num_experts} experts, top {m.experts_per_token}"
                       f"{' normalised' if m.normalize_weights else ''}{dense}")
        if self.tie_word_embeddings:
            out.append("tied embeddings")
        return out

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


POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How /v1/embeddings turns a prompt's hidden states (after the final
    norm) into one vector, from the model's sentence-transformers files
    (backends/loader/pooling_config.py).

    ``pooling_type``: "last" (the last position's hidden state) or "mean"
    (the average over every position). The vector is always L2-normalised.
    ``source`` says where the choice came from, for errors and the docs.
    ``matryoshka``: the model was trained so that a leading slice of its
    vector, renormalised, is itself an embedding (a request's
    ``dimensions`` may then cut it); ``matryoshka_dimensions`` lists the
    sizes it allows (empty: any size up to the full one).
    ``unsupported``: why this model's pooling cannot be served (a mode Baton
    does not implement), else None; generation is unaffected.
    """

    pooling_type: str = "last"
    source: str = ("default: last token (a generative model without a pooling "
                   "configuration)")
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    unsupported: str | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type {self.pooling_type!r} is not one of "
                             f"{', '.join(POOLING_TYPES)}")


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
    # How /v1/embeddings pools this model's hidden states.
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
