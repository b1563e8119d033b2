"""The thread governor: fewer threads at once when other processes take
cores, more again only after the machine has stayed quiet."""

from __future__ import annotations

import json
import os

import pytest
import torch

from backends.cpu_threads import ThreadGovernor


def test_governor_yields_taken_cores_at_once_and_takes_them_back_slowly():
    before = torch.get_num_threads()
    try:
        gov = ThreadGovernor(max_threads=4, interval=3600)
        assert gov.threads == 4
        assert gov.observe(0.3) == 4          # a light client: not a core
        assert gov.observe(1.2) == 3          # one core taken: drop at once
        assert gov.observe(2.9) == 1          # three taken
        assert gov.observe(9.0) == 1          # never below one
        assert gov.observe(0.0) == 1          # quiet once: wait
        assert gov.observe(0.1) == 4          # quiet twice: take them back
        assert gov.observe(1.6) == 2
        assert gov.observe(0.9) == 2          # one quiet-ish sample, then busy again
        assert gov.observe(1.5) == 2
        assert gov.before_step() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_governor_samples_this_machine():
    """On Linux the first real sample measures something in [0, cores]."""
    import os
    before = torch.get_num_threads()
    try:
        gov = ThreadGovernor(max_threads=2, interval=0.0)
        x = torch.randn(256, 256)
        for _ in range(20):
            x = x @ x.T / 256
        gov.before_step()
        assert 0.0 <= gov.others_busy <= (os.cpu_count() or 1) + 0.5
        assert 1 <= gov.threads <= 2
    finally:
        torch.set_num_threads(before)


def test_a_short_sample_never_reads_more_cpus_than_the_machine_has(monkeypatch):
    """/proc/stat counts in clock ticks (10 ms) while the process's own time
    comes from getrusage: over a few milliseconds the difference can exceed
    the machine's cores (seen: 2.81 CPUs on two). A sample is bounded by them."""
    import os

    import backends.cpu_threads as ct
    clock = {"wall": 100.0, "system": 50.0, "own": 10.0}
    monkeypatch.setattr(ct.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(ct, "machine_busy_seconds", lambda steal=True: clock["system"])
    monkeypatch.setattr(ct, "own_cpu_seconds", lambda: clock["own"])
    before = torch.get_num_threads()
    try:
        gov = ThreadGovernor(max_threads=2, interval=0.0)
        # 5 ms of wall time; the machine's counter moved three ticks, ours none
        clock.update(wall=100.005, system=50.03)
        gov.before_step()
        assert 0.0 <= gov.others_busy <= (os.cpu_count() or 1)
        assert gov.threads == 1               # the sample still reads "busy"
    finally:
        torch.set_num_threads(before)


def test_hypervisor_steal_is_not_another_process(tmp_path, monkeypatch):
    """/proc/stat's steal column is time the hypervisor gave this VM's vCPUs
    to someone outside it. No process in the machine can use a core that
    fewer threads leave free, so it must not cost the engine a thread: only
    user, nice, system, irq and softirq time of other processes does."""
    import backends.cpu_threads as ct
    from backends.cpu_usage import machine_busy_seconds

    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"

    def write(user: int, steal: int) -> None:
        stat.write_text(f"cpu  {user} 0 0 5000 0 0 0 {steal} 0 0\n")

    write(100, 0)
    assert machine_busy_seconds(tmp_path) == pytest.approx(100 / hz)
    assert machine_busy_seconds(tmp_path, steal=False) == pytest.approx(100 / hz)
    write(100, 40)
    assert machine_busy_seconds(tmp_path) == pytest.approx(140 / hz)  # the load report's view
    assert machine_busy_seconds(tmp_path, steal=False) == pytest.approx(100 / hz)

    clock = {"wall": 100.0, "own": 10.0}
    monkeypatch.setattr(ct.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(ct, "own_cpu_seconds", lambda: clock["own"])
    monkeypatch.setattr(ct, "machine_busy_seconds",
                        lambda steal=True: machine_busy_seconds(tmp_path, steal=steal))
    before = torch.get_num_threads()
    try:
        write(0, 0)
        gov = ThreadGovernor(max_threads=2, interval=0.0)
        # one second: the hypervisor took 1.5 CPUs, this process used none
        clock.update(wall=101.0)
        write(0, int(1.5 * hz))
        gov.before_step()
        assert gov.others_busy == pytest.approx(0.0)
        assert gov.threads == 2
        # the next second another process in the machine takes 1.5 CPUs
        clock.update(wall=102.0)
        write(int(1.5 * hz), int(1.5 * hz))
        gov.before_step()
        assert gov.others_busy == pytest.approx(1.5)
        assert gov.threads == 1
    finally:
        torch.set_num_threads(before)


def test_the_compile_s_workers_are_not_other_processes(tiny_llama_dir, monkeypatch):
    """Compiling the step at start-up runs the C++ compiler in worker
    processes for tens of seconds. Their CPU time is the engine's own work,
    not another process's load: the first steps after it keep every thread
    (they ran on one for the governor's first samples, ~1.7x slower, when it
    counted them)."""
    import time

    import backends.cpu_threads as ct
    from backends.compiled_step import CompiledStep
    from tests.engine_helpers import make_engine

    if ct.DEFAULT_THREADS < 2:
        pytest.skip("one thread: there is no thread to lose")
    busy = {"seconds": 1000.0}
    monkeypatch.setattr(ct, "machine_busy_seconds", lambda steal=True: busy["seconds"])

    def warm_up(self, block_size, device, progress=True):
        # the compiler's workers keep both cores busy for the compile's time
        time.sleep(1.2)
        busy["seconds"] += 2 * 1.2
        return 1.2

    monkeypatch.setattr(CompiledStep, "warm_up", warm_up)
    before = torch.get_num_threads()
    try:
        core = make_engine(tiny_llama_dir, compile=True)
        governor = core.backend._governor
        assert core.backend.compile_seconds == 1.2
        assert governor.before_step() == governor.max_threads == ct.DEFAULT_THREADS
        # A draft model's backend compiles after the target's is built: the
        # target's governor does not count that compile either.
        spec = json.dumps({"method": "draft_model", "model": str(tiny_llama_dir),
                           "num_speculative_tokens": 2})
        core = make_engine(tiny_llama_dir, compile=True, speculative_config=spec)
        assert core.speculator.proposer.backend.compile_seconds == 1.2
        for backend in (core.backend, core.speculator.proposer.backend):
            assert backend._governor.before_step() == ct.DEFAULT_THREADS
    finally:
        torch.set_num_threads(before)


_STEP_ON_ANOTHER_THREAD = """
import os, sys, time
from concurrent.futures import ThreadPoolExecutor
from backends.interface import SamplingParams
from service.config import EngineArgs
from service.engine_factory import create_engine, create_engine_on_passing_thread
args = EngineArgs(model=sys.argv[2], dtype="float32", num_kv_blocks=64, threads=2, seed=1)
build = create_engine_on_passing_thread if sys.argv[1] == "passing" else create_engine
core = build(args)
steps = ThreadPoolExecutor(1)  # as AsyncEngine runs them
core.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=8, ignore_eos=True))
while core.has_unfinished():
    steps.submit(core.step).result()
time.sleep(1.0)  # a pool whose thread ended lets its workers go: give them time to exit
print(len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts a Linux process's threads, with two cores or more")
def test_an_engine_loaded_for_another_thread_leaves_no_openmp_threads_behind(tiny_llama_dir):
    """OpenMP keeps a pool of threads per thread that ran a parallel region;
    two pools (the loading thread's and the stepping thread's) make libgomp
    stop spinning between regions, and every step waits on wake-ups. Loaded
    on a thread that ends, the engine leaves one pool: the step thread's
    (threads=2: one OpenMP worker less than a load on the main thread)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def threads_after(load: str) -> int:
        out = subprocess.run([sys.executable, "-c", _STEP_ON_ANOTHER_THREAD, load,
                              str(tiny_llama_dir)], cwd=root, capture_output=True, text=True,
                             timeout=300, check=True)
        return int(out.stdout.split()[-1])

    assert threads_after("passing") == threads_after("main") - 1
