"""The mixture-of-experts MLP (Qwen3-MoE): a router picks a few experts per
token and their SwiGLU MLPs' outputs are summed, weighted.

Each expert is an ``ExpertMLP`` of two linear modules, named and fused like a
dense layer's MLP (``gate_up_proj``, ``down_proj``), so the transforms that
swap linear layers (oneDNN prepacking, int8/int4 quantization, sharding)
treat experts as they treat any projection, without knowing of experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backends.config import MoEConfig


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


def route(x: torch.Tensor, router: torch.Tensor, moe: MoEConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts [T, k] and their weights [T, k] (in x's dtype):
    the top-k of a float32 softmax over the router logits, renormalised to
    sum to one when the model says so (as the reference does)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, moe.experts_per_token, dim=-1)
    if moe.normalize_weights:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(x.dtype)


def moe_mlp(x: torch.Tensor, router: torch.Tensor, experts: nn.ModuleList, moe: MoEConfig,
            act_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]. The rows routed to each expert run as
    one batch through it; experts are visited in index order and their
    weighted outputs added in that order, as the reference adds them.

    Grouping needs the per-expert row counts on the host: one sync per layer
    (the price of running only the chosen experts)."""
    chosen, weights = route(x, router, moe)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
    rows = order // moe.experts_per_token
    row_weights = weights.flatten()[order, None]
    out = torch.zeros_like(x)
    start = 0
    for expert, n in zip(experts, counts):
        if n:
            take = rows[start:start + n]
            y = expert.down_proj(act_mul(expert.gate_up_proj(x[take])))
            out.index_add_(0, take, y * row_weights[start:start + n])
            start += n
    return out
