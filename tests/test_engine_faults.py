"""Faults are contained: a step that raises for one request, or NaN logits in
one row, fail that request alone, with a clear error; the others finish with
exactly the tokens they get without the fault."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest

from backends.interface import SamplingParams
from service.config import ServerConfig
from tests.engine_helpers import assert_all_free, make_engine, run_all
from tests.fault_backend import inject_faults
from tests.server_helpers import running_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, seed=7)
PROMPTS = {"a": [5, 17, 99, 230, 41], "b": [8, 77, 300, 12], "c": [400, 3, 3, 9, 250, 61],
           "d": [11, 12, 13], "culprit": [70, 71, 72, 73]}
PARAMS = {"a": GREEDY, "b": SEEDED, "c": GREEDY, "d": SEEDED, "culprit": GREEDY}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Every request's tokens with no fault at all, in the same batches."""
    return run_all(make_engine(tiny_llama_dir), PROMPTS, PARAMS)


def _innocents_unharmed(results, reference) -> None:
    for rid in ("a", "b", "c", "d"):
        assert results[rid].finish_reason == "length", rid
        assert results[rid].token_ids == reference[rid].token_ids, rid


def test_step_that_raises_for_one_request(tiny_llama_dir, reference):
    core = make_engine(tiny_llama_dir)
    faults = inject_faults(core)
    faults.raise_for = {"culprit"}
    results = run_all(core, PROMPTS, PARAMS)
    _innocents_unharmed(results, reference)
    culprit = results["culprit"]
    assert culprit.finish_reason == "error" and culprit.token_ids == []
    assert_all_free(core)


def test_step_that_raises_late_for_one_request(tiny_llama_dir, reference):
    """The culprit fails mid-generation, after tokens of its own."""
    core = make_engine(tiny_llama_dir)
    faults = inject_faults(core)
    real_execute = faults.execute
    seen = {"n": 0}

    def execute(output):
        if any(r.request_id == "culprit" for r in output.requests):
            seen["n"] += 1
            if seen["n"] == 4:
                faults.raise_for = {"culprit"}
        return real_execute(output)

    faults.execute = execute
    results = run_all(core, PROMPTS, PARAMS)
    _innocents_unharmed(results, reference)
    culprit = results["culprit"]
    assert culprit.finish_reason == "error"
    assert culprit.token_ids == reference["culprit"].token_ids[:len(culprit.token_ids)]
    assert 0 < len(culprit.token_ids) < 8
    assert_all_free(core)


def test_nan_logits_for_one_row(tiny_llama_dir, reference):
    core = make_engine(tiny_llama_dir)
    faults = inject_faults(core)
    faults.nan_for = {"culprit"}
    outputs = []
    for rid, ids in PROMPTS.items():
        core.add_request(rid, ids, PARAMS[rid])
    while core.has_unfinished():
        outcome = core.step()
        outputs.extend(outcome.outputs)
        assert not outcome.failed
    final = {o.request_id: o for o in outputs if o.finished}
    assert final["culprit"].finish_reason == "error"
    assert "non-finite logits" in final["culprit"].error
    for rid in ("a", "b", "c", "d"):
        tokens = [t for o in outputs if o.request_id == rid for t in o.new_token_ids]
        assert tokens == reference[rid].token_ids, rid
    assert_all_free(core)


def test_every_request_failing_marks_the_step_failed(tiny_llama_dir):
    core = make_engine(tiny_llama_dir)
    faults = inject_faults(core)
    faults.raise_for = set(PROMPTS)
    for rid, ids in PROMPTS.items():
        core.add_request(rid, ids, PARAMS[rid])
    outcome = core.step()
    assert outcome.failed and "injected fault" in outcome.fault
    assert sorted(o.request_id for o in outcome.outputs) == sorted(PROMPTS)
    assert all(o.finish_reason == "error" and "injected fault" in o.error
               for o in outcome.outputs)
    assert outcome.stats.num_faulted == len(PROMPTS)
    assert_all_free(core)


@pytest.mark.slow
def test_step_that_hangs_for_one_request(tiny_llama_dir, reference):
    """The step hangs whenever the culprit is in it: after step_timeout it is
    abandoned and run again in halves; the culprit fails, the others are
    unharmed. The abandoned threads coming back later taint the engine
    (they may have written KV blocks others own by then)."""
    core = make_engine(tiny_llama_dir)
    core.step_timeout = 2.0  # far above a tiny-model step, even on a loaded machine
    faults = inject_faults(core)
    faults.hang_for = {"culprit"}
    prompts = {rid: PROMPTS[rid] for rid in ("a", "b", "culprit")}
    try:
        results = run_all(core, prompts, PARAMS)
        for rid in ("a", "b"):
            assert results[rid].token_ids == reference[rid].token_ids, rid
        assert results["culprit"].finish_reason == "error"
        assert core.num_abandoned_steps >= 2 and core.tainted is None
    finally:
        faults.release.set()
        core.close()
    deadline = time.monotonic() + 10
    while core.tainted is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.tainted and "restart" in core.tainted


# ------------------------------------------------------------ over HTTP

STREAM = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.0, "stream": True}
POISON = 444


async def _stream_text(http, prompt: list[int]) -> tuple[str, list[dict]]:
    async with http.post("/v1/completions", json={**STREAM, "prompt": prompt}) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), chunks


async def test_one_bad_request_does_not_stop_other_streams(tiny_llama_dir):
    """Issue 15, defect 2: four clients streaming while a request whose step
    raises joins: it alone gets a 500; the four stream on to the same text."""
    core = make_engine(tiny_llama_dir)
    faults = inject_faults(core)
    faults.poison_token = POISON
    prompts = [[5 + i, 17, 99, 230] for i in range(4)]
    with running_server(core) as srv:
        async with aiohttp.ClientSession(base_url=srv.base_url,
                                         timeout=aiohttp.ClientTimeout(total=120)) as http:
            reference = await asyncio.gather(*(_stream_text(http, p) for p in prompts))
            await _until_steps(srv, 1)
            streams = [asyncio.create_task(_stream_text(http, p)) for p in prompts]
            await _until_steps(srv, srv.engine.num_steps + 3)  # the four are decoding
            async with http.post("/v1/completions", json={
                    "prompt": [POISON, 1, 2], "max_tokens": 5}) as resp:
                assert resp.status == 500
                error = (await resp.json())["error"]
            assert "injected fault" in error["message"]
            results = await asyncio.gather(*streams)
        for (text, chunks), (ref_text, _) in zip(results, reference):
            assert text == ref_text
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert not any("error" in c for c in chunks)
        srv.wait_idle()


async def _until_steps(srv, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while srv.engine.num_steps < n:
        assert time.monotonic() < deadline, "the engine made no progress"
        await asyncio.sleep(0.005)


async def test_health_turns_503_after_failed_steps_and_recovers(tiny_llama_dir):
    """Issue 15, defect 3: /health sees a broken engine (every step failing),
    says why, and the fault counter is on /metrics; one good step heals it."""
    core = make_engine(tiny_llama_dir)
    faults = inject_faults(core)
    config = ServerConfig(unhealthy_after_failed_steps=3)
    with running_server(core, config) as srv:
        async with aiohttp.ClientSession(base_url=srv.base_url) as http:
            faults.fail_every_step = True
            for i in range(3):
                async with http.get("/health") as resp:
                    assert resp.status == 200, await resp.text()
                async with http.post("/v1/completions",
                                     json={"prompt": [5, 6, 7], "max_tokens": 3}) as resp:
                    assert resp.status == 500
            async with http.get("/health") as resp:
                assert resp.status == 503
                reason = await resp.text()
            assert "3 engine steps failed" in reason and "every step fails" in reason
            async with http.get("/metrics") as resp:
                metrics = await resp.text()
            assert re.search(r'^baton_engine_faults_total\{[^}]*\} 3\.0$', metrics, re.M)
            faults.fail_every_step = False
            async with http.post("/v1/completions",
                                 json={"prompt": [5, 6, 7], "max_tokens": 3}) as resp:
                assert resp.status == 200
            async with http.get("/health") as resp:
                assert resp.status == 200 and await resp.text() == "ok"
        srv.wait_idle()
