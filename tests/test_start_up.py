"""Start-up: progress lines off a terminal, the warm-up that runs before
/health turns ready, and the KV pool that costs nothing until used."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from backends.device import zeros_lazily
from backends.progress import Progress, heartbeat
from service.warmup import BATCHES, OUTPUT_TOKENS, warm_up
from tests.engine_helpers import make_engine


def test_progress_lines_say_what_and_how_far(caplog):
    with caplog.at_level(logging.INFO, logger="baton.progress"):
        with Progress("reading model.gguf", 300 * 2**20, "B", interval=0.05) as progress:
            for _ in range(3):
                time.sleep(0.06)
                progress.update(100 * 2**20)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("reading model.gguf: 100 MiB of 300 MiB (33%)")
               for line in lines), lines
    assert lines[-1].startswith("reading model.gguf: done, 300 MiB in ")


def test_quick_steps_and_disabled_progress_write_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="baton.progress"):
        with Progress("quick", 10, "tensors", interval=5.0) as progress:
            progress.update(10)
        with Progress("off", 10, interval=0.0, enabled=False) as progress:
            progress.update(10)
        with heartbeat("nothing to wait for", interval=5.0):
            pass
    assert not caplog.records


def test_heartbeat_for_steps_that_cannot_count(caplog):
    with caplog.at_level(logging.INFO, logger="baton.progress"):
        with heartbeat("building the kernels", lambda: "3 of 4 files", interval=0.05):
            time.sleep(0.18)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("building the kernels: 3 of 4 files, ") for line in lines)
    assert lines[-1].startswith("building the kernels: done in ")


def test_nested_heartbeats_speak_one_at_a_time(caplog):
    """While a step opened inside another runs, only the inner one writes
    (start-up logged two "still working" lines every 5 s, one of them the
    backend's around the compile), and a step that logs its own result line
    ends without a "done" line."""
    with caplog.at_level(logging.INFO, logger="baton.progress"):
        with heartbeat("preparing", interval=0.05, done_line=False):
            time.sleep(0.25)
            with heartbeat("compiling", interval=0.05, done_line=False):
                time.sleep(0.3)
            inner_done = len(caplog.records)
            time.sleep(0.25)
    lines = [r.getMessage() for r in caplog.records]
    inner = [i for i, line in enumerate(lines) if line.startswith("compiling")]
    assert len(inner) >= 3, lines
    # nothing from the outer step while the inner one ran, and no "done" lines
    assert all(lines[i].startswith("compiling") for i in range(inner[0], inner[-1] + 1))
    assert any(line.startswith("preparing: still working") for line in lines[:inner[0]])
    assert any(line.startswith("preparing: still working") for line in lines[inner_done:])
    assert not [line for line in lines if "done in" in line], lines


def test_a_heartbeat_on_another_thread_is_not_silenced(caplog):
    """Nesting is per thread: two loads side by side (a draft model's beside
    its target's, two engines in one process) both speak."""
    import threading
    with caplog.at_level(logging.INFO, logger="baton.progress"):
        with heartbeat("outer", interval=0.05):
            other = threading.Thread(target=lambda: _beat("other", 0.3))
            other.start()
            time.sleep(0.3)
            other.join()
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("outer: still working") for line in lines) >= 3, lines
    assert sum(line.startswith("other: still working") for line in lines) >= 3, lines
    assert lines[-1].startswith("outer: done in ")


def _beat(what: str, seconds: float) -> None:
    with heartbeat(what, interval=0.05):
        time.sleep(seconds)


def test_the_kv_pool_is_zero_and_costs_nothing_until_touched():
    shape, dtype = (64 * 2**20, 2, 2), torch.bfloat16  # 512 MiB
    rss = _rss_bytes()
    pool = zeros_lazily(shape, dtype, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    if rss is not None:
        assert _rss_bytes() - rss < 64 * 2**20  # not resident before use
    assert not pool[::4096].any()  # reads zeros (and touches a few pages)
    pool[123, 1, 0] = 2.5
    assert float(pool.sum()) == 2.5
    view = pool[100:200]
    del pool
    assert float(view.sum()) == 2.5  # the view keeps the mapping alive


def _mapping_flags(tensor: torch.Tensor) -> set[str] | None:
    """The VmFlags of the /proc/self/smaps entry holding the tensor's data;
    None only where there is no smaps to read (off Linux)."""
    try:
        smaps = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    address, inside = tensor.data_ptr(), False
    for line in smaps:
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no smaps entry with VmFlags holds {address:#x}")


def test_the_kv_pool_is_private_memory_in_small_pages():
    """Private anonymous memory faults in cheaper than shared (shmem) memory
    (a 256 MiB first touch: ~150 ms shared, ~109 ms private, Xeon model 207).
    And the pool declines transparent huge pages: on a VM with free page
    reporting (virtio-balloon) a 2 GiB first touch took 8.3-9.4 s in 2 MiB
    pages against 0.41-0.44 s in 4 KiB pages (Xeon model 167), and a served
    c=32 prefill step of 512 tokens ran twice as long while it touched new
    blocks."""
    pool = zeros_lazily((8 * 2**20, 2), torch.bfloat16, torch.device("cpu"))  # 32 MiB
    flags = _mapping_flags(pool)
    if flags is None:
        pytest.skip("no /proc/self/smaps here")
    assert "sh" not in flags  # not shared
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "nh" in flags and "hg" not in flags  # MADV_NOHUGEPAGE


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except OSError:
        return None


@pytest.mark.parametrize("max_num_seqs", [32, 2])
def test_warm_up_runs_lone_and_batched_decodes_and_leaves_nothing(tiny_llama_dir,
                                                                  max_num_seqs):
    core = make_engine(tiny_llama_dir, max_num_seqs=max_num_seqs, num_kv_blocks=64)
    report = warm_up(core)
    batches = [min(b, max_num_seqs) for b in BATCHES]
    # and one request under a structured-output constraint (the grammar engine)
    assert report.requests == sum(batches) + 1
    # each batch: a prefill step and OUTPUT_TOKENS - 1 decode steps (at least)
    assert report.steps >= len(batches) * OUTPUT_TOKENS
    assert not any(core.state_sizes().values())
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_warm_up_measures_a_draft_models_cost(tiny_llama_dir):
    """With a draft model the warm-up times the draft's rounds against the
    target's steps, so no user request has to probe them; the cold passes
    before do not count, and nothing is left behind."""
    import json

    from scheduler.speculative import COST_SAMPLES
    spec = json.dumps({"method": "draft_model", "model": str(tiny_llama_dir),
                       "num_speculative_tokens": 3})
    core = make_engine(tiny_llama_dir, speculative_config=spec)
    budget = core.speculator.budget
    report = warm_up(core)
    assert budget.draft_cost is not None
    assert budget._draft_n >= COST_SAMPLES and budget._target_n >= COST_SAMPLES
    batches = [min(b, core.config.max_num_seqs) for b in BATCHES]
    assert report.requests > sum(batches) + 1  # the calibration request(s)
    assert not any(core.state_sizes().values())
    assert core.speculator.request_ids == set()
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
