"""Tensor parallelism as a transform of the one model definition.

The model is built from a rank's ``local_config`` (its heads, its MLP rows,
its vocabulary slice) and loaded with its shard of the checkpoint, so the
column-parallel linears (q/k/v, gate/up) and attention need nothing more.
``parallelize`` then wraps what must talk to the other ranks, whatever
module loading and the execution plan put there (plain, oneDNN-packed,
quantized):

* row-parallel linears (o_proj, down_proj: every linear whose weight the
  spec splits along its input) all-reduce their output; experts' down
  projections do not: a mixture-of-experts layer sums their weighted
  partial outputs and all-reduces that sum once (``moe_reduce``), so the
  collectives never depend on which experts the router picked;
* the embedding looks up its vocabulary rows and all-reduces (a token's row
  lives on one rank, the others contribute zeros);
* the output projection computes its vocabulary slice of the logits, which
  are gathered to rank 0 (the sampler's rank) and cut to the real vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.models.weight_spec import weight_spec
from backends.parallel.group import TensorParallelGroup
from backends.parallel.sharding import Partition


class RowParallelLinear(nn.Module):
    """``inner`` holds this rank's input columns; the sum over ranks is the
    full layer's output (a row-parallel bias lives on rank 0 only)."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows ``start .. start + len(weight)`` of the (padded) vocabulary."""

    def __init__(self, inner: nn.Embedding, start: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.inner.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.inner.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class VocabParallelHead(nn.Module):
    """This rank's vocabulary slice of the logits, gathered to rank 0 and cut
    to ``vocab_size`` there (other ranks get their slice back, unused)."""

    def __init__(self, inner: nn.Module, vocab_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden)
        if hidden.shape[0] == 0:  # every rank sees the same row count
            return local.new_empty((0, self.vocab_size))
        logits = self.group.gather_to_first(local)
        return logits[..., :self.vocab_size] if self.group.rank == 0 else logits


def parallelize(model: nn.Module, group: TensorParallelGroup, partition: Partition) -> int:
    """Wrap ``model``'s (a DecoderLM built from ``partition.local_config``
    and loaded with this rank's shard) row-parallel linears, embedding and
    output projection. Returns how many row-parallel linears were wrapped."""
    wrapped = 0
    for tensor in weight_spec(model.config):
        if tensor.linear and ".experts." in tensor.linear:
            continue
        if tensor.linear and tensor.attr == "weight" and tensor.row_parallel:
            model.set_submodule(tensor.linear,
                                RowParallelLinear(model.get_submodule(tensor.linear), group))
            wrapped += 1
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe_reduce = group.all_reduce
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, partition.vocab[0], group)
    model.lm_head = VocabParallelHead(model.lm_head, partition.vocab_size, group)
    return wrapped
