"""AsyncEngine: streaming deltas, aborts that free blocks, engine faults that
fail only their step, and an event loop that stays responsive while the
model computes."""

from __future__ import annotations

import asyncio
import time

import pytest

from backends.interface import SamplingParams
from scheduler.async_engine import AsyncEngine
from tests.engine_helpers import assert_all_free, make_engine, run_all

PROMPT = [5, 17, 99, 230, 41, 8, 77]


@pytest.fixture
async def engine(tiny_llama_dir):
    eng = AsyncEngine(make_engine(tiny_llama_dir))
    eng.start()
    yield eng
    await eng.shutdown()


async def _collect(engine, prompt, params, request_id=None):
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
    return outs


async def test_stream_matches_sync_engine(engine, tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = await _collect(engine, PROMPT, params)
    assert [o.finished for o in outs] == [False] * 11 + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 12
    sync = run_all(make_engine(tiny_llama_dir), {"a": PROMPT}, params)["a"]
    assert [t for o in outs for t in o.new_token_ids] == sync.token_ids
    assert "".join(o.text for o in outs) == sync.text
    assert_all_free(engine.core)


async def test_text_prompt_is_tokenized(engine):
    outs = await _collect(engine, "Hello, world!", SamplingParams(max_tokens=3, ignore_eos=True))
    tok = engine.core.tokenizer
    assert outs[-1].num_prompt_tokens == len(tok.encode("Hello, world!"))


async def test_concurrent_requests_and_abort_on_break(engine):
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=3)

    async def leave_early(rid):
        async for out in engine.generate(PROMPT, params, rid):
            if out.num_output_tokens >= 3:
                break

    full = asyncio.create_task(_collect(engine, PROMPT, params, "full"))
    await asyncio.gather(*(leave_early(f"quit{i}") for i in range(5)))
    outs = await full
    assert outs[-1].num_output_tokens == 40
    await asyncio.sleep(0.05)
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert_all_free(engine.core)


async def test_abort_by_id_ends_stream_with_abort(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    rid = engine.add_request(PROMPT, params)
    seen = []
    async for out in engine.stream(rid):
        seen.append(out)
        if len(seen) == 2:
            engine.abort(rid)
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert_all_free(engine.core)


async def test_engine_fault_fails_only_its_step(engine):
    backend = engine.core.backend
    real = backend.execute

    def flaky(output):
        if any(r.request_id.startswith("doomed") for r in output.requests):
            raise RuntimeError("simulated device fault")
        return real(output)

    backend.execute = flaky
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    doomed = await asyncio.gather(_collect(engine, PROMPT, params, "doomed-1"),
                                  _collect(engine, PROMPT, params, "doomed-2"))
    for outs in doomed:
        assert outs[-1].finish_reason == "error"
        assert "simulated device fault" in outs[-1].error
    ok = await _collect(engine, PROMPT, params, "fine")
    assert ok[-1].finish_reason == "length" and ok[-1].num_output_tokens == 5
    assert engine.is_running
    assert_all_free(engine.core)


@pytest.mark.slow
async def test_loop_keeps_ticking_during_long_prefill():
    """A real model (the embedded SmolLM2, float32) prefilling 1,500 tokens in
    one step: timers on the event loop must keep firing meanwhile."""
    core = make_engine(None, max_num_batched_tokens=2048, max_model_len=2048,
                       num_kv_blocks=160)
    engine = AsyncEngine(core)
    engine.start()
    ticks: list[float] = []
    stop = asyncio.Event()

    async def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    timer = asyncio.create_task(ticker())
    try:
        t0 = time.monotonic()
        outs = await _collect(engine, list(range(100, 1600)), SamplingParams(max_tokens=1))
        step = time.monotonic() - t0
    finally:
        stop.set()
        await timer
        await engine.shutdown()
    assert outs[-1].finished
    during = [t for t in ticks if t0 <= t <= t0 + step]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert step > 0.3, "the prefill was too quick to show anything"
    assert len(during) >= 10 and max(gaps) < step / 3, (step, len(during), max(gaps))


async def test_a_burst_reaching_an_idle_engine_is_prefilled_together(engine, monkeypatch):
    """Requests arriving one after another within the admission quiet period
    all go into the first step (not the first arrival alone, with the rest
    waiting for its prefill); a busy engine never waits for arrivals."""
    from scheduler import async_engine
    # Generous periods: the test must hold on a loaded machine.
    monkeypatch.setattr(async_engine, "ADMISSION_QUIET_S", 0.5)
    monkeypatch.setattr(async_engine, "ADMISSION_WINDOW_S", 5.0)
    steps = []
    engine.step_observers.append(lambda stats: steps.append(sorted(stats.request_ids)))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = []
    for i in range(3):
        ids.append(engine.add_request(PROMPT[:5 + i], params, f"burst{i}"))
        await asyncio.sleep(0.05)  # handlers add their requests in turn
    outs = await asyncio.gather(*(_drain(engine, rid) for rid in ids))
    assert steps[0] == sorted(ids)
    assert all(o[-1].num_output_tokens == 4 for o in outs)
    # the engine was busy through the three decode steps: no wait between them
    assert len(steps) == 4
    assert_all_free(engine.core)


async def _drain(engine, request_id):
    return [out async for out in engine.stream(request_id)]
