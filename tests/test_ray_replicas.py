"""Two Baton replicas on a local Ray cluster behind Ray Serve's HTTP proxy:
the OpenAI SDK's requests are served by both, requests sharing a prompt
prefix land on the same replica, streaming and the error envelope pass
through unchanged, and /metrics carries each replica's series apart.

Ray is installed by the test command (baton[ray]). Where it is missing or
cannot start, the test skips on a developer's machine but fails under CI
(CI=true): a scale-out path nobody runs is not tested.
"""

from __future__ import annotations

import os
import urllib.request

import pytest

from backends.parallel.config import ParallelConfig
from service.config import EngineArgs, ServerConfig
from tests.server_helpers import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]

SYSTEM = ("You are a careful assistant. Answer briefly and cite nothing. This system prompt "
          "is long enough to fill several routing chunks, as real ones do. ")


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Ray could not run on CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def replicas(tiny_qwen3_dir):
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        _unavailable(f"ray[serve] is not installed: {exc}")
    from service.ray_launch import start_replicas, stop_replicas
    from service.ray_serve import ReplicaSet
    port = free_port()
    engine_args = EngineArgs(model=str(tiny_qwen3_dir), dtype="float32", threads=1,
                             num_kv_blocks=128, parallel=ParallelConfig())
    os.environ.pop("RAY_ADDRESS", None)
    try:
        start_replicas(engine_args, ServerConfig(port=port),
                       ReplicaSet(num_replicas=2, num_cpus=1.0),
                       ray_init={"num_cpus": 2, "object_store_memory": 200 * 2**20,
                                 "log_to_driver": False})
    except Exception as exc:  # noqa: BLE001 - reported as unavailable below
        stop_replicas()
        _unavailable(f"Ray Serve did not start: {type(exc).__name__}: {exc}")
    from service.engine_factory import model_name_for
    yield f"http://127.0.0.1:{port}", model_name_for(str(tiny_qwen3_dir))
    stop_replicas()


def _client(base_url):
    import openai
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_requests_from_the_openai_sdk_are_served_by_both_replicas(replicas):
    url, model = replicas
    client = _client(url)
    served = set()
    for i in range(24):
        raw = client.completions.with_raw_response.create(
            model=model, prompt=f"request {i}: a prompt of its own", max_tokens=2)
        assert raw.parse().choices[0].finish_reason == "length"
        served.add(raw.headers["x-baton-replica"])
        if len(served) == 2:
            break
    assert len(served) == 2, served


def test_requests_sharing_a_prefix_land_on_one_replica(replicas):
    url, model = replicas
    client = _client(url)
    served = []
    for question in ("What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three."):
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=2,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": question}])
        served.append(raw.headers["x-baton-replica"])
    assert len(set(served)) == 1, served


def test_streaming_errors_and_metrics_pass_through(replicas):
    import openai
    url, model = replicas
    client = _client(url)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"

    # /metrics and /health ask every replica at once, within one request:
    # several rounds, as a scraper and a load balancer would.
    for _ in range(3):
        with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
            text = response.read().decode()
        labelled = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("baton_requests_total{")}
        assert len(labelled) == 2, labelled
        with urllib.request.urlopen(url + "/health", timeout=60) as response:
            assert response.status == 200 and response.read().decode().count(": ok") == 2
