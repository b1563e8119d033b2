"""The prefix-aware router's choices, without a Ray cluster: the replica that
served a prompt's prefix gets the prompts that share it unless it is busier
than the least loaded one by more than ``imbalance``; otherwise the least
loaded replica, by the load its engine reported (the larger of that and Ray
Serve's own count in flight); a dead replica's prefixes are forgotten. The
routed end to end path is tests/test_ray_replicas.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (baton[ray])")

from ray.serve._private.common import (DeploymentHandleSource,  # noqa: E402
                                       DeploymentID, ReplicaID)

from service.ray_router import ROUTING_KEY, PrefixAwareRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="BatonReplica", app_name="baton")
SYSTEM = "You are a careful assistant. " * 8   # several 64-character pieces


def _replica(name: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT),
                           routing_stats=stats, max_ongoing_requests=4096)


def _request(key: str | None) -> SimpleNamespace:
    return SimpleNamespace(kwargs={ROUTING_KEY: key} if key else {},
                           routing_context=SimpleNamespace(should_backoff=False))


@pytest.fixture
def router() -> PrefixAwareRouter:
    router = PrefixAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(imbalance=4)
    return router


def _first(router, replicas, key):
    ranked = asyncio.run(router.choose_replicas(replicas, _request(key)))
    return [r.replica_id.unique_id for r in ranked[0]]


def test_without_a_shared_prefix_the_least_loaded_replica_goes_first(router):
    busy = _replica("busy", num_running=3, num_waiting=2, kv_usage=0.5)
    idle = _replica("idle", num_running=0, num_waiting=0, kv_usage=0.1)
    assert _first(router, [busy, idle], "a prompt of its own") == ["idle"]
    # Ray Serve's count in flight outranks an engine report that is older.
    router.replica_queue_len_cache.update(idle.replica_id, 9)
    assert _first(router, [busy, idle], "another prompt") == ["busy"]


def test_a_shared_prefix_goes_to_its_holder_until_it_is_too_busy(router):
    holder = _replica("holder", num_running=2, num_waiting=0)
    other = _replica("other", num_running=0, num_waiting=0)
    router.on_request_routed(_request(SYSTEM + "<user>first"), holder.replica_id, None)
    # Busier than the other replica, but within the imbalance: the cache wins.
    assert _first(router, [holder, other], SYSTEM + "<user>second") == ["holder"]
    assert _first(router, [holder, other], "unrelated") == ["other"]
    # Past the imbalance the least loaded replica takes it.
    holder.routing_stats = {"num_running": 3, "num_waiting": 3}
    assert _first(router, [holder, other], SYSTEM + "<user>third") == ["other"]
    # A dead holder's prefixes are forgotten (the same load kept it first above).
    holder.routing_stats = {"num_running": 2, "num_waiting": 0}
    router.on_replica_actor_died(holder.replica_id)
    assert _first(router, [holder, other], SYSTEM + "<user>fourth") == ["other"]


def test_a_replica_reports_its_engines_own_load(tiny_llama_dir):
    """What the router balances on is read from the engine: its queue, then
    its running batch and the KV blocks that batch holds."""
    from backends.interface import SamplingParams
    from service.ray_serve import BatonReplica
    from tests.engine_helpers import make_engine
    replica = SimpleNamespace(core=make_engine(tiny_llama_dir, num_kv_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(2):
        replica.core.add_request(f"r{i}", list(range(5, 5 + 20)), params)
    stats = BatonReplica.record_routing_stats(replica)
    assert stats == {"num_running": 0, "num_waiting": 2, "num_waiting_tokens": 40,
                     "kv_usage": 0.0}
    replica.core.step()
    stats = BatonReplica.record_routing_stats(replica)
    assert stats["num_running"] == 2 and stats["num_waiting"] == 0
    assert 0.0 < stats["kv_usage"] < 1.0


def test_every_generation_api_is_routed_by_its_prompt_text():
    import json

    from service.ray_serve import ROUTED_PATHS, routing_key
    assert {"/v1/responses", "/v1/messages"} <= set(ROUTED_PATHS)

    def key(body: dict) -> str | None:
        return routing_key(json.dumps(body).encode())
    chat = key({"messages": [{"role": "system", "content": "S"},
                             {"role": "user", "content": "Hi"}]})
    assert chat == "<system>S<user>Hi"     # as before
    # Anthropic's system, Responses' instructions and input: the same text, the same key.
    assert key({"system": "S", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}]}) == chat
    assert key({"instructions": "S", "input": "Hi"}) == chat
    assert key({"instructions": "S", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}]}]}) == chat
    assert key({"system": [{"type": "text", "text": None}], "messages": []}) is None
