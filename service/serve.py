"""`baton serve`: listen at once, load the model in the background, serve,
and drain on SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import threading
import time

from aiohttp import web

from scheduler.async_engine import AsyncEngine
from service.app import ServerState, create_app
from service.config import EngineArgs, ServerConfig
from service.engine_factory import create_engine, model_name_for
from service.guards import limit_connections, runner_options
from service.observability import Observability
from service.warmup import warm_up
from telemetry.logs import log_lifecycle
from telemetry.metrics import Metrics
from telemetry.tracing import setup_tracing

log = logging.getLogger("baton")


def build_observability(engine_args: EngineArgs, config: ServerConfig) -> Observability:
    names = config.served_model_names
    model_name = names[0] if names else model_name_for(engine_args.model)
    tracing = setup_tracing(otlp_endpoint=config.otlp_traces_endpoint,
                            detail=config.trace_detail)
    return Observability(model_name, Metrics(model_name), tracing, config.log_prompts,
                         log_requests=config.log_requests)


async def serve(engine_args: EngineArgs, config: ServerConfig) -> int:
    loop = asyncio.get_running_loop()
    obs = build_observability(engine_args, config)
    state = ServerState(config, obs=obs, model_name=obs.model_name)
    app = create_app(state)
    runner = web.AppRunner(app, **runner_options(config))
    await runner.setup()
    _raise_open_files_limit(config.max_connections)
    limit_connections(runner, config.max_connections)
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    log_lifecycle("loading", host=config.host, port=config.port, model=obs.model_name,
                  tracing=obs.tracing.detail)
    if config.api_key is None and not _is_loopback(config.host):
        log.warning("listening on %s without an API key: anyone who reaches port %d can "
                    "use the model (set --api-key, BATON_API_KEY or --api-key-file)",
                    config.host, config.port)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    loading = _load_in_background(engine_args)
    done, _ = await asyncio.wait([loading, asyncio.ensure_future(stop.wait())],
                                 return_when=asyncio.FIRST_COMPLETED)
    if loading not in done:
        log_lifecycle("stopped", during="loading")
        await runner.cleanup()
        obs.tracing.shutdown()
        # The loading thread is still inside torch: letting the interpreter
        # tear down around it aborts in C++ (rc 134). Nothing is served or
        # held yet, so leave at once.
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(0)
    try:
        core = loading.result()
    except Exception:
        log.exception("failed to load the model")
        await runner.cleanup()
        obs.tracing.shutdown()
        return 1
    engine = AsyncEngine(core, config.fault_policy())
    obs.attach(engine)
    engine.start()
    state.engine = engine
    state.phase = "ready"
    log_lifecycle("ready", model=state.model_name, url=f"http://{config.host}:{config.port}",
                  max_model_len=engine.model.max_model_len,
                  kv_capacity_tokens=engine.model.kv_capacity_tokens)

    await stop.wait()
    state.phase = "draining"
    log_lifecycle("draining", in_flight=state.in_flight, drain_timeout=config.drain_timeout)
    deadline = time.monotonic() + config.drain_timeout
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await engine.shutdown()
    core.backend.shutdown()  # stops tensor-parallel workers
    await runner.cleanup()
    state.phase = "stopped"
    obs.tracing.shutdown()
    log_lifecycle("stopped")
    return 0


def _raise_open_files_limit(max_connections: int) -> None:
    """Each connection is a file descriptor: lift the soft limit towards the
    hard one so --max-connections, not EMFILE, is what refuses clients."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = max_connections + 256
        if soft != resource.RLIM_INFINITY and soft < wanted:
            new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ImportError, ValueError, OSError):
        log.warning("could not raise the open-files limit for %d connections", max_connections)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _load_in_background(engine_args: EngineArgs) -> asyncio.Future:
    """create_engine and the warm-up on a daemon thread: unlike the default executor, which
    asyncio.run joins on the way out, a stop during a long load need not wait
    for the load to finish. The thread ends with the load, and its OpenMP
    threads with it (create_engine_on_passing_thread says why that matters)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def load() -> None:
        try:
            core = create_engine(engine_args)
            warm_up(core)
            result, error = core, None
        except Exception as exc:  # noqa: BLE001 - handed to the loop
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop has closed: the server stopped while loading

    threading.Thread(target=load, name="baton-load", daemon=True).start()
    return future


def run_server(engine_args: EngineArgs, config: ServerConfig) -> int:
    try:
        import uvloop
        return uvloop.run(serve(engine_args, config))
    except ImportError:
        return asyncio.run(serve(engine_args, config))
