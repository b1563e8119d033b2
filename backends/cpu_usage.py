"""CPU time read from the operating system, free of torch: the whole
machine's busy time (Linux /proc/stat) and this process's own. The thread
governor (backends/cpu_threads.py) and the benchmarks' load report
(benchmarks/machine_load.py) both read them."""

from __future__ import annotations

import os
import resource
from pathlib import Path

PROC = Path("/proc")


def machine_busy_seconds(proc: Path = PROC, steal: bool = True) -> float | None:
    """CPU seconds all CPUs spent busy since boot (user, nice, system, irq,
    softirq, and with ``steal`` the hypervisor's steal: time this VM's vCPUs
    wanted to run and were given to someone outside it; guest time is inside
    user), None without /proc/stat."""
    try:
        fields = (proc / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    busy = sum(ticks[i] for i in ((0, 1, 2, 5, 6, 7) if steal else (0, 1, 2, 5, 6))
               if i < len(ticks))
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds (user + system) this process used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
