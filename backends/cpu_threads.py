"""How many CPU threads the model's math uses, adjusted to what other
processes leave free.

On a small machine another busy process turns every OpenMP barrier into a
wait for a descheduled thread: with two threads on two cores and one core
taken, inter-token latency rose from ~38 ms to ~470 ms (the waiting threads
spin through their time slices). One thread fewer than the cores the others
leave free avoids that. ``ThreadGovernor`` samples, at most once per
``interval`` seconds and at the start of a step, how much CPU time the rest
of the machine used (``/proc/stat`` minus this process's own share) and sets
torch's thread count to the cores left: fewer at once when others are busy,
more again only after the machine has been quiet for two samples in a row.
The hypervisor's steal does not count: no process in the machine can use a
core that fewer threads leave free, and a step on one thread is much slower
(a one-row bf16 decode step of SmolLM2-135M: 21.1 ms against 12.4-13.1 ms on
two, Xeon model 207), so on a VM whose host is busy it would only lose
(benchmarks/machine_load.py's load report does count steal, to mark a
disturbed measurement). Nor does work this process runs in child processes
(the compile's C++ compiler workers, ``own_child_work``): the samples start
afresh after it.

Pure bookkeeping around two clocks: a sample costs tens of microseconds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from backends.cpu_usage import machine_busy_seconds, own_cpu_seconds

log = logging.getLogger("baton.backend")

# torch's own default (one thread per physical core), taken before any
# governor changes it.
DEFAULT_THREADS = torch.get_num_threads()
_CORES = os.cpu_count() or 1


# Spells of this process's own work in child processes, finished so far.
_child_work = 0


@contextmanager
def own_child_work() -> Iterator[None]:
    """Around work this process runs in child processes (torch.compile's C++
    compiler workers): their CPU time is not in this process's own, yet it
    is this engine's work, not another process's load. Every governor starts
    a fresh sample after it instead of reading it as load (read as load, the
    first steps after a compile ran on one thread, ~1.7x slower)."""
    global _child_work
    try:
        yield
    finally:
        _child_work += 1


@dataclass(slots=True)
class _Sample:
    wall: float
    system: float
    own: float


class ThreadGovernor:
    """Keeps torch's intra-op thread count at the cores other processes
    leave free, between 1 and ``max_threads``. Call ``before_step()`` from
    the thread that runs the model (OpenMP's thread count is per calling
    thread)."""

    def __init__(self, max_threads: int, interval: float = 1.0) -> None:
        self.max_threads = max(1, max_threads)
        self.interval = interval
        self.threads = self.max_threads
        self.others_busy = 0.0        # CPUs the rest of the machine used, last sample
        self._quiet_samples = 0
        self._last = self._sample()
        self._child_work = _child_work
        self._applied: int | None = None

    @staticmethod
    def _sample() -> _Sample | None:
        system = machine_busy_seconds(steal=False)
        if system is None:
            return None
        return _Sample(time.monotonic(), system, own_cpu_seconds())

    def before_step(self) -> int:
        """Re-sample if the interval has passed; returns the thread count in force."""
        if self._child_work != _child_work:  # own work in children since: start afresh
            self._child_work = _child_work
            self._last = self._sample()
        elif self._last is not None and time.monotonic() - self._last.wall >= self.interval:
            now = self._sample()
            if now is not None:
                elapsed = now.wall - self._last.wall
                others = (now.system - self._last.system) - (now.own - self._last.own)
                # /proc/stat moves in clock ticks, our own time does not: over
                # a short sample the difference can exceed the machine's cores.
                self.observe(min(float(_CORES), max(0.0, others / elapsed)))
                self._last = now
        if self._applied != self.threads:
            if self._applied is not None:  # a change, not the first setting: rare
                log.info("CPU threads %d -> %d (other processes used %.1f CPUs)",
                         self._applied, self.threads, self.others_busy)
            torch.set_num_threads(self.threads)
            self._applied = self.threads
        return self.threads

    def observe(self, others_busy: float) -> int:
        """Take one sample: other processes used ``others_busy`` CPUs on
        average since the last one. Returns the thread count now wanted."""
        self.others_busy = others_busy
        # A core counts as taken once others use more than half of it.
        free = max(1, min(self.max_threads, self.max_threads - int(self.others_busy + 0.5)))
        if free < self.threads:
            self.threads = free
            self._quiet_samples = 0
        elif free > self.threads:
            self._quiet_samples += 1
            if self._quiet_samples >= 2:
                self.threads = free
                self._quiet_samples = 0
        else:
            self._quiet_samples = 0
        return self.threads
