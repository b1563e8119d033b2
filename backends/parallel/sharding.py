"""Which part of the model each tensor-parallel rank holds (Megatron-style).

The weight spec (backends/models/weight_spec.py) says, for every checkpoint
tensor, which dimension splits across ranks and what that dimension is made
of (``Split``): attention heads, KV heads, MLP rows, vocabulary rows, or a
bias added once after an all-reduce. ``Partition`` turns that into ranges for
one rank:

* attention is split by GQA groups (a KV head and the query heads that read
  it), so every rank keeps whole groups and the model's attention runs
  unchanged on fewer heads. With more groups than ranks the groups are dealt
  out as evenly as possible (SmolLM2-135M's 3 groups on 2 ranks: 2 and 1);
  with fewer, each KV head is replicated on ``size / groups`` ranks and its
  query heads are split among them;
* the MLP's intermediate rows, as evenly as possible; a mixture of experts
  splits every expert's rows the same way (each rank holds a slice of every
  expert, so routing needs no communication);
* packed checkpoint tensors (Phi-3's q|k|v and gate|up) part by part: a rank
  keeps its heads' rows of q, of k and of v, its rows of gate and of up;
* the vocabulary, padded to a multiple of the rank count (padding rows are
  zero; their logits are cut off after the gather).

``local_config`` is the model as one rank sees it (fewer heads, a narrower
MLP, its slice of the vocabulary): the single model definition is built from
it, and the shard tensors a loader reads (``take``) have exactly the shapes
of ``weight_spec(local_config)``, so the model's own load checks hold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from backends.config import ModelConfig
from backends.errors import ModelLoadError
from backends.models.weight_spec import Split, weight_spec


class ShardingError(ModelLoadError):
    """The model cannot be split over this many ranks."""


def _even(total: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous near-even split of ``total`` into ``parts``; the first
    ``total % parts`` parts get one more."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True, slots=True)
class Partition:
    """One rank's ranges, in units of each axis (heads, KV heads, MLP rows,
    vocabulary rows of the padded vocabulary)."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]        # rows of the padded vocabulary
    vocab_size: int               # the real one: rows past it are padding
    head_dim: int
    expert_intermediate: tuple[int, int] = (0, 0)   # each expert's MLP rows (MoE)
    # The whole model's q, k (= v) and MLP rows: where a packed tensor's parts begin.
    q_rows: int = 0
    kv_rows: int = 0
    intermediate_rows: int = 0

    @classmethod
    def of(cls, config: ModelConfig, size: int, rank: int) -> Partition:
        if size < 1 or not 0 <= rank < size:
            raise ShardingError(f"rank {rank} of {size} is not a tensor-parallel rank")
        moe = config.moe
        if size > 1 and config.packed_projections and moe is not None:
            raise ShardingError(
                f"{config.architecture}: tensor parallelism does not split packed gate/up "
                f"tensors of experts; serve it on one rank")
        if moe is not None and moe.intermediate_size < size:
            raise ShardingError(f"experts of {moe.intermediate_size} rows cannot be split "
                                f"over {size} ranks")
        groups, heads = config.num_kv_heads, config.num_heads
        per_group = heads // groups
        if groups >= size:
            g0, g1 = _even(groups, size, rank)
            head_range = (g0 * per_group, g1 * per_group)
            kv_range = (g0, g1)
        else:
            replicas = size // groups
            if size % groups or per_group % replicas:
                raise ShardingError(
                    f"{config.num_heads} attention heads in {groups} KV groups cannot be "
                    f"split over {size} tensor-parallel ranks (with fewer KV heads than "
                    f"ranks, the ranks must be a multiple of the KV heads and each group's "
                    f"{per_group} query heads a multiple of the ranks sharing it)")
            group = rank // replicas
            q0, q1 = _even(per_group, replicas, rank % replicas)
            head_range = (group * per_group + q0, group * per_group + q1)
            kv_range = (group, group + 1)
        if config.intermediate_size < size:
            raise ShardingError(
                f"an MLP of {config.intermediate_size} rows cannot be split over {size} ranks")
        padded = -(-config.vocab_size // size) * size
        per_rank = padded // size
        return cls(rank, size, head_range, kv_range,
                   _even(config.intermediate_size, size, rank),
                   (rank * per_rank, (rank + 1) * per_rank), config.vocab_size,
                   config.head_dim,
                   _even(moe.intermediate_size, size, rank) if moe is not None else (0, 0),
                   config.q_size, config.kv_size, config.intermediate_size)

    @property
    def padded_vocab_size(self) -> int:
        return (self.vocab[1] - self.vocab[0]) * self.size

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` as this rank's share of the model."""
        moe = config.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=self.expert_intermediate[1]
                                      - self.expert_intermediate[0])
        return dataclasses.replace(
            config, num_heads=self.heads[1] - self.heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0], moe=moe)

    def rows(self, split: Split) -> tuple[int, int]:
        """The element range of the split dimension this rank keeps."""
        if split.axis == "heads":
            return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim
        if split.axis == "kv_heads":
            return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim
        if split.axis == "intermediate":
            return self.intermediate
        if split.axis == "vocab":
            return self.vocab
        if split.axis == "expert_intermediate":
            return self.expert_intermediate
        raise ShardingError(f"unknown split axis {split.axis!r}")

    def ranges(self, split: Split) -> list[tuple[int, int]]:
        """The element ranges of the split dimension this rank keeps, in
        order: one, or one per part of a packed tensor (q | k | v rows,
        gate | up rows)."""
        if split.axis == "qkv":
            (q0, q1), (k0, k1) = (self.rows(Split(0, "heads")), self.rows(Split(0, "kv_heads")))
            v = self.q_rows + self.kv_rows
            return [(q0, q1), (self.q_rows + k0, self.q_rows + k1), (v + k0, v + k1)]
        if split.axis == "gate_up":
            i0, i1 = self.intermediate
            return [(i0, i1), (self.intermediate_rows + i0, self.intermediate_rows + i1)]
        return [self.rows(split)]


class CheckpointShard:
    """What one rank reads of each checkpoint tensor. ``take`` accepts a full
    tensor or a lazy safetensors slice (only the shard's bytes are read)."""

    def __init__(self, config: ModelConfig, size: int, rank: int) -> None:
        self.config = config
        self.partition = Partition.of(config, size, rank)
        self.local_config = self.partition.local_config(config)
        self._splits: dict[str, tuple[Split | None, tuple[int, ...]]] = {}
        for tensor in weight_spec(config):
            splits = tensor.splits or (None,) * len(tensor.sources)
            for name, shape, split in zip(tensor.sources, tensor.source_shapes, splits):
                self._splits[name] = (split, shape)

    def take(self, name: str, source) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name``; ``source`` is a
        tensor or anything with ``get_shape()`` and slicing (safetensors).
        Tensors the spec does not know pass whole (the model's load check
        names them)."""
        split, expected = self._splits.get(name, (None, None))
        shape = tuple(source.get_shape() if hasattr(source, "get_shape") else source.shape)
        if expected is not None and shape != expected:
            raise ModelLoadError(f"weight {name!r} has shape {shape}, expected {expected}")
        if split is None:
            return source[:] if hasattr(source, "get_shape") else source
        if split.axis == "reduced":
            # A bias after a row-parallel matmul: added once, after the all-reduce.
            full = source[:] if hasattr(source, "get_shape") else source
            return full if self.partition.rank == 0 else torch.zeros_like(full)
        ranges = self.partition.ranges(split)
        if len(ranges) > 1:  # a packed tensor: this rank's rows of every part
            parts = [source[(slice(None),) * split.dim + (slice(a, b),)] for a, b in ranges]
            return torch.cat(parts, dim=split.dim).contiguous()
        start, stop = ranges[0]
        end = min(stop, shape[split.dim])
        index = (slice(None),) * split.dim + (slice(start, end),)
        part = source[index]
        if end < stop:  # vocabulary padding
            pad = list(part.shape)
            pad[split.dim] = stop - end
            part = torch.cat([part, part.new_zeros(pad)], dim=split.dim)
        return part.contiguous()

    def take_all(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace every tensor of a fully loaded checkpoint by this rank's
        part, one at a time (for loaders that cannot read slices)."""
        for name in list(weights):
            value = weights[name]
            if isinstance(value, torch.Tensor):
                weights[name] = self.take(name, value)
            else:
                raise ShardingError(
                    f"weight {name!r} is held quantized ({type(value).__name__}) and "
                    f"cannot be split for tensor parallelism; load it dequantized")
