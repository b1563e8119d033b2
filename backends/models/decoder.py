"""Decoder-only transformer for the Llama family, Qwen2 and Qwen3.

One module covers all three: Qwen2 adds q/k/v biases, Qwen3 adds per-head
RMSNorm on q and k. The forward pass takes a flattened batch (prefill chunks
and decode tokens of different requests side by side) and reads K/V through
block tables; it never knows which device it is on.

Weights arrive under Hugging Face names; ``load_weights`` fuses q/k/v into one
projection and gate/up into another, so a layer makes four matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.attention import AttentionMetadata, paged_attention, write_kv
from backends.config import ModelConfig
from backends.errors import ModelLoadError
from backends.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in float32, then back to the input dtype before the weight, as
    # the reference implementation does; this order matters for bf16 parity.
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        qkv_out = config.q_size + 2 * config.kv_size
        self.input_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.post_attention_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.qkv_proj = nn.Linear(h, qkv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        if config.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(config.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.empty(config.head_dim), requires_grad=False)
        self.scale = config.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        eps = c.rms_norm_eps
        num_tokens = hidden.shape[0]

        x = rms_norm(hidden, self.input_norm, eps)
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.reshape(num_tokens, c.num_heads, c.head_dim)
        k = k.reshape(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, k_cache, v_cache, meta, self.scale)
        hidden = hidden + self.o_proj(attn)

        x = rms_norm(hidden, self.post_attention_norm, eps)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        # Set by the backend when the output projection runs prepacked (CPU).
        self.packed_lm_head: nn.Module | None = None
        # Set by the backend to backends.kernels.FusedOps on CPU in float32:
        # forward then makes one native call per elementwise step.
        self.fused_ops = None
        # Set by the backend to backends.kernels.DecodeBf16 (CPU, bf16
        # weights): a decode step of a few sequences is then one native call.
        self.native_decode = None
        self.requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cos_table: torch.Tensor, sin_table: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]."""
        native = self.native_decode
        if (native is not None and not meta.prefills and meta.decode_kernel is not None
                and meta.num_decode == input_ids.shape[0] <= native.max_rows):
            return native(self.embed_tokens(input_ids), positions, meta.slot_mapping,
                          meta.decode_blocks, meta.decode_lens, meta.decode_max_len)
        if self.fused_ops is not None:
            return self._forward_fused(input_ids, positions, cos_table, sin_table, kv_caches,
                                       meta)
        cos = cos_table[positions]
        sin = sin_table[positions]
        hidden = self.embed_tokens(input_ids)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, meta)
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       cos_table: torch.Tensor, sin_table: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       meta: AttentionMetadata) -> torch.Tensor:
        """The same computation as the layers' forward, with each residual add
        folded into the next norm and the elementwise steps done natively."""
        ops = self.fused_ops
        c = self.config
        eps = c.rms_norm_eps
        hidden = self.embed_tokens(input_ids)  # the residual stream, updated in place
        delta = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = ops.rms_norm(hidden, layer.input_norm, eps, delta)
            q = ops.qkv_rope_store(
                layer.qkv_proj(x), c.num_heads, c.num_kv_heads, c.head_dim, positions,
                cos_table, sin_table, getattr(layer, "q_norm", None),
                getattr(layer, "k_norm", None), eps, meta.slot_mapping, k_cache, v_cache)
            attn = paged_attention(q, k_cache, v_cache, meta, layer.scale)
            x = ops.rms_norm(hidden, layer.post_attention_norm, eps, layer.o_proj(attn))
            delta = layer.down_proj(ops.silu_mul(layer.gate_up_proj(x)))
        return ops.rms_norm(hidden, self.norm, eps, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden).to(torch.float32)
        return F.linear(hidden, self.lm_head_weight).to(torch.float32)

    # ----------------------------------------------------------------- weights
    def load_weights(self, weights: dict[str, torch.Tensor], device: torch.device,
                     dtype: torch.dtype) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up.

        Raises ModelLoadError naming any tensor that is missing or misshapen.
        """
        c = self.config
        taken: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"weight {name!r} is missing from the model files")
            taken.add(name)
            return weights[name]

        def put(module: nn.Module, attr: str, value: torch.Tensor, name: str) -> None:
            expected = tuple(getattr(module, attr).shape)
            if tuple(value.shape) != expected:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(value.shape)}, expected {expected}")
            # Replace rather than copy: the module may have been built on the
            # meta device, and this avoids a second copy of every weight.
            setattr(module, attr, nn.Parameter(
                value.to(device=device, dtype=dtype).contiguous(), requires_grad=False))

        put(self.embed_tokens, "weight", take("model.embed_tokens.weight"), "embed_tokens")
        put(self, "norm", take("model.norm.weight"), "model.norm.weight")
        if not c.tie_word_embeddings:
            put(self, "lm_head", take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer, "input_norm", take(p + "input_layernorm.weight"), p + "input_layernorm")
            put(layer, "post_attention_norm", take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm")
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            put(layer.qkv_proj, "weight", qkv, p + "self_attn.qkv_proj")
            if c.attention_bias:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                put(layer.qkv_proj, "bias", bias, p + "self_attn.qkv_proj.bias")
            put(layer.o_proj, "weight", take(p + "self_attn.o_proj.weight"), p + "o_proj")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            put(layer.gate_up_proj, "weight", gate_up, p + "mlp.gate_up_proj")
            put(layer.down_proj, "weight", take(p + "mlp.down_proj.weight"), p + "mlp.down_proj")
            if c.qk_norm:
                put(layer, "q_norm", take(p + "self_attn.q_norm.weight"), p + "q_norm")
                put(layer, "k_norm", take(p + "self_attn.k_norm.weight"), p + "k_norm")
        unused = set(weights) - taken - {"lm_head.weight"}
        if unused:
            raise ModelLoadError(
                f"model files hold tensors this architecture does not use: {sorted(unused)[:5]}")
