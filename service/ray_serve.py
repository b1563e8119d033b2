"""Baton replicas behind Ray Serve: ``baton serve --data-parallel-size N``.

Two deployments in one Ray Serve application:

* ``BatonReplica`` (N of them, or autoscaled between bounds): one whole Baton
  engine *and its own aiohttp gateway*, listening on the replica's loopback.
  A request reaches it through Ray Serve as plain bytes (method, path,
  headers, body) and is answered by the same gateway code as ``baton serve``
  (validation, chat templates, SSE, the error envelope, /metrics), streamed
  back chunk by chunk. The replica reports its engine's load to the router
  (``record_routing_stats``) and fails Ray Serve's health check when its
  engine is broken, so Ray Serve replaces it.
* ``BatonIngress``: behind Ray Serve's own HTTP proxy, it reads the body,
  extracts the prompt text for routing and forwards the request to a replica
  chosen by ``service.ray_router.PrefixAwareRouter`` (shared prefix -> the
  replica holding it, else the least loaded). ``GET /metrics`` gathers every
  replica's metrics with a ``replica`` label; ``GET /health`` is 200 while
  any replica is healthy.

``build_app`` is also a ``serve run`` entry (``serve run
service.ray_serve:build_app argv="--model ... --threads 1" replicas=2``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from service.config import EngineArgs, ServerConfig
from service.ray_router import ROUTING_KEY

log = logging.getLogger("baton.ray")

REPLICA_HEADER = "x-baton-replica"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
               "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection"}
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# /metrics and /health wait this long for every replica's answer.
FAN_OUT_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True)
class ReplicaSet:
    """How many replicas, and the resources of each."""

    num_replicas: int = 2
    max_replicas: int | None = None     # above num_replicas: autoscale between them
    num_cpus: float = 1.0               # per replica (its --threads)
    num_gpus: float = 0.0
    target_ongoing_requests: int = 16   # autoscaling: per replica

    def deployment_options(self) -> dict[str, Any]:
        actor = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        # By import path, not by value: the ingress finds its routers by class.
        router = RequestRouterConfig(request_router_class="service.ray_router:PrefixAwareRouter",
                                     request_routing_stats_period_s=1.0,
                                     request_routing_stats_timeout_s=5.0)
        options: dict[str, Any] = {"ray_actor_options": actor,
                                   "request_router_config": router,
                                   "max_ongoing_requests": 4096}
        if self.max_replicas and self.max_replicas > self.num_replicas:
            options["autoscaling_config"] = AutoscalingConfig(
                min_replicas=self.num_replicas, max_replicas=self.max_replicas,
                initial_replicas=self.num_replicas,
                target_ongoing_requests=self.target_ongoing_requests)
        else:
            options["num_replicas"] = self.num_replicas
        return options


# ------------------------------------------------------------------ replica
class BatonReplica:
    """A Baton engine and its gateway, served on this replica's loopback."""

    def __init__(self, engine_args: EngineArgs, config: ServerConfig) -> None:
        from backends.host_malloc import tune_malloc
        from service.engine_factory import create_engine_on_passing_thread
        tune_malloc()  # a replica is a process of its own
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        # Traces name the replica they come from.
        attributes = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(
            a for a in (attributes, f"service.instance.id={self.replica_id}") if a)
        self.config = dataclasses.replace(config, host="127.0.0.1", port=0)
        # Ray places replicas by the CPUs they reserve; pinning inside one
        # would take the same first cores in every replica on a node.
        engine_args = dataclasses.replace(
            engine_args, parallel=dataclasses.replace(engine_args.parallel, pin_cpus=False))
        self.engine_args = engine_args
        # Ray routes nothing here until loaded. Loaded on a thread that ends,
        # so that only the step thread keeps OpenMP threads.
        self.core = create_engine_on_passing_thread(engine_args)
        self._start_lock = asyncio.Lock()
        self._state = None
        self._base_url = ""
        self._session = None

    async def _started(self) -> None:
        if self._session is not None:
            return
        async with self._start_lock:
            if self._session is None:
                await self._start()

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        from scheduler.async_engine import AsyncEngine
        from service.app import ServerState, create_app
        from service.serve import build_observability
        obs = build_observability(self.engine_args, self.config)
        state = ServerState(self.config, obs=obs, model_name=obs.model_name)
        engine = AsyncEngine(self.core, self.config.fault_policy())
        obs.attach(engine)
        engine.start()
        state.engine = engine
        state.phase = "ready"
        from service.guards import runner_options
        runner = web.AppRunner(create_app(state), **runner_options(self.config))
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        port = sock.getsockname()[1]
        self._state, self._runner = state, runner
        self._base_url = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        log.info("replica %s serves on %s", self.replica_id, self._base_url)

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]],
                     body: bytes, **routing: Any) -> AsyncIterator[Any]:
        """Answer one HTTP request with this replica's gateway: first a dict
        with the status and headers, then the body's chunks as they come."""
        await self._started()
        async with self._session.request(method, self._base_url + path, headers=headers,
                                         data=body, allow_redirects=False) as response:
            out = [(k, v) for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP]
            yield {"status": response.status,
                   "headers": out + [(REPLICA_HEADER, self.replica_id)]}
            async for chunk in response.content.iter_any():
                yield chunk

    async def metrics(self, headers: list[tuple[str, str]]) -> tuple[str, int, str]:
        """(replica id, status, exposition text) of this replica's /metrics."""
        await self._started()
        async with self._session.get(self._base_url + "/metrics", headers=headers) as resp:
            return self.replica_id, resp.status, await resp.text()

    async def health(self) -> tuple[str, bool, str]:
        await self._started()
        health = self._state.engine.health()
        return self.replica_id, health.ok, health.reason

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router balances on: the engine's own queue and cache."""
        load = self.core.load()
        return {"num_running": load.num_running, "num_waiting": load.num_waiting,
                "num_waiting_tokens": load.num_waiting_tokens,
                "kv_usage": 1.0 - load.kv_blocks_free / max(1, load.kv_blocks_total)}

    async def check_health(self) -> None:
        """Ray Serve's health check: a broken engine gets the replica replaced
        (a busy or still-starting one does not)."""
        if self._state is None:
            return
        health = self._state.engine.health()
        if not health.ok and not self._state.engine.is_running:
            raise RuntimeError(f"replica {self.replica_id}: {health.reason}")
        fatal = getattr(self.core.backend, "fatal_error", None)
        if fatal:
            raise RuntimeError(f"replica {self.replica_id}: {fatal}")


# ------------------------------------------------------------------ ingress
def routing_key(body: bytes) -> str | None:
    """The text requests are compared by: a completion's prompt(s), a chat's
    (or an Anthropic request's) messages in order (role and text), a
    Responses request's instructions and input, each after its system text.
    None when there is none."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    system = request.get("system") or request.get("instructions")
    if isinstance(system, list):
        system = "".join(str(p.get("text") or "") for p in system if isinstance(p, dict))
    head = f"<system>{system}" if isinstance(system, str) and system else ""
    conversation = request.get("messages", request.get("input"))
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    if isinstance(conversation, list) and ("messages" in request or "input" in request):
        parts = [head]
        for message in conversation:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):
                    content = "".join(str(p.get("text") or "") for p in content
                                      if isinstance(p, dict))
                parts.append(f"<{message.get('role')}>{content if content else ''}")
        return "".join(parts) or None
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids
        prompt = " ".join(map(str, prompt[0] if prompt and isinstance(prompt[0], list)
                              else prompt))
    return prompt if isinstance(prompt, str) and prompt else None


def _error(status: int, message: str) -> Response:
    from service.http_errors import APIError
    return Response(msgspec.json.encode(APIError(status, message).body()), status_code=status,
                    media_type="application/json")


class BatonIngress:
    """Forwards requests to the replicas (through the prefix-aware router)."""

    def __init__(self, replicas) -> None:
        self._replicas = replicas
        self._stream = replicas.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.url.query:
            path += "?" + request.url.query
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        if request.method == "GET" and request.url.path == "/metrics":
            return await self._metrics(headers)
        if request.method == "GET" and request.url.path == "/health":
            return await self._health()
        body = await request.body()
        routing = {}
        if request.method == "POST" and request.url.path in ROUTED_PATHS:
            routing[ROUTING_KEY] = routing_key(body)
        chunks = self._stream.handle.remote(request.method, path, headers, body, **routing)
        try:
            head = await chunks.__anext__()
        except Exception as exc:  # noqa: BLE001 - no replica could answer
            log.warning("no replica answered %s %s: %s", request.method, path, exc)
            return _error(503, f"no Baton replica could take the request: "
                               f"{type(exc).__name__}")

        async def rest() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                yield chunk

        return StreamingResponse(rest(), status_code=head["status"],
                                 headers=dict(head["headers"]))

    async def _each_replica(self, method: str, *args) -> list:
        """Every running replica's answer to ``method`` (an exception in place
        of a replica's answer where it failed).

        Ray Serve's broadcast, not one routed call per replica: calls made
        while serving one request share its request id, and the router
        matches a chosen replica to its pending call by that id, so
        concurrent routed calls could leave one of them waiting forever.
        """
        try:
            response = self._replicas.broadcast(method, *args)
            return await response.results_async(timeout_s=FAN_OUT_TIMEOUT_S,
                                                return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - none running, or too slow to answer
            log.warning("replicas did not answer %s: %s: %s", method, type(exc).__name__, exc)
            return []

    async def _metrics(self, headers: list[tuple[str, str]]) -> Response:
        from service.replica_metrics import merge_expositions
        answers = [a for a in await self._each_replica("metrics", headers)
                   if not isinstance(a, BaseException)]
        denied = next((a for a in answers if a[1] != 200), None)
        if denied is not None:
            return Response(denied[2], status_code=denied[1], media_type="application/json")
        if not answers:
            return _error(503, "no Baton replica answered")
        text = merge_expositions({rid: text for rid, _, text in answers})
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _health(self) -> Response:
        answers = [a for a in await self._each_replica("health")
                   if not isinstance(a, BaseException)]
        lines = [f"{rid}: {'ok' if ok else reason}" for rid, ok, reason in answers]
        healthy = any(ok for _, ok, _ in answers)
        return Response("\n".join(lines) or "no replica answered",
                        status_code=200 if healthy else 503, media_type="text/plain")


# -------------------------------------------------------------- application
def application(engine_args: EngineArgs, config: ServerConfig, replicas: ReplicaSet):
    """The Ray Serve application: the ingress bound to the replicas."""
    replica = serve.deployment(BatonReplica, name="BatonReplica",
                               **replicas.deployment_options())
    ingress = serve.deployment(BatonIngress, name="BatonIngress", num_replicas=1,
                               max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(engine_args, config))


def build_app(args: dict[str, str]):
    """``serve run service.ray_serve:build_app argv="<baton serve flags>"
    replicas=2 [max_replicas=4]``."""
    import shlex

    from service.cli import parse_serve_argv
    engine_args, config = parse_serve_argv(shlex.split(args.get("argv", "")))
    replicas = ReplicaSet(num_replicas=int(args.get("replicas", 2)),
                          max_replicas=int(args["max_replicas"]) if "max_replicas" in args
                          else None, num_cpus=float(engine_args.threads or 1))
    return application(engine_args, config, replicas)
