"""``baton serve --data-parallel-size N``: join (or start) a Ray cluster and
run the Baton application (service/ray_serve.py) on Ray Serve until SIGTERM.

With ``RAY_ADDRESS`` set (``ray start --head`` on one machine, ``ray start
--address=HEAD:6379`` on the others), the replicas spread over the cluster's
nodes; without it, a Ray cluster of this one machine is started and stopped
with the server.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from backends.errors import BatonError
from service.config import EngineArgs, ServerConfig
from telemetry.logs import log_lifecycle

log = logging.getLogger("baton")

APP_NAME = "baton"


def start_replicas(engine_args: EngineArgs, config: ServerConfig, replicas,
                   ray_init: dict | None = None) -> None:
    """Start Ray (or join RAY_ADDRESS) and run the application; returns when
    every replica has loaded its model and the HTTP proxy listens."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise BatonError("--data-parallel-size runs replicas on Ray Serve: install it with "
                         "pip install 'baton[ray]'") from None
    from service.ray_serve import application
    if not ray.is_initialized():
        options = dict(ray_init or {})
        address = os.environ.get("RAY_ADDRESS")
        if address:
            options["address"] = address
        else:
            options.setdefault("include_dashboard", False)
        ray.init(logging_level=logging.WARNING, **options)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(application(engine_args, config, replicas), name=APP_NAME, route_prefix="/")


def stop_replicas() -> None:
    import ray
    from ray import serve
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def run_replicas(engine_args: EngineArgs, config: ServerConfig, replicas) -> int:
    log_lifecycle("loading", host=config.host, port=config.port,
                  replicas=replicas.num_replicas, max_replicas=replicas.max_replicas)
    try:
        start_replicas(engine_args, config, replicas)
    except BatonError:
        raise
    except Exception:
        log.exception("the Ray Serve application failed to start")
        stop_replicas()
        return 1
    log_lifecycle("ready", url=f"http://{config.host}:{config.port}",
                  replicas=replicas.num_replicas)
    # After ray.init, which installs handlers of its own.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log_lifecycle("draining")
    stop_replicas()
    log_lifecycle("stopped")
    return 0
