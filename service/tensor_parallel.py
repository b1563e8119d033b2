"""Starting the ranks of a tensor-parallel engine.

Rank 0 is the serving process itself: the scheduler's output goes straight
into its forward pass and the sampled tokens straight back, with no hop
between processes beyond the step broadcast every rank needs anyway, and
``/health`` lives where the liveness watch is. ``start_ranks`` starts this
node's other ranks as worker processes (torch.multiprocessing, spawn), pins
each rank to its own cores and joins the group; on nodes other than 0,
``run_node`` starts all of the node's ranks and waits for them (the same
``baton serve`` command line with ``--node-rank``).

A worker loads only its shard, builds the same backend, then follows rank
0's steps until rank 0 stops (or dies: its connection closes, and a local
worker also notices its parent is gone).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from service.config import EngineArgs

log = logging.getLogger("baton.parallel")


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a worker process needs (pickled to it)."""

    args: EngineArgs
    rank: int
    port: int
    cores: tuple[int, ...] | None
    threads: int | None
    log_json: bool | None = None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def core_layout(ranks: int, threads: int | None) -> list[tuple[int, ...]] | None:
    """This node's cores dealt out to its ``ranks``: ``threads`` each (by
    default an equal share). None when there are not enough cores to give
    every rank its own (then nothing is pinned)."""
    cores = sorted(os.sched_getaffinity(0))
    per = threads or max(1, len(cores) // ranks)
    if per * ranks > len(cores):
        log.warning("%d ranks x %d threads need more than this node's %d cores; not pinning",
                    ranks, per, len(cores))
        return None
    return [tuple(cores[i * per:(i + 1) * per]) for i in range(ranks)]


def pin_process(cores: tuple[int, ...]) -> None:
    """Pin every thread of this process (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that has just ended
            pass


def rank_device(device: str, local_rank: int) -> str:
    """One CUDA device per rank of a node; CPU ranks share the CPU."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def _specs(args: EngineArgs, port: int) -> list[RankSpec]:
    parallel = args.parallel
    layout = core_layout(parallel.ranks_per_node, args.threads) \
        if parallel.pin_cpus and not args.device.startswith("cuda") else None
    specs = []
    log_json = _log_format_here()
    for rank in parallel.node_ranks:
        cores = layout[parallel.local_rank(rank)] if layout else None
        # Each rank its share of the cores, pinned or not.
        threads = args.threads or (len(cores) if cores else
                                   max(1, (os.cpu_count() or 1) // parallel.ranks_per_node))
        specs.append(RankSpec(args, rank, port, cores, threads, log_json))
    return specs


def _spawn(spec: RankSpec):
    import torch.multiprocessing as mp
    process = mp.get_context("spawn").Process(
        target=run_rank, args=(spec,), name=f"rank {spec.rank}", daemon=True)
    process.start()
    return process


def start_ranks(args: EngineArgs):
    """Node 0: start this node's workers, make this process rank 0 (pinned
    to its cores), join the group. Returns the TensorParallelGroup."""
    from backends.parallel.group import TensorParallelGroup
    parallel = args.parallel
    port = parallel.master_port or (free_port(parallel.master_addr) if parallel.nnodes == 1
                                    else parallel.port())
    specs = _specs(args, port)
    workers = [_spawn(spec) for spec in specs[1:]]
    own = specs[0]
    _apply_threads(own)
    log.info("tensor parallel: %d ranks on %d node(s), rendezvous %s:%d; rank 0 here%s",
             parallel.tensor_parallel_size, parallel.nnodes, parallel.master_addr, port,
             f" on cores {list(own.cores)}" if own.cores else "")
    try:
        return TensorParallelGroup.join(parallel, 0, rank_device(args.device, 0), port,
                                        workers)
    except BaseException:
        for process in workers:
            process.terminate()
        raise


def run_node(args: EngineArgs) -> int:
    """A node other than 0: run its ranks until they end. SIGTERM / SIGINT
    stop them. Returns the first non-zero exit code, else 0."""
    import dataclasses

    from backends.device import resolve_dtype
    # Every node must resolve "auto" alike: give --dtype explicitly on mixed machines.
    args = dataclasses.replace(args, dtype=resolve_dtype(args.dtype, args.device))
    parallel = args.parallel
    specs = _specs(args, parallel.port())
    log.info("tensor parallel: node %d of %d runs ranks %s, rendezvous %s:%d",
             parallel.node_rank, parallel.nnodes, list(parallel.node_ranks),
             parallel.master_addr, parallel.port())
    workers = [_spawn(spec) for spec in specs]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while any(p.is_alive() for p in workers) and not stop.is_set():
        time.sleep(0.5)
    for process in workers:
        if process.is_alive():
            process.terminate()
        process.join(5.0)
    return next((p.exitcode for p in workers if p.exitcode), 0)


# ------------------------------------------------------------ worker process
def run_rank(spec: RankSpec) -> None:
    """A worker process: join, load this rank's shard, follow rank 0."""
    from telemetry.logs import configure_logging
    configure_logging(json=spec.log_json)
    from backends.host_malloc import tune_malloc
    tune_malloc()
    _apply_threads(spec)
    _exit_with_parent()
    try:
        code = _follow(spec)
    except Exception:  # noqa: BLE001 - the log says why; rank 0 sees the exit
        log.exception("tensor-parallel rank %d failed", spec.rank)
        code = 1
    logging.shutdown()
    os._exit(code)


def _follow(spec: RankSpec) -> int:
    from backends.parallel.group import TensorParallelError, TensorParallelGroup
    from service.engine_factory import load_backend
    args = spec.args
    device = rank_device(args.device, args.parallel.local_rank(spec.rank))
    group = TensorParallelGroup.join(args.parallel, spec.rank, device, spec.port)
    _, backend = load_backend(args, group, device)
    log.info("tensor-parallel rank %d ready: %d KV blocks, weights %.0f MiB", spec.rank,
             backend.num_kv_blocks, backend.weight_bytes / 2**20)
    try:
        while (step := group.receive_step()) is not None:
            backend.follow_step(*step)
    except TensorParallelError as exc:
        log.error("tensor-parallel rank %d stops: %s", spec.rank, exc)
        return 1
    group.close()
    return 0


def _apply_threads(spec: RankSpec) -> None:
    import torch
    if spec.cores:
        pin_process(spec.cores)
    if spec.threads:
        torch.set_num_threads(spec.threads)


def _exit_with_parent() -> None:
    """A local worker outlives no parent (rank 0, or a node's launcher)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="baton-parent-watch", daemon=True).start()


def _log_format_here() -> bool | None:
    """Whether this process logs JSON (so its workers, writing to the same
    stderr, log alike); None when logging was not set up by Baton."""
    import structlog
    for handler in logging.getLogger().handlers:
        for processor in getattr(handler.formatter, "processors", ()):
            if isinstance(processor, structlog.processors.JSONRenderer):
                return True
            if isinstance(processor, structlog.dev.ConsoleRenderer):
                return False
    return None
