"""Decoder-only transformer: the one model definition and its one forward,
for Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Phi-3 and Gemma 2 / 3.

Families differ by options of ModelConfig (backends/config.py), not by
subclasses: Qwen2 adds q/k/v biases, Qwen3 per-head RMSNorm on q and k,
Mistral and Phi-3 a sliding window, Gemma soft-capping, sandwich norms,
GeGLU and scaled embeddings, Qwen3-MoE a mixture of experts. The forward takes
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

from collections.abc import Callable

import torch
from torch import nn

from backends.attention import AttentionMetadata
from backends.config import ModelConfig
from backends.errors import ModelLoadError
from backends.models.moe import ExpertMLP, moe_mlp
from backends.models.weight_spec import assemble, weight_spec
from backends.ops import ModelOps, QKVShape


class DecoderLayer(nn.Module):
    """One transformer layer. What its family adds comes from the config:
    q/k/v bias, q/k norm, a sliding window and soft-capped scores (the
    attention implementation ``ops.layer_attention`` gives this layer),
    sandwich norms, GeGLU, a mixture of experts."""

    def __init__(self, config: ModelConfig, ops: ModelOps, index: int = 0) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        h = config.hidden_size
        self.input_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.post_attention_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.qkv_proj = nn.Linear(h, config.q_size + 2 * config.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=False)
        self.moe = config.moe if config.is_moe_layer(index) else None
        if self.moe is None:
            self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=False)
            self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        else:
            self.router = nn.Parameter(torch.empty(self.moe.num_experts, h), requires_grad=False)
            self.experts = nn.ModuleList(ExpertMLP(h, self.moe.intermediate_size)
                                         for _ in range(self.moe.num_experts))
        # Under tensor parallelism (backends/parallel/layers.py): the
        # all-reduce of the experts' summed partial outputs, once per layer.
        self.moe_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        if not config.qk_norm:
            self.q_norm = self.k_norm = None
        else:
            self.q_norm = nn.Parameter(torch.empty(config.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.empty(config.head_dim), requires_grad=False)
        if config.sandwich_norms:
            self.attn_output_norm = nn.Parameter(torch.empty(h), requires_grad=False)
            self.mlp_output_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.shape = QKVShape(config.num_heads, config.num_kv_heads, config.head_dim)
        self.scale = config.attention_scale
        window = config.layer_window(index)
        self.local_rope = window is not None and config.local_rope_theta is not None
        self.attend = ops.layer_attention(window, config.attn_logit_softcap)
        self.act_mul = ops.activation(config.hidden_act)

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None,
                positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual`` is the residual stream (updated in place: the
        previous layer's output ``delta`` is added first). Returns the
        stream and this layer's output, to be added to it by the next norm.
        ``cos_table`` / ``sin_table`` are this layer's rotary tables. With
        ``out_rows`` (the last layer: the rows whose hidden state is read)
        every row's K/V is still stored, but only those rows go on past the
        attention: the stream returned is theirs, a copy."""
        ops, eps = self.ops, self.config.rms_norm_eps
        x = ops.add_rms_norm(residual, delta, self.input_norm, eps)
        q = ops.qkv_rope_store(self.qkv_proj(x), self.shape, positions, cos_table, sin_table,
                               self.q_norm, self.k_norm, eps, meta.slot_mapping,
                               k_cache, v_cache)
        attended = self.attend(q, k_cache, v_cache, meta, self.scale)
        if out_rows is not None:
            attended = attended.index_select(0, out_rows)
            residual = residual.index_select(0, out_rows)
        attn = self.o_proj(attended)
        if self.config.sandwich_norms:
            attn = ops.add_rms_norm(attn, None, self.attn_output_norm, eps)
        x = ops.add_rms_norm(residual, attn, self.post_attention_norm, eps)
        if self.moe is None:
            out = self.down_proj(self.act_mul(self.gate_up_proj(x)))
        else:
            out = moe_mlp(x, self.router, self.experts, self.moe, self.act_mul)
            if self.moe_reduce is not None:
                out = self.moe_reduce(out)
        if self.config.sandwich_norms:
            out = ops.add_rms_norm(out, None, self.mlp_output_norm, eps)
        return residual, out


class DecoderLM(nn.Module):
    """``cos_table`` / ``sin_table`` [max_positions, rotary_dim] are the
    rotary tables in the activation dtype (backends/rope.py);
    ``local_tables`` those of sliding-window layers where they differ
    (Gemma 3), else None."""

    def __init__(self, config: ModelConfig, ops: ModelOps, cos_table: torch.Tensor,
                 sin_table: torch.Tensor,
                 local_tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        # Given its (empty) weight, the embedding skips its random init: that
        # init's normal_ on the meta device imports torch._dynamo, 1.5-4 s of
        # start-up for nothing (load_weights overwrites every value).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, ops, i)
                                    for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_table", cos_table, persistent=False)
        self.register_buffer("sin_table", sin_table, persistent=False)
        local_cos, local_sin = local_tables or (cos_table, sin_table)
        self.register_buffer("local_cos_table", local_cos, persistent=False)
        self.register_buffer("local_sin_table", local_sin, persistent=False)
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the
        # activation dtype, as its reference does.
        scale = config.embedding_scale
        self.register_buffer("embedding_scale", None if scale is None else torch.tensor(
            scale, dtype=torch.float32, device=cos_table.device).to(cos_table.dtype),
            persistent=False)
        self.tie_weights()
        self.requires_grad_(False)

    def tie_weights(self) -> None:
        """With tied embeddings the output projection is the embedding matrix."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: token embeddings (scaled, for Gemma)."""
        x = self.embed_tokens(input_ids)
        return x if self.embedding_scale is None else x * self.embedding_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]; with
        ``out_rows`` (int64 row indices), those rows' only, in that order:
        the last layer's projections and MLP skip the rows nobody reads (a
        prefill chunk samples its last row alone), as llama.cpp does."""
        residual = self.embed(input_ids)
        delta = None
        last = len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if layer.local_rope:
                cos, sin = self.local_cos_table, self.local_sin_table
            else:
                cos, sin = self.cos_table, self.sin_table
            residual, delta = layer(residual, delta, positions, cos, sin, k_cache, v_cache,
                                    meta, out_rows if i == last else None)
        return self.ops.add_rms_norm(residual, delta, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits for the given rows (soft-capped, for Gemma 2): float32, or
        with ``float32=False`` in the dtype they are computed in (for a pick
        that only compares them: widening to float32 keeps their order)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.to(torch.float32) if float32 else logits

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
            value = assemble(tensor, parts)
            # Replace rather than copy: the module may have been built on the
            # meta device, and this avoids a second copy of every weight.
            setattr(self.get_submodule(tensor.module), tensor.attr, nn.Parameter(
                value.to(device=device, dtype=dtype).contiguous(), requires_grad=False))
        self.tie_weights()
        unused = set(weights) - taken - {"lm_head.weight"}
        if unused:
            raise ModelLoadError(
                f"model files hold tensors this architecture does not use: {sorted(unused)[:5]}")
