"""How much CPU other processes used while a benchmark measured a server.

On a small or shared machine another process that takes a core for a few
seconds halves a server's throughput (Baton's thread governor drops to one
thread; a server without one spins its OpenMP barriers), and the figures of
that round say nothing about the server. ``LoadWindow`` reads, between
``start()`` and ``stop()``, the CPU time of the whole machine (/proc/stat),
of this process (the load generator) and of the measured server's process
group, and reports what the rest of the machine used: about 0 on a quiet
machine, 1.0 when something else kept a core busy throughout. Linux only
(elsewhere every figure is None).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from backends.cpu_usage import PROC as _PROC
from backends.cpu_usage import machine_busy_seconds, own_cpu_seconds

__all__ = ["LoadReport", "LoadWindow", "machine_busy_seconds", "process_group_seconds"]


def process_group_seconds(pgid: int, proc: Path = _PROC) -> float:
    """CPU seconds (user + system) of the live processes of group ``pgid``.
    Processes that exited are not counted (their time went to a parent that
    waited for them, which is counted if it is in the group)."""
    total = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields follow the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        # fields[0] is the state (field 3 of proc(5)): pgrp is field 5, utime 14, stime 15
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class LoadReport:
    """CPU use over one measurement window, in CPUs (CPU seconds per second)."""

    wall_s: float
    machine: float          # every process on the machine
    client: float           # this process (the load generator)
    server: float | None    # the measured server's process group (None: not known)
    others: float | None    # the rest: what disturbed the measurement

    def to_dict(self) -> dict[str, float | None]:
        return {k: (None if v is None else round(v, 3)) for k, v in (
            ("wall_s", self.wall_s), ("machine_cpus", self.machine),
            ("client_cpus", self.client), ("server_cpus", self.server),
            ("other_cpus", self.others))}


class LoadWindow:
    """``start()`` ... ``stop()`` -> LoadReport (None off Linux).
    ``server_pgid``: the server's process group (a server this process
    started in a session of its own), None when the server runs elsewhere:
    then ``others`` is None too, since the server's own use cannot be told
    apart."""

    def __init__(self, server_pgid: int | None = None, proc: Path = _PROC) -> None:
        self.server_pgid = server_pgid
        self._proc = proc
        self._start: tuple[float, float, float, float | None] | None = None

    def _sample(self) -> tuple[float, float, float, float | None] | None:
        machine = machine_busy_seconds(self._proc)
        if machine is None:
            return None
        server = None if self.server_pgid is None else \
            process_group_seconds(self.server_pgid, self._proc)
        return time.monotonic(), machine, own_cpu_seconds(), server

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> LoadReport | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        wall = max(end[0] - self._start[0], 1e-9)
        machine = (end[1] - self._start[1]) / wall
        client = (end[2] - self._start[2]) / wall
        server = others = None
        if end[3] is not None and self._start[3] is not None:
            server = max(0.0, end[3] - self._start[3]) / wall
            others = max(0.0, machine - client - server)
        return LoadReport(wall, machine, client, server, others)
