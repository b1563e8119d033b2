"""One rank's place in a tensor-parallel group, and every collective the
model and the backend use (torch.distributed).

Two process groups, as vLLM keeps them:

* ``control`` (gloo, on the host, no practical timeout): rank 0 broadcasts
  each step's rows to the others, which wait there while the server idles;
* ``compute`` (gloo on CPU, NCCL on CUDA, timeout ``ParallelConfig.timeout``):
  the all-reduces of row-parallel layers and the vocabulary embedding, and
  the gather of the vocabulary-parallel logits to rank 0, which samples.

A collective that fails (a peer closed its connection: it died) or times
out (a peer hangs) makes the group *failed* for good: ``fatal_error`` says
why, and every later collective raises ``TensorParallelError`` at once
instead of blocking. On rank 0 a watch thread also fails the group the
moment a local worker process exits, so ``/health`` can say so within
seconds even while the server is idle. A rank that is alive but stops
answering (stopped, wedged with the GIL held) is caught by heartbeats: every
rank but 0 counts up a key in the rendezvous store from a thread of its own,
and rank 0 fails the group when one has not moved for
``ParallelConfig.heartbeat_timeout`` seconds, long before a collective
waiting on that rank would time out.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_exit
from typing import NamedTuple

import torch
import torch.distributed as dist

from backends.parallel.config import ParallelConfig
from backends.parallel.sharding import CheckpointShard

log = logging.getLogger("baton.parallel")

# Workers wait on the control group for the next step for as long as the
# server idles; rank 0's death closes the connection and ends the wait.
CONTROL_TIMEOUT = timedelta(days=30)
RENDEZVOUS_POLL = 0.05  # seconds between liveness checks while ranks join


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed: this engine cannot step again."""


class ForwardRow(NamedTuple):
    """What every rank needs of one scheduled request to run the forward
    pass (the rest of its ScheduledRequest, sampling included, stays on
    rank 0)."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    # An embedding request's row (pooled, never sampled; backends/pooling.py).
    pool: bool = False
    # Speculative proposals this row verifies: its last k + 1 positions are
    # sampled, so every rank gathers that many rows of logits.
    spec_token_ids: tuple[int, ...] = ()


class TensorParallelGroup:
    """Built by ``join``; ``partition`` / ``shard`` once the model's config
    is known. Rank 0 calls ``broadcast_step``, the others ``receive_step``,
    and then every rank runs the same forward, whose sharded layers call
    ``all_reduce`` and ``gather_to_first`` in the same order on every rank."""

    def __init__(self, config: ParallelConfig, rank: int, device: torch.device,
                 control, compute) -> None:
        self.config = config
        self.rank = rank
        self.size = config.tensor_parallel_size
        self.device = device
        self.control = control
        self.compute = compute
        self.fatal_error: str | None = None
        self._closing = False
        self._stop = threading.Event()  # set by close(): the threads below wake and end
        self._threads: list[threading.Thread] = []  # joined by close()
        self._workers: list = []
        self._store_at: tuple[str, int] | None = None  # the rendezvous store's address

    # ---------------------------------------------------------------- set-up
    @classmethod
    def join(cls, config: ParallelConfig, rank: int, device: str, port: int,
             workers: list | None = None, rendezvous_timeout: float = 600.0,
             ) -> TensorParallelGroup:
        """Join (rank 0: host) the rendezvous at ``master_addr:port`` and
        build both groups. On rank 0, ``workers`` are the local worker
        processes: joining fails at once, naming the rank, if one exits
        before every rank has arrived."""
        size = config.tensor_parallel_size
        store = dist.TCPStore(config.master_addr, port, size, is_master=rank == 0,
                              timeout=CONTROL_TIMEOUT, wait_for_workers=False)
        store.set(f"baton/joined/{rank}", "1")
        if rank == 0:
            _wait_for_ranks(store, size, workers or [], rendezvous_timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                timeout=CONTROL_TIMEOUT)
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", config.local_rank(rank))
            torch.cuda.set_device(dev)
        compute = dist.new_group(backend="nccl" if dev.type == "cuda" else "gloo",
                                 timeout=timedelta(seconds=config.timeout))
        group = cls(config, rank, dev, dist.group.WORLD, compute)
        group._store_at = (config.master_addr, port)
        if workers:
            group._watch_workers(workers)
        if size > 1:
            if rank == 0:
                group._watch_heartbeats()
            else:
                group._beat()
        log.info("tensor-parallel rank %d of %d joined (%s)", rank, size,
                 "nccl" if dev.type == "cuda" else "gloo")
        return group

    def shard(self, config) -> CheckpointShard:
        """What this rank loads of a checkpoint of ``config``."""
        return CheckpointShard(config, self.size, self.rank)

    # ------------------------------------------------------------- failures
    def fail(self, reason: str) -> None:
        if self.fatal_error is None and not self._closing:
            self.fatal_error = reason
            log.error("tensor-parallel engine failed: %s", reason)

    def _collective(self, what: str, fn, *args, **kwargs):
        if self.fatal_error is not None:
            raise TensorParallelError(self.fatal_error)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the group unusable
            # A peer that closed its connection has usually just died: name
            # it if it is a local worker (its exit shows within a moment).
            self.fail(self._dead_worker(wait=1.0) or
                      f"{what} failed on rank {self.rank}: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}")
            raise TensorParallelError(self.fatal_error or str(exc)) from exc

    def _dead_worker(self, wait: float = 0.0) -> str | None:
        deadline = time.monotonic() + wait
        while True:
            for process in self._workers:
                if process.exitcode is not None:
                    return (f"tensor-parallel worker {process.name} (pid {process.pid}) "
                            f"exited with code {process.exitcode}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    @property
    def worker_pids(self) -> list[int]:
        """The local worker processes' ids (rank 0)."""
        return [p.pid for p in self._workers]

    def _watch_workers(self, workers: list) -> None:
        self._workers = list(workers)

        def watch() -> None:
            pending = {p.sentinel: p for p in self._workers}
            while pending and not self._closing:
                for sentinel in wait_for_exit(list(pending), timeout=1.0):
                    process = pending.pop(sentinel)
                    process.join(1.0)  # reap it, for its exit code
                    if not self._closing:
                        self.fail(f"tensor-parallel worker {process.name} (pid "
                                  f"{process.pid}) exited with code {process.exitcode}")

        self._start_thread(watch, "baton-tp-watch")

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _store_client(self):
        addr, port = self._store_at
        return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=30))

    def _beat(self) -> None:
        """Ranks > 0: count up this rank's heartbeat key until the group
        closes or the store (rank 0) is gone."""
        interval = self.config.heartbeat_timeout / 5

        def beat() -> None:
            try:
                store = self._store_client()
                while not self._closing:
                    store.add(f"baton/heartbeat/{self.rank}", 1)
                    self._stop.wait(interval)
            except Exception:  # noqa: BLE001 - rank 0 has gone; its death is seen elsewhere
                log.debug("tensor-parallel rank %d stops its heartbeat", self.rank,
                          exc_info=True)

        self._start_thread(beat, "baton-tp-heartbeat")

    def _watch_heartbeats(self) -> None:
        """Rank 0: fail the group when a rank's heartbeat has not moved for
        ``heartbeat_timeout`` seconds."""
        timeout = self.config.heartbeat_timeout
        interval = timeout / 5

        def watch() -> None:
            try:
                store = self._store_client()
            except Exception:  # noqa: BLE001
                log.exception("tensor-parallel heartbeat watch could not reach the store")
                return
            now = time.monotonic()
            last = {rank: (-1, now) for rank in range(1, self.size)}
            while not self._closing and self.fatal_error is None:
                now = time.monotonic()
                for rank, (count, since) in last.items():
                    try:
                        beats = store.add(f"baton/heartbeat/{rank}", 0)
                    except Exception:  # noqa: BLE001 - the store lives in this process
                        return
                    if beats != count:
                        last[rank] = (beats, now)
                    elif now - since > timeout:
                        self.fail(f"tensor-parallel rank {rank} has not answered for "
                                  f"{now - since:.0f} s (no heartbeat; it hangs or was "
                                  f"stopped)")
                        return
                self._stop.wait(interval)

        self._start_thread(watch, "baton-tp-heartbeats")

    # ------------------------------------------------------------ the steps
    def broadcast_step(self, rows, spans: list[tuple[int, int]]) -> None:
        """Rank 0: send this step's rows (in batch order) and the row spans
        whose prompt logprobs it computes to every other rank."""
        message = ([ForwardRow(r.token_ids, r.start_pos, r.block_table, r.sample,
                               getattr(r, "pooling", None) is not None,
                               tuple(getattr(r, "spec_token_ids", ())))
                    for r in rows], spans)
        self._collective("the step broadcast", dist.broadcast_object_list, [message],
                         src=0, group=self.control)

    def receive_step(self) -> tuple[list[ForwardRow], list[tuple[int, int]]] | None:
        """Ranks > 0: wait for the next step; None when rank 0 stops."""
        box = [None]
        self._collective("waiting for the next step", dist.broadcast_object_list, box,
                         src=0, group=self.control)
        return box[0]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._collective("an all-reduce", dist.all_reduce, tensor, group=self.compute)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's ``tensor`` side by side along the last
        dimension; other ranks get their own back (and need nothing)."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        self._collective("the logits gather", dist.gather, tensor, parts, dst=0,
                         group=self.compute)
        return torch.cat(parts, dim=-1) if parts is not None else tensor

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over all ranks (e.g. KV blocks every rank
        can hold)."""
        box = torch.tensor([value], dtype=torch.int64)
        self._collective("agreeing on the KV cache size", dist.all_reduce, box,
                         op=dist.ReduceOp.MIN, group=self.control)
        return int(box.item())

    # -------------------------------------------------------------- closing
    def close(self, join_timeout: float = 10.0) -> None:
        """Rank 0: tell the workers to stop and wait for them. Every rank
        leaves the process groups."""
        if self._closing:
            return
        if self.rank == 0 and self.fatal_error is None:
            try:
                self._collective("the stop broadcast", dist.broadcast_object_list, [None],
                                 src=0, group=self.control)
            except TensorParallelError:
                pass
        self._closing = True
        self._stop.set()
        deadline = time.monotonic() + join_timeout
        for process in self._workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("tensor-parallel worker %s did not stop; terminating it",
                            process.name)
                process.terminate()
                process.join(2.0)
        # No thread of the group outlives it: one that did could be the last
        # holder of the process groups at interpreter exit, whose destructor
        # releases the GIL mid-finalization and aborts the process.
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()) + 2.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed group may not tear down cleanly
                log.debug("leaving the process group failed", exc_info=True)


def _wait_for_ranks(store, size: int, workers: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    keys = [f"baton/joined/{r}" for r in range(size)]
    while not store.check(keys):
        time.sleep(RENDEZVOUS_POLL)
        dead = [p for p in workers if not p.is_alive()]
        if dead:
            raise TensorParallelError(
                f"tensor-parallel worker {dead[0].name} exited with code {dead[0].exitcode} "
                f"before every rank had joined (its log says why)")
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            raise TensorParallelError(
                f"tensor-parallel ranks {', '.join(missing)} did not join within "
                f"{timeout:.0f} s")
