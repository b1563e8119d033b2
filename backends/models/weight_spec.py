"""The weights of a decoder architecture, written once.

``weight_spec(config)`` lists every tensor the model holds: where it lives in
``DecoderLM`` (``path``), which checkpoint tensors (Hugging Face names) it is
made of, concatenated along the first dimension (q, k and v into one
projection; gate and up into another), and their shapes. Both loaders check a
checkpoint against it, ``DecoderLM.load_weights`` places tensors by it, and
quantization finds the projections it may replace by it.

Linear layers are marked (``linear``): their weight and bias are what a
transform may swap for another module (prepacked, quantized, sharded).
Each checkpoint tensor also says how tensor parallelism splits it
(``Split``; backends/parallel/sharding.py): a linear split along its output
rows is column-parallel, one split along its input columns row-parallel
(its output is all-reduced). A new architecture option (extra norms,
biases) adds entries here and the module attributes they name; nothing else
needs to learn the names.

Roles: ``qkv_proj`` and ``gate_up_proj`` are column-parallel (split by output
rows: q/k/v heads, gate and up halves alike), ``o_proj`` and ``down_proj``
row-parallel. A mixture-of-experts layer holds one such pair per expert
(``layers.N.experts.E.gate_up_proj`` / ``.down_proj``, the same roles, so
quantization treats every expert like a dense MLP) and a ``router`` that is
not a linear module (replicated, never quantized: its logits choose the
experts). Norm weights (``offset`` added at load: Gemma's 1 + w) and the
router are replicated. Packed checkpoint tensors (Phi-3's ``qkv_proj`` and
``gate_up_proj``) split part by part (``QKV_PACKED``, ``GATE_UP_PACKED``);
experts split their own rows (``EXPERT_OUT`` / ``EXPERT_IN``), and their
down projections' partial outputs are summed over experts before one
all-reduce per layer (backends/parallel/layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.config import ModelConfig

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Split:
    """How tensor parallelism splits a checkpoint tensor: along ``dim``,
    in units of ``axis`` ("heads", "kv_heads", "intermediate", "vocab",
    "expert_intermediate"; "qkv" and "gate_up" for packed tensors, split
    part by part), or ``axis="reduced"`` for the bias of a row-parallel linear
    (added once, after the all-reduce). A tensor without a Split is
    replicated."""

    dim: int
    axis: str


HEADS_OUT, KV_OUT, HEADS_IN = Split(0, "heads"), Split(0, "kv_heads"), Split(1, "heads")
MLP_OUT, MLP_IN, VOCAB = Split(0, "intermediate"), Split(1, "intermediate"), Split(0, "vocab")
# An expert's MLP rows (MoEConfig.intermediate_size wide).
EXPERT_OUT, EXPERT_IN = Split(0, "expert_intermediate"), Split(1, "expert_intermediate")
# Packed checkpoint tensors (Phi-3): q | k | v rows in one, gate | up in the other;
# each rank keeps its heads / rows of every part.
QKV_PACKED, GATE_UP_PACKED = Split(0, "qkv"), Split(0, "gate_up")


@dataclass(frozen=True, slots=True)
class ModelTensor:
    """One tensor of the model.

    ``path``: its dotted name in the model ("layers.0.qkv_proj.weight").
    ``sources``: the checkpoint tensors it is made of, in order, concatenated
    along dim 0; ``source_shapes`` their shapes. ``linear``: the dotted name
    of the linear module it belongs to (weight or bias), else None.
    ``splits``: per source, how tensor parallelism splits it (empty: all
    replicated). ``offset``: added to the values once at load (see
    ``assemble``).
    """

    path: str
    sources: tuple[str, ...]
    source_shapes: tuple[Shape, ...]
    linear: str | None = None
    splits: tuple[Split | None, ...] = ()
    offset: float = 0.0

    @property
    def row_parallel(self) -> bool:
        """A linear weight split along its input: its output needs an all-reduce."""
        return any(s is not None and s.dim == 1 for s in self.splits)

    @property
    def shape(self) -> Shape:
        first = self.source_shapes[0]
        return (sum(s[0] for s in self.source_shapes), *first[1:])

    @property
    def module(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def attr(self) -> str:
        return self.path.rpartition(".")[2]


def _t(path: str, *sources: tuple[str, Shape], linear: bool = False,
       split: tuple[Split | None, ...] = (), offset: float = 0.0) -> ModelTensor:
    return ModelTensor(path, tuple(n for n, _ in sources), tuple(s for _, s in sources),
                       path.rpartition(".")[0] if linear else None, split, offset)


def assemble(tensor: ModelTensor, parts: list[Any]) -> Any:
    """The model's value of ``tensor`` from its checkpoint parts (torch
    tensors, in ``sources`` order): concatenated, offset added. With an
    offset the sum is float32, as the reference computes it (1 + w of a
    bfloat16 w is exact in float32); the caller casts to the serving dtype."""
    import torch
    value = parts[0] if len(parts) == 1 else torch.cat(parts)
    return value.to(torch.float32) + tensor.offset if tensor.offset else value


def weight_spec(config: ModelConfig) -> list[ModelTensor]:
    """Every tensor of the decoder ``config`` describes (Llama, Mistral,
    Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma 2, Gemma 3)."""
    c = config
    h = c.hidden_size

    def norm(path: str, source: str, width: int = h) -> ModelTensor:
        return _t(path, (source, (width,)), offset=c.norm_weight_offset)

    spec = [_t("embed_tokens.weight", ("model.embed_tokens.weight", (c.vocab_size, h)),
               split=(VOCAB,)),
            norm("norm", "model.norm.weight")]
    if not c.tie_word_embeddings:
        spec.append(_t("lm_head.weight", ("lm_head.weight", (c.vocab_size, h)), linear=True,
                       split=(VOCAB,)))
    for i in range(c.num_layers):
        L, P = f"layers.{i}.", f"model.layers.{i}."
        attn, mlp = P + "self_attn.", P + "mlp."
        spec.append(norm(L + "input_norm", P + "input_layernorm.weight"))
        spec += _attention(c, L, attn)
        if c.qk_norm:
            spec += [norm(L + "q_norm", attn + "q_norm.weight", c.head_dim),
                     norm(L + "k_norm", attn + "k_norm.weight", c.head_dim)]
        if c.sandwich_norms:
            # Gemma: post_attention_layernorm normalises the attention output;
            # pre_feedforward_layernorm is the norm before the MLP.
            spec += [norm(L + "attn_output_norm", P + "post_attention_layernorm.weight"),
                     norm(L + "post_attention_norm", P + "pre_feedforward_layernorm.weight"),
                     norm(L + "mlp_output_norm", P + "post_feedforward_layernorm.weight")]
        else:
            spec.append(norm(L + "post_attention_norm", P + "post_attention_layernorm.weight"))
        if c.is_moe_layer(i):
            spec += _experts(c, L, P)
        else:
            spec += _mlp(c, L, mlp, c.intermediate_size)
    return spec


def _attention(c: ModelConfig, L: str, attn: str) -> list[ModelTensor]:
    h, q, kv = c.hidden_size, c.q_size, c.kv_size
    if c.packed_projections:  # Phi-3: one qkv_proj tensor, q rows then k then v
        spec = [_t(L + "qkv_proj.weight", (attn + "qkv_proj.weight", (q + 2 * kv, h)),
                   linear=True, split=(QKV_PACKED,))]
    else:
        spec = [_t(L + "qkv_proj.weight", (attn + "q_proj.weight", (q, h)),
                   (attn + "k_proj.weight", (kv, h)), (attn + "v_proj.weight", (kv, h)),
                   linear=True, split=(HEADS_OUT, KV_OUT, KV_OUT))]
    if c.attention_bias:
        spec.append(_t(L + "qkv_proj.bias", (attn + "q_proj.bias", (q,)),
                       (attn + "k_proj.bias", (kv,)), (attn + "v_proj.bias", (kv,)),
                       linear=True, split=(HEADS_OUT, KV_OUT, KV_OUT)))
    spec.append(_t(L + "o_proj.weight", (attn + "o_proj.weight", (h, q)), linear=True,
                   split=(HEADS_IN,)))
    return spec


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _mlp(c: ModelConfig, L: str, mlp: str, inter: int, dense: bool = True,
         names: tuple[str, str, str] = _PROJECTIONS) -> list[ModelTensor]:
    """``dense``: the layer's MLP, not an expert; ``names``: the checkpoint's
    gate, up and down matrices."""
    h = c.hidden_size
    gate, up, down = names
    rows, cols = (MLP_OUT, MLP_IN) if dense else (EXPERT_OUT, EXPERT_IN)
    if c.packed_projections:  # Phi-3: gate rows then up rows in one tensor
        gate_up = _t(L + "gate_up_proj.weight", (mlp + "gate_up_proj.weight", (2 * inter, h)),
                     linear=True, split=(GATE_UP_PACKED,))
    else:
        gate_up = _t(L + "gate_up_proj.weight", (f"{mlp}{gate}.weight", (inter, h)),
                     (f"{mlp}{up}.weight", (inter, h)), linear=True, split=(rows, rows))
    return [gate_up,
            _t(L + "down_proj.weight", (f"{mlp}{down}.weight", (h, inter)), linear=True,
               split=(cols,))]


def _experts(c: ModelConfig, L: str, P: str) -> list[ModelTensor]:
    """``P``: the layer's checkpoint prefix; the router and experts live in
    its ``moe.block`` module (Qwen3-MoE's mlp, Mixtral's block_sparse_moe)."""
    moe = c.moe
    block = f"{P}{moe.block}."
    spec = [_t(L + "router", (block + "gate.weight", (moe.num_experts, c.hidden_size)))]
    for e in range(moe.num_experts):
        spec += _mlp(c, f"{L}experts.{e}.", f"{block}experts.{e}.", moe.intermediate_size,
                     dense=False, names=moe.projections)
    return spec


def checkpoint_shapes(config: ModelConfig) -> dict[str, Shape]:
    """Checkpoint (Hugging Face) tensor name -> shape, for every tensor a
    checkpoint of ``config`` holds (a tied output projection is not one)."""
    return {name: shape for t in weight_spec(config)
            for name, shape in zip(t.sources, t.source_shapes)}


def layer_linears(config: ModelConfig) -> dict[str, tuple[ModelTensor, ModelTensor | None]]:
    """The decoder layers' linear modules (dotted name -> (weight, bias or
    None)), in layer order: what weight-only quantization replaces."""
    out: dict[str, list] = {}
    for t in weight_spec(config):
        if t.linear and t.linear.startswith("layers."):
            entry = out.setdefault(t.linear, [None, None])
            entry[0 if t.attr == "weight" else 1] = t
    return {name: (w, b) for name, (w, b) in out.items()}
