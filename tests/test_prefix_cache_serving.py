"""Prefix caching and priorities through a live server: cached tokens in
OpenAI usage (whole and streamed), on the request span and in /metrics; the
priority field (a 400 under fcfs, an order under priority); a disconnect
storm over shared prefixes gives every block back."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from service.cli import add_engine_flags, engine_args_from
from service.config import ServerConfig
from telemetry.tracing import setup_tracing
from tests.engine_helpers import make_engine
from tests.server_helpers import Server, patched_execute, running_server

MODEL = "tiny-llama"
PREFIX = list(range(20, 70))        # 50 token ids: three full blocks of 16


@pytest.fixture(scope="module")
def exporter():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, exporter):
    tracing = setup_tracing(exporter=exporter, detail="request")
    core = make_engine(tiny_llama_dir, num_kv_blocks=512)
    with running_server(core, ServerConfig(), model_name=MODEL, tracing=tracing) as srv:
        yield srv
    tracing.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                         timeout=30)


def _counter(server: Server, name: str) -> float:
    body, _ = server.state.obs.metrics.render()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not exported")


def test_cached_tokens_in_usage_span_and_metrics(server, client, exporter):
    queries = _counter(server, "baton_prefix_cache_queries_total")
    hits = _counter(server, "baton_prefix_cache_hits_total")
    first = client.completions.create(model=MODEL, prompt=PREFIX, max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens == 50
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the same prompt again, streamed: its usage chunk reports the hit
    chunks = list(client.completions.create(
        model=MODEL, prompt=PREFIX, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens == 50 and usage.prompt_tokens_details.cached_tokens == 48
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    # a longer prompt sharing the prefix, whole, with two choices: counted once
    longer = client.completions.create(model=MODEL, prompt=PREFIX + [7, 8, 9], max_tokens=2,
                                       n=2, temperature=0, extra_body={"ignore_eos": True})
    assert longer.usage.prompt_tokens == 53
    assert longer.usage.prompt_tokens_details.cached_tokens == 48
    server.wait_idle()
    assert _counter(server, "baton_prefix_cache_queries_total") - queries == 50 * 2 + 53 * 2
    assert _counter(server, "baton_prefix_cache_hits_total") - hits >= 48 * 2
    # the request span carries the OTel GenAI cache attribute
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans = {s.attributes.get("gen_ai.response.id"): s
                 for s in exporter.get_finished_spans()}
        if first.id in spans and longer.id in spans:
            break
        time.sleep(0.05)
    assert spans[first.id].attributes["gen_ai.usage.cache_read.input_tokens"] == 0
    assert spans[longer.id].attributes["gen_ai.usage.cache_read.input_tokens"] == 48


def test_chat_turns_reuse_the_conversation_so_far(server, client):
    history = [{"role": "system", "content": "You are a helpful assistant. " * 8},
               {"role": "user", "content": "Tell me about the sea."}]
    one = client.chat.completions.create(model=MODEL, messages=history, max_tokens=5,
                                         temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": one.choices[0].message.content},
                {"role": "user", "content": "And the moon?"}]
    two = client.chat.completions.create(model=MODEL, messages=history, max_tokens=5,
                                         temperature=0)
    # at least the system prompt's full blocks came from the cache
    assert two.usage.prompt_tokens_details.cached_tokens >= 32
    assert two.usage.prompt_tokens_details.cached_tokens % 16 == 0
    assert two.usage.prompt_tokens_details.cached_tokens < two.usage.prompt_tokens
    server.wait_idle()


async def test_fcfs_refuses_a_priority_naming_the_field(server):
    async with aiohttp.ClientSession(base_url=server.base_url) as http:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        async with http.post("/v1/completions", json={**body, "priority": 3}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["param"] == "priority"
            assert "--scheduling-policy priority" in error["message"]
        async with http.post("/v1/completions", json={**body, "priority": 0}) as resp:
            assert resp.status == 200
    server.wait_idle()


async def test_priority_server_admits_by_priority(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1)
    gate = threading.Event()
    admitted: list[str] = []

    def wrap(real):
        def held(output):
            for scheduled in output.requests:
                if scheduled.prompt_token_ids is not None:   # its first step
                    admitted.append(scheduled.request_id)
            if not gate.wait(30.0):
                raise RuntimeError("test gate never opened")
            return real(output)
        return held

    with running_server(core, ServerConfig(), model_name=MODEL) as srv, \
            patched_execute(core, wrap):
        async with aiohttp.ClientSession(base_url=srv.base_url) as http:
            names: dict[str, str] = {}

            async def complete(name: str, priority: int) -> None:
                async with http.post("/v1/completions", json={
                        "model": MODEL, "prompt": f"{name} says", "max_tokens": 3,
                        "ignore_eos": True, "priority": priority}) as resp:
                    assert resp.status == 200, await resp.text()
                    names[(await resp.json())["id"]] = name

            tasks = [asyncio.create_task(complete("blocker", 0))]
            await _until(lambda: len(admitted) == 1)
            # one at a time, so that arrival order is known
            for i, (name, priority) in enumerate((("low", 9), ("tie-a", 1), ("high", -3),
                                                  ("tie-b", 1))):
                tasks.append(asyncio.create_task(complete(name, priority)))
                await _until(lambda: srv.call(lambda: core.scheduler.num_waiting) == i + 1)
            gate.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
        order = [names[rid.rsplit("-", 1)[0]] for rid in admitted]
        assert order == ["blocker", "high", "tie-a", "tie-b", "low"]
        srv.wait_idle()


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


async def test_disconnect_storm_over_shared_prefixes_gives_every_block_back(server):
    hits = _counter(server, "baton_prefix_cache_hits_total")
    async with aiohttp.ClientSession(base_url=server.base_url) as http:
        async def stream_and_leave(i: int) -> None:
            resp = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PREFIX + [100 + i] * (i % 5), "max_tokens": 300,
                "ignore_eos": True, "stream": True, "seed": i, "temperature": 0.8})
            assert resp.status == 200
            seen = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    seen += 1
                    if seen == 2 + i % 3:
                        break
            resp.close()

        await asyncio.wait_for(asyncio.gather(*(stream_and_leave(i) for i in range(16))), 60)
    await _until(lambda: server.call(server.is_idle), 20)
    kv = server.core.kv_cache

    def released() -> tuple[int, int, int]:
        server.core.check_integrity()
        return (max(kv.pool.ref_count(b) for b in range(kv.num_blocks)),
                kv.num_free_blocks, kv.num_cached_blocks)

    max_ref, free, cached = server.call(released)
    assert max_ref == 0 and free == kv.num_blocks
    assert cached >= 3                       # the shared prefix stays, evictable
    assert _counter(server, "baton_prefix_cache_hits_total") > hits


def test_cli_flags_reach_the_engine_args():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    default = engine_args_from(parser.parse_args([]))
    assert default.enable_prefix_caching and default.scheduling_policy == "fcfs"
    assert default.long_prefill_token_threshold is None
    for flag in ("--no-prefix-caching", "--no-enable-prefix-caching"):
        assert not engine_args_from(parser.parse_args([flag])).enable_prefix_caching
    args = engine_args_from(parser.parse_args(
        ["--enable-prefix-caching", "--scheduling-policy", "priority",
         "--long-prefill-token-threshold", "64"]))
    assert args.enable_prefix_caching and args.scheduling_policy == "priority"
    assert args.long_prefill_token_threshold == 64
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
