"""The flags that scale Baton out: tensor parallelism (ranks, nodes, the
rendezvous, with torchrun's names) and engine replicas on Ray Serve
(docs/scaling.md)."""

from __future__ import annotations

import argparse

from service.cli import _flag, _optional_int


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tensor parallelism (docs/scaling.md)")
    _flag(group, "--tensor-parallel-size -tp", 1, "shard the model over this many ranks "
          "(processes): one CUDA device each (NCCL), or on CPU --threads cores each, pinned "
          "(gloo)", convert=int, dest="tensor_parallel_size")
    _flag(group, "--nnodes", 1, "machines the ranks span; each runs tensor-parallel-size / "
          "nnodes ranks", convert=int)
    _flag(group, "--node-rank", 0, "this machine's index; node 0 serves HTTP, the others "
          "only run their ranks", convert=int)
    _flag(group, "--master-addr", "127.0.0.1", "address of node 0, where the ranks meet")
    _flag(group, "--master-port", None, "port on node 0 where the ranks meet (default: a "
          "free one on one node, 29500 across nodes)", convert=_optional_int)
    _flag(group, "--distributed-timeout", 60.0, "seconds a collective waits for a hung "
          "rank before the engine is failed (a dead rank fails it at once)", convert=float)


def parallel_config_from(ns: argparse.Namespace):
    from backends.parallel.config import ParallelConfig
    return ParallelConfig(
        tensor_parallel_size=ns.tensor_parallel_size, nnodes=ns.nnodes,
        node_rank=ns.node_rank, master_addr=ns.master_addr, master_port=ns.master_port,
        timeout=ns.distributed_timeout)


def add_replica_flags(parser: argparse.ArgumentParser) -> None:
    """``baton serve`` only: engine replicas in a Ray Serve application."""
    group = parser.add_argument_group("replicas on Ray Serve (docs/scaling.md)")
    _flag(group, "--data-parallel-size -dp", 1, "serve this many whole engine replicas "
          "behind Ray Serve's HTTP proxy, routed by shared prompt prefix, else by load "
          "(needs baton[ray]; joins the Ray cluster at RAY_ADDRESS, else starts one here)",
          convert=int, dest="data_parallel_size")
    _flag(group, "--max-replicas", None, "autoscale between --data-parallel-size and this "
          "many replicas by requests in flight (default: a fixed count)",
          convert=_optional_int)


def replica_set_from(ns: argparse.Namespace, engine_args):
    from service.ray_serve import ReplicaSet
    if ns.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {ns.data_parallel_size}")
    if ns.max_replicas is not None and ns.max_replicas < ns.data_parallel_size:
        raise ValueError(f"--max-replicas {ns.max_replicas} is below --data-parallel-size "
                         f"{ns.data_parallel_size}")
    ranks = engine_args.parallel.tensor_parallel_size
    cuda = engine_args.device.startswith("cuda")
    return ReplicaSet(num_replicas=ns.data_parallel_size, max_replicas=ns.max_replicas,
                      num_cpus=0.0 if cuda else float((engine_args.threads or 1) * ranks),
                      num_gpus=float(ranks) if cuda else 0.0,
                      target_ongoing_requests=max(1, engine_args.max_num_seqs // 2))


def check_compatible(engine_args, config) -> None:
    """Refuse settings tensor parallelism cannot honour."""
    if engine_args.parallel.enabled and config.step_timeout is not None:
        raise ValueError(
            "--step-timeout cannot be used with --tensor-parallel-size: a step abandoned in "
            "the middle of its collectives would leave the ranks out of step; "
            "--distributed-timeout bounds a hung rank instead")


def wants_replicas(ns: argparse.Namespace) -> bool:
    return ns.data_parallel_size > 1 or ns.max_replicas is not None
