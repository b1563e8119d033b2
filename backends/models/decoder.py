"""Decoder-only transformer for the Llama family, Qwen2 and Qwen3: the one
model definition and its one forward.

Qwen2 adds q/k/v biases, Qwen3 per-head RMSNorm on q and k. The forward takes
a flattened batch (prefill chunks and decode tokens of different requests side
by side) and reads K/V through block tables. It never knows which kernels
run: every step that is not a linear layer goes through ``ops`` (a ModelOps,
built from the execution plan), and the linear layers are modules a transform
may swap (prepacked, bf16-weight, quantized, sharded) after loading.

Weights arrive under Hugging Face names and are placed by the architecture's
weight spec (backends/models/weight_spec.py): q/k/v fused into one
projection and gate/up into another, so a layer makes four matmuls.
"""

from __future__ import annotations

import torch
from torch import nn

from backends.attention import AttentionMetadata
from backends.config import ModelConfig
from backends.errors import ModelLoadError
from backends.models.weight_spec import weight_spec
from backends.ops import ModelOps, QKVShape


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModelOps) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        h = config.hidden_size
        self.input_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.post_attention_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.qkv_proj = nn.Linear(h, config.q_size + 2 * config.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        if not config.qk_norm:
            self.q_norm = self.k_norm = None
        else:
            self.q_norm = nn.Parameter(torch.empty(config.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.empty(config.head_dim), requires_grad=False)
        self.shape = QKVShape(config.num_heads, config.num_kv_heads, config.head_dim)
        self.scale = config.head_dim ** -0.5

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None,
                positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``residual`` is the residual stream (updated in place: the
        previous layer's output ``delta`` is added first). Returns this
        layer's output, to be added to the stream by the next norm."""
        ops, eps = self.ops, self.config.rms_norm_eps
        x = ops.add_rms_norm(residual, delta, self.input_norm, eps)
        q = ops.qkv_rope_store(self.qkv_proj(x), self.shape, positions, cos_table, sin_table,
                               self.q_norm, self.k_norm, eps, meta.slot_mapping,
                               k_cache, v_cache)
        attn = ops.attention(q, k_cache, v_cache, meta, self.scale)
        x = ops.add_rms_norm(residual, self.o_proj(attn), self.post_attention_norm, eps)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLM(nn.Module):
    """``cos_table`` / ``sin_table`` [max_positions, head_dim] are the rotary
    tables in the activation dtype (backends/rope.py)."""

    def __init__(self, config: ModelConfig, ops: ModelOps, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        # Given its (empty) weight, the embedding skips its random init: that
        # init's normal_ on the meta device imports torch._dynamo, 1.5-4 s of
        # start-up for nothing (load_weights overwrites every value).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_table", cos_table, persistent=False)
        self.register_buffer("sin_table", sin_table, persistent=False)
        self.tie_weights()
        self.requires_grad_(False)

    def tie_weights(self) -> None:
        """With tied embeddings the output projection is the embedding matrix."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]."""
        residual = self.embed_tokens(input_ids)
        delta = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            delta = layer(residual, delta, positions, self.cos_table, self.sin_table,
                          k_cache, v_cache, meta)
        return self.ops.add_rms_norm(residual, delta, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows."""
        return self.lm_head(hidden).to(torch.float32)

    # ----------------------------------------------------------------- weights
    def load_weights(self, weights: dict[str, torch.Tensor], device: torch.device,
                     dtype: torch.dtype) -> None:
        """Place Hugging Face-named tensors by the weight spec, fusing q/k/v
        and gate/up, in ``dtype`` on ``device``.

        Raises ModelLoadError naming any tensor that is missing or misshapen,
        or that the architecture has no place for.
        """
        taken: set[str] = set()
        for tensor in weight_spec(self.config):
            parts = []
            for name, shape in zip(tensor.sources, tensor.source_shapes):
                if name not in weights:
                    raise ModelLoadError(f"weight {name!r} is missing from the model files")
                if tuple(weights[name].shape) != shape:
                    raise ModelLoadError(f"weight {name!r} has shape "
                                         f"{tuple(weights[name].shape)}, expected {shape}")
                parts.append(weights[name])
                taken.add(name)
            value = parts[0] if len(parts) == 1 else torch.cat(parts)
            # Replace rather than copy: the module may have been built on the
            # meta device, and this avoids a second copy of every weight.
            setattr(self.get_submodule(tensor.module), tensor.attr, nn.Parameter(
                value.to(device=device, dtype=dtype).contiguous(), requires_grad=False))
        self.tie_weights()
        unused = set(weights) - taken - {"lm_head.weight"}
        if unused:
            raise ModelLoadError(
                f"model files hold tensors this architecture does not use: {sorted(unused)[:5]}")
