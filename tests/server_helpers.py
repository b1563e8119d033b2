"""A real Baton gateway on 127.0.0.1 for tests, served from a background thread.

The server gets its own event loop in its own thread, so a test can use a
synchronous client (``openai.OpenAI``, urllib) from the test thread, or an
async one (aiohttp) from pytest-asyncio's loop. Engine state belongs to the
server loop: read ints from the test thread if you like, but run anything
that walks structures (``check_integrity``) through ``Server.call``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from scheduler.async_engine import AsyncEngine
from scheduler.engine import EngineCore
from service.observability import Observability
from telemetry.metrics import Metrics
from telemetry.tracing import Tracing
from service.app import ServerState, create_app
from service.config import EngineArgs, ServerConfig
from service.engine_factory import create_engine
from service.guards import limit_connections, runner_options

START_TIMEOUT = 30.0


@dataclass
class Server:
    base_url: str
    state: ServerState
    loop: asyncio.AbstractEventLoop
    limiter: Any = None  # service.guards.ConnectionLimiter, when the config caps connections

    @property
    def engine(self) -> AsyncEngine:
        assert self.state.engine is not None
        return self.state.engine

    @property
    def core(self) -> EngineCore:
        return self.engine.core

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn()`` on the server loop and return its result; ``fn`` may
        return an awaitable, which is awaited there."""
        async def run():
            result = fn()
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                result = await result
            return result
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0,
                   what: str = "condition") -> None:
        """Poll ``predicate`` on the server loop until true; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.call(predicate):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.01)

    def is_idle(self) -> bool:
        """No request running or waiting, and every KV block free."""
        load = self.engine.load()
        return (load.num_running == 0 and load.num_waiting == 0
                and load.kv_blocks_free == load.kv_blocks_total)

    def state_sizes(self) -> dict[str, int]:
        """Entries in every per-request table: engine, backend, detokenizers,
        the AsyncEngine's queues, telemetry, and the gateway's in-flight count."""
        obs = self.state.obs
        return {**self.engine.state_sizes(),
                "telemetry": len(obs.active) if obs is not None else 0,
                "in_flight": self.state.in_flight}

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until idle, check every structure's integrity, and wait for
        every per-request table to empty (the backend learns which requests
        ended with the loop's next turn)."""
        self.wait_until(self.is_idle, timeout, "every request to end and free its blocks")
        self.call(self.engine.check_integrity)
        try:
            self.wait_until(lambda: not any(self.state_sizes().values()), timeout,
                            "every per-request table to empty")
        except AssertionError:
            raise AssertionError(f"per-request state left behind: {self.call(self.state_sizes)}")


@contextlib.contextmanager
def running_server(engine: EngineCore | EngineArgs, config: ServerConfig | None = None,
                   model_name: str | None = None,
                   tracing: Tracing | None = None) -> Iterator[Server]:
    """Serve ``engine`` (or one built from EngineArgs) on an ephemeral port;
    yields a Server, then shuts the engine and the runner down. Metrics are
    always on (as in ``baton serve``); tracing only when given."""
    core = engine if isinstance(engine, EngineCore) else create_engine(engine)
    config = config or ServerConfig()
    names = config.served_model_names
    name = model_name or (names[0] if names else core.model_name)
    obs = Observability(name, Metrics(name), tracing or Tracing(), config.log_prompts,
                        log_requests=config.log_requests)
    state = ServerState(config, model_name=name, obs=obs)
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    async def start() -> web.AppRunner:
        engine_ = AsyncEngine(core, config.fault_policy())
        obs.attach(engine_)
        engine_.start()
        state.engine = engine_
        state.phase = "ready"
        runner = web.AppRunner(create_app(state), **runner_options(config))
        await runner.setup()
        started["limiter"] = limit_connections(runner, config.max_connections)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock)
        await site.start()
        started["port"] = sock.getsockname()[1]
        return runner

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            started["runner"] = loop.run_until_complete(start())
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            started["error"] = exc
            ready.set()
            return
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="baton-test-server", daemon=True)
    thread.start()
    if not ready.wait(START_TIMEOUT):
        raise AssertionError("the test server did not start")
    if "error" in started:
        loop.close()
        raise started["error"]
    server = Server(f"http://127.0.0.1:{started['port']}", state, loop, started["limiter"])

    async def stop() -> None:
        state.phase = "stopped"
        if state.engine is not None:
            await state.engine.shutdown()
        await started["runner"].cleanup()

    try:
        yield server
    finally:
        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(START_TIMEOUT)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(START_TIMEOUT)
            if not thread.is_alive():
                loop.close()


def free_port() -> int:
    """A port nothing listens on right now (for subprocess servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def patched_execute(core: EngineCore, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace ``core.backend.execute`` by ``wrap(real_execute)`` for the
    duration; the step loop looks it up each step, so this takes effect at once."""
    backend = core.backend
    real = backend.execute
    backend.execute = wrap(real)
    try:
        yield
    finally:
        del backend.execute  # back to the class's method


@contextlib.contextmanager
def gated_backend(core: EngineCore) -> Iterator[threading.Event]:
    """Hold every engine step before the forward pass until the yielded event
    is set (a deterministic "busy engine"); opens the gate on exit."""
    gate = threading.Event()

    def wrap(real):
        def held(output):
            if not gate.wait(30.0):
                raise RuntimeError("test gate never opened")
            return real(output)
        return held

    with patched_execute(core, wrap):
        try:
            yield gate
        finally:
            gate.set()


@contextlib.contextmanager
def captured_prompts(server: Server) -> Iterator[list[str]]:
    """The prompt text (special tokens kept) of every request the gateway
    adds to the engine meanwhile: what a chat template made of a request."""
    engine = server.engine
    real = engine.add_request
    prompts: list[str] = []

    def add_request(prompt_token_ids, params, *args, **kwargs):
        prompts.append(engine.tokenizer.decode(list(prompt_token_ids), False))
        return real(prompt_token_ids, params, *args, **kwargs)

    engine.add_request = add_request
    try:
        yield prompts
    finally:
        del engine.add_request  # back to the class's method
