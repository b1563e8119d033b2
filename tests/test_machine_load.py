"""benchmarks/machine_load.py: what other processes used while a server was measured."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compare import DISTURBED_CPUS, _load_note, disturbed_rounds
from benchmarks.machine_load import (LoadReport, LoadWindow, machine_busy_seconds,
                                     process_group_seconds)

HZ = os.sysconf("SC_CLK_TCK")


def _stat_line(pid: int, comm: str, pgrp: int, utime: int, stime: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    return f"{pid} ({comm}) S 1 {pgrp} {pgrp} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n"


def test_proc_parsing_on_a_fake_tree(tmp_path):
    (tmp_path / "stat").write_text(
        "cpu  100 20 30 5000 7 1 2 3 0 0\ncpu0 50 10 15 2500 3 0 1 1 0 0\n")
    # user + nice + system + irq + softirq + steal, not idle / iowait
    assert machine_busy_seconds(tmp_path) == pytest.approx((100 + 20 + 30 + 1 + 2 + 3) / HZ)
    for pid, comm, pgrp, ut, st in [(10, "baton", 10, 300, 20),
                                    (11, "python (worker) x", 10, 50, 5),  # odd name
                                    (12, "other", 12, 999, 999)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat_line(pid, comm, pgrp, ut, st))
    (tmp_path / "self").mkdir()  # not a pid: skipped
    (tmp_path / "13").mkdir()    # exited meanwhile (no stat): skipped
    assert process_group_seconds(10, tmp_path) == pytest.approx(375 / HZ)
    assert process_group_seconds(99, tmp_path) == 0.0
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert machine_busy_seconds(tmp_path) is None


_BURN = ("import sys, time\n"
         "t = time.process_time()\n"
         "while time.process_time() - t < 0.3: pass\n"
         "print('done', flush=True)\n"
         "time.sleep(60)\n")


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("as_server", [True, False])
def test_a_busy_process_counts_as_server_or_other(as_server):
    """A process that burns 0.3 CPU-seconds during the window shows as the
    server's use when it is the server's process group, else as others'.
    (Other load on the machine only adds to 'others', so the bounds hold on
    a loaded machine too.)"""
    child = subprocess.Popen([sys.executable, "-c", _BURN], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        window = LoadWindow(child.pid if as_server else os.getpgid(0) + 10**7)
        window.start()
        assert child.stdout.readline().strip() == "done"
        report = window.stop()
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert report is not None and report.wall_s > 0
    burnt = 0.3 - 3 / HZ   # /proc counts in ticks
    if as_server:
        assert report.server * report.wall_s >= burnt
    else:
        assert report.server == 0.0
        assert report.others * report.wall_s >= burnt
    assert report.machine * report.wall_s >= burnt


def test_without_a_known_server_others_are_unknown():
    window = LoadWindow(None)
    window.start()
    report = window.stop()
    if report is None:
        pytest.skip("needs Linux /proc")
    assert report.server is None and report.others is None
    assert "CPUs busy" in _load_note(report)


def test_disturbed_rounds_are_named():
    quiet = {"cpu_use": {"other_cpus": 0.01}}
    busy = {"cpu_use": {"other_cpus": DISTURBED_CPUS + 0.5}}
    figures = {"baton": [{"shared-prefix": busy, "multi-turn": quiet},
                         {"shared-prefix": quiet, "multi-turn": quiet}],
               "vllm": [{"shared-prefix": quiet, "multi-turn": {}}]}
    assert disturbed_rounds(figures) == [
        f"baton round 1 shared-prefix: other processes used {DISTURBED_CPUS + 0.5:.2f} CPUs"]
    note = _load_note(LoadReport(10.0, 2.0, 0.05, 1.0, 0.95))
    assert "other processes 0.95 DISTURBED" in note
    assert "DISTURBED" not in _load_note(LoadReport(10.0, 2.0, 0.05, 1.9, 0.05))
