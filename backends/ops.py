"""The steps of a decoder layer that are not linear layers, with one
implementation each chosen by the execution plan. ``ModelOps`` is what the
model calls; ``build_ops(plan)`` decides what runs.

  add_rms_norm    residual += delta (in place; no delta before the first
                  layer), then RMSNorm(residual) * w
  qkv_rope_store  split q/k/v, optional per-head q/k RMSNorm, rotary
                  embedding, K and V written into their cache slots; returns q
  attention       paged attention of q over the cache (decodes, prefills)
  silu_mul        silu(gate) * up
  gelu_tanh_mul   gelu(gate, tanh approximation) * up (GeGLU: Gemma)
  sliding_attention, softcap_attention
                  attention of sliding-window layers (reading meta.sliding)
                  and of soft-capped ones (Gemma 2)

The torch implementations run on any device and dtype and are the reference;
the native ones (backends/kernels, torch.ops.baton) run on CPU with float32 or
bfloat16 activations, computing in float32 inside each fused step. ``build_ops``
takes each step's implementation from the execution plan, step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from backends.attention import paged_attention, write_kv
from backends.rope import apply_rope


class QKVShape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class ModelOps:
    """One implementation per step; ``names`` says which, for the plan's log."""

    add_rms_norm: Callable[..., torch.Tensor]
    qkv_rope_store: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    name: str = "torch"
    gelu_tanh_mul: Callable[..., torch.Tensor] | None = None
    sliding_attention: Callable[..., torch.Tensor] | None = None
    softcap_attention: Callable[..., torch.Tensor] | None = None

    def layer_attention(self, window: int | None,
                        softcap: float | None) -> Callable[..., torch.Tensor]:
        """The attention of a layer with this sliding ``window`` and score
        ``softcap`` (None: none), called as attention(q, k_cache, v_cache,
        meta, scale); a windowed one reads ``meta.sliding``."""
        if softcap is not None:
            attend = partial(self.softcap_attention, softcap=softcap)
        elif window is not None:
            attend = self.sliding_attention
        else:
            return self.attention
        if window is None:
            return attend
        return lambda q, k_cache, v_cache, meta, scale: attend(q, k_cache, v_cache,
                                                               meta.sliding, scale)

    def activation(self, name: str) -> Callable[..., torch.Tensor]:
        """act(gate) * up for ModelConfig.hidden_act ``name``."""
        return self.silu_mul if name == "silu" else self.gelu_tanh_mul


# ------------------------------------------------------------------ torch
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in float32, then back to the input dtype before the weight, as
    # the reference implementation does; this order matters for bf16 parity.
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    if delta is not None:
        residual.add_(delta)
    return rms_norm(residual, weight, eps)


def qkv_rope_store(qkv: torch.Tensor, shape: QKVShape, positions: torch.Tensor,
                   cos_table: torch.Tensor, sin_table: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
    h, kvh, d = shape
    t = qkv.shape[0]
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q = q.reshape(t, h, d)
    k = k.reshape(t, kvh, d)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    cos, sin = cos_table[positions], sin_table[positions]
    write_kv(k_cache, v_cache, apply_rope(k, cos, sin), v.reshape(t, kvh, d), slot_mapping)
    return apply_rope(q, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


TORCH_OPS = ModelOps(add_rms_norm, qkv_rope_store, paged_attention, silu_mul, "torch",
                     gelu_tanh_mul, paged_attention, paged_attention)


def build_ops(plan) -> ModelOps:
    """Each step's implementation as the ExecutionPlan names it (torch where
    it says torch, the native kernels of ``plan.kernels`` where it says
    native)."""
    if plan.kernels is None:
        return TORCH_OPS
    native = native_cpu_ops(plan.kernels)
    pick = lambda choice, fast, slow: fast if choice == "native" else slow  # noqa: E731
    return ModelOps(
        add_rms_norm=pick(plan.norm, native.add_rms_norm, add_rms_norm),
        qkv_rope_store=pick(plan.rope_kv_store, native.qkv_rope_store, qkv_rope_store),
        attention=pick(plan.decode_attention, native.attention, paged_attention),
        silu_mul=pick(plan.activation, native.silu_mul, silu_mul),
        name=native.name, gelu_tanh_mul=gelu_tanh_mul,
        sliding_attention=paged_attention, softcap_attention=paged_attention)


# ----------------------------------------------------------------- native
def native_cpu_ops(kind: str) -> ModelOps:
    """The C kernels of CPU kind ``kind`` as torch operators
    (``torch.ops.baton``, backends/kernels): float32 or bfloat16 activations,
    a float32 or bfloat16 KV cache. Prefill chunks' attention is torch's
    SDPA."""
    from backends import kernels
    ok, reason = kernels.available(kind)
    if not ok:
        raise RuntimeError(f"the {kind} kernels were planned but cannot run: {reason}")
    k = kernels.kind_id(kind)
    baton = torch.ops.baton

    def norm(residual, delta, weight, eps):
        return baton.rms_norm(residual, delta, weight, eps, k)

    def rope_store(qkv, shape, positions, cos_table, sin_table, q_norm, k_norm, eps,
                   slot_mapping, k_cache, v_cache):
        return baton.qkv_rope_store(qkv, *shape, positions, cos_table, sin_table, q_norm,
                                    k_norm, eps, slot_mapping, k_cache, v_cache, k)

    def decode(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, block_size, scale):
        return baton.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                            max_seq_len, block_size, scale, k)

    def decode_lse(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, block_size,
                   scale):
        return baton.paged_decode_attention_lse(q, k_cache, v_cache, block_tables, seq_lens,
                                                max_seq_len, block_size, scale, k)

    def silu(gate_up):
        return baton.silu_mul(gate_up, k)

    attention = partial(paged_attention, decode_kernel=decode, decode_lse_kernel=decode_lse)
    return ModelOps(norm, rope_store, attention, silu,
                    f"native-{kind}", gelu_tanh_mul, paged_attention, paged_attention)
