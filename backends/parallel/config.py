"""How the ranks of a tensor-parallel engine are laid out (no torch import).

The names are torchrun's: ``nnodes`` machines, this one ``node_rank``, the
rendezvous at ``master_addr:master_port`` (rank 0's machine). Each node runs
``tensor_parallel_size / nnodes`` ranks; rank 0 is the serving process on
node 0, the others are worker processes it (or the node's launcher) starts.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500  # torchrun's


class ParallelConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """``master_port`` None: a free port on one node, 29500 across nodes.
    ``timeout``: seconds a collective may wait for another rank before the
    engine is failed (a hung rank; a dead one is noticed at once).
    ``heartbeat_timeout``: seconds a rank may go without a heartbeat (each
    rank beats five times that often) before the engine is failed, whether a
    step waits on it or not: a stopped or wedged rank shows in /health within
    seconds, not after ``timeout``.
    ``pin_cpus``: give each rank of a node its own cores (``threads`` each)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    timeout: float = 60.0
    pin_cpus: bool = True
    heartbeat_timeout: float = 5.0

    def __post_init__(self) -> None:
        tp, n = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise ParallelConfigError(f"--tensor-parallel-size must be at least 1, got {tp}")
        if n < 1 or tp % n:
            raise ParallelConfigError(
                f"--nnodes {n} must divide --tensor-parallel-size {tp} (each node runs "
                f"the same number of ranks)")
        if not 0 <= self.node_rank < n:
            raise ParallelConfigError(
                f"--node-rank must be between 0 and {n - 1}, got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ParallelConfigError(f"--master-port {self.master_port} is not a port")
        if self.timeout <= 0:
            raise ParallelConfigError(f"the collective timeout must be positive, got "
                                      f"{self.timeout}")
        if self.heartbeat_timeout <= 0:
            raise ParallelConfigError(f"the heartbeat timeout must be positive, got "
                                      f"{self.heartbeat_timeout}")

    @property
    def enabled(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        k = self.ranks_per_node
        return range(self.node_rank * k, (self.node_rank + 1) * k)

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def port(self) -> int:
        return self.master_port or DEFAULT_MASTER_PORT
