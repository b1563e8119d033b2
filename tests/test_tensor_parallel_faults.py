"""A tensor-parallel rank that dies or hangs fails the engine cleanly, over
HTTP: /health answers 503 naming the rank within seconds, the stream in
flight ends with an error event, later requests are refused at once with 503
and Retry-After; nothing hangs."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from backends.parallel.config import ParallelConfig
from backends.interface import SamplingParams
from tests.engine_helpers import make_engine, run_all
from tests.server_helpers import running_server

# Slow (tensor-parallel ranks in processes, killed and stopped): the full suite runs these,
# ./scripts/test.sh --quick does not.
pytestmark = pytest.mark.slow


def _health(base_url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_killed_rank_fails_the_engine_cleanly(tiny_llama_dir):
    threads = torch.get_num_threads()
    core = make_engine(tiny_llama_dir, parallel=ParallelConfig(tensor_parallel_size=2,
                                                               pin_cpus=False))
    try:
        with running_server(core) as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x",
                                   max_retries=0, timeout=30)
            reply = client.completions.create(model=core.model_name, prompt=[5, 6, 7],
                                              max_tokens=3, temperature=0)
            assert reply.choices[0].finish_reason == "length"
            assert _health(server.base_url)[0] == 200

            stream = client.completions.create(
                model=core.model_name, prompt=[5, 6, 7, 8], max_tokens=400, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))
            (pid,) = core.backend.parallel.worker_pids
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(openai.APIError) as failed:
                for _ in stream:
                    pass
            assert "rank 1" in str(failed.value), failed.value

            deadline = time.monotonic() + 10
            while _health(server.base_url)[0] == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            status, reason = _health(server.base_url)
            assert status == 503 and "rank 1" in reason, (status, reason)

            _assert_refused_with_503(server.base_url, core.model_name)
    finally:
        core.backend.shutdown()
        torch.set_num_threads(threads)


def _assert_refused_with_503(base_url: str, model: str) -> None:
    """Later requests are refused at once (before: a 500 from the failed
    step), in the error envelope, naming the cause, for another replica."""
    request = urllib.request.Request(
        base_url + "/v1/completions", method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "prompt": [9, 10], "max_tokens": 2}).encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    body = json.loads(refused.value.read())
    assert refused.value.code == 503, body
    assert refused.value.headers["Retry-After"] and "rank 1" in body["error"]["message"]


def test_a_rank_that_stops_answering_turns_health_503_within_seconds(tiny_llama_dir):
    """Before: while a rank hung (here: stopped), /health stayed 200 for the
    whole collective timeout (--distributed-timeout, 60 s by default)."""
    threads = torch.get_num_threads()
    core = make_engine(tiny_llama_dir, parallel=ParallelConfig(
        tensor_parallel_size=2, pin_cpus=False, heartbeat_timeout=1.0))
    (pid,) = core.backend.parallel.worker_pids
    try:
        with running_server(core) as server:
            time.sleep(2.0)  # heartbeats flow while the engine idles
            assert _health(server.base_url)[0] == 200
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 15
            while _health(server.base_url)[0] == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            status, reason = _health(server.base_url)
            assert status == 503 and "rank 1" in reason and "answered" in reason, reason
            _assert_refused_with_503(server.base_url, core.model_name)
    finally:
        os.kill(pid, signal.SIGKILL)
        core.backend.shutdown()
        torch.set_num_threads(threads)


def test_a_worker_that_dies_while_the_engine_idles_fails_the_group():
    """No step needs to touch the dead rank: rank 0's watch on its workers
    fails the group within seconds, naming the rank and its exit code, and
    that is what /health reads (backend.fatal_error)."""
    import multiprocessing

    from backends.parallel.group import TensorParallelGroup
    group = TensorParallelGroup(ParallelConfig(tensor_parallel_size=2), 0,
                                torch.device("cpu"), None, None)
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,),
                                                         name="rank 1", daemon=True)
    worker.start()
    group._watch_workers([worker])
    assert group.fatal_error is None
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while group.fatal_error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group.fatal_error == (f"tensor-parallel worker rank 1 (pid {worker.pid}) "
                                 f"exited with code -9"), group.fatal_error


def test_closing_the_group_leaves_no_thread_of_it_running(tiny_llama_dir):
    """Shutting a tensor-parallel engine down joins the group's watch and
    heartbeat threads. One that outlived it could be the last holder of the
    process groups when the interpreter exits: their destructor then released
    the GIL mid-finalization and the process aborted ("terminate called
    without an active exception", exit 134, after every test had passed)."""
    import threading
    sharded = make_engine(tiny_llama_dir, block_size=4, num_kv_blocks=64,
                          parallel=ParallelConfig(tensor_parallel_size=2, pin_cpus=False))
    threads = torch.get_num_threads()
    try:
        assert any(t.name.startswith("baton-tp-") for t in threading.enumerate())
        run_all(sharded, {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12]},
                SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finally:
        sharded.backend.shutdown()
        torch.set_num_threads(threads)
    assert [t.name for t in threading.enumerate() if t.name.startswith("baton-tp-")] == []
