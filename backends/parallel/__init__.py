"""Tensor parallelism: Megatron-style sharding of the one model definition
over torch.distributed ranks (backends/parallel/sharding.py says who holds
what, layers.py wraps what must communicate, group.py runs the collectives)."""
