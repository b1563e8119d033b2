"""`baton serve`: listen at once, load the model in the background, serve,
and drain on SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

from aiohttp import web

from scheduler.async_engine import AsyncEngine
from service.app import ServerState, create_app
from service.config import EngineArgs, ServerConfig
from service.engine_factory import create_engine

log = logging.getLogger("baton")


async def serve(engine_args: EngineArgs, config: ServerConfig) -> int:
    loop = asyncio.get_running_loop()
    state = ServerState(config)
    app = create_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    log.info("listening on http://%s:%d (loading the model)", config.host, config.port)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    loading = _load_in_background(engine_args)
    done, _ = await asyncio.wait([loading, asyncio.ensure_future(stop.wait())],
                                 return_when=asyncio.FIRST_COMPLETED)
    if loading not in done:
        log.info("stopped while loading")
        await runner.cleanup()
        return 0
    try:
        core = loading.result()
    except Exception:
        log.exception("failed to load the model")
        await runner.cleanup()
        return 1
    engine = AsyncEngine(core)
    engine.start()
    state.engine = engine
    state.model_name = config.served_model_name or core.model_name
    state.phase = "ready"
    log.info("ready: serving %r on http://%s:%d", state.model_name, config.host, config.port)

    await stop.wait()
    state.phase = "draining"
    log.info("draining: %d requests in flight, up to %.0fs", state.in_flight,
             config.drain_timeout)
    deadline = time.monotonic() + config.drain_timeout
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await engine.shutdown()
    await runner.cleanup()
    state.phase = "stopped"
    log.info("stopped")
    return 0


def _load_in_background(engine_args: EngineArgs) -> asyncio.Future:
    """create_engine on a daemon thread: unlike the default executor, which
    asyncio.run joins on the way out, a stop during a long load need not wait
    for the load to finish."""
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
            result, error = create_engine(engine_args), None
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
