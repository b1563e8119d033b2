"""Structured logs: one format for structlog events and stdlib ``logging``.

``configure_logging`` installs one handler on the root logger whose formatter
runs structlog's renderer, so ``logging.getLogger("baton.engine").info(...)``
and ``structlog.get_logger().info(...)`` come out alike: JSON lines when
stderr is not a terminal, aligned key=value text when it is.

Fields bound with ``structlog.contextvars.bind_contextvars`` (a request id, a
trace id) appear on every line logged in that context, stdlib lines included.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

import structlog

from telemetry.records import RequestRecord

_HANDLER_MARK = "_baton_telemetry_handler"

_request_log = structlog.get_logger("baton.request")
_lifecycle_log = structlog.get_logger("baton.lifecycle")


def configure_logging(json: bool | None = None, level: str | int = "INFO",
                      stream: IO[str] | None = None) -> None:
    """Send every log line, structlog's and stdlib's, to ``stream`` (stderr).

    ``json`` None picks JSON unless the stream is a terminal. Calling again
    replaces the handler this function installed and nothing else.
    """
    probe = stream if stream is not None else sys.stderr
    is_tty = hasattr(probe, "isatty") and probe.isatty()
    if json is None:
        json = not is_tty
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json:
        renderer: Any = structlog.processors.JSONRenderer()
        # exceptions as text inside the JSON object, not a multi-line dump
        shared.append(structlog.processors.format_exc_info)
    else:
        # plain tracebacks: rich's default would print local variables,
        # prompts among them
        renderer = structlog.dev.ConsoleRenderer(
            colors=is_tty, exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.PositionalArgumentsFormatter(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    # Without an explicit stream, write to whatever sys.stderr is at emit
    # time (tests and embedders swap it; a stale captured stream would break).
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


class _StderrHandler(logging.StreamHandler):
    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def log_request_finished(record: RequestRecord, trace_id: str | None = None,
                         span_id: str | None = None, prompt_text: str | None = None,
                         output_text: str | None = None, log_prompts: bool = False) -> None:
    """One line per finished request. Prompt and output text only with
    ``log_prompts`` (they are user data); ids are omitted when None."""
    fields: dict[str, Any] = {
        "request_id": record.request_id,
        "operation": record.operation,
        "model": record.model,
        "status": record.status,
        "finish_reason": record.finish_reason,
        "prompt_tokens": record.prompt_tokens,
        "output_tokens": record.output_tokens,
        "queue_time": _seconds(record.queue_time),
        "ttft": _seconds(record.ttft),
        "e2e": _seconds(record.e2e),
    }
    if record.error_type is not None:
        fields["error_type"] = record.error_type
    if trace_id is not None:
        fields["trace_id"] = trace_id
    if span_id is not None:
        fields["span_id"] = span_id
    if log_prompts:
        fields["prompt"] = prompt_text
        fields["output"] = output_text
    if record.status == "ok":
        _request_log.info("request_finished", **fields)
    else:
        _request_log.warning("request_finished", **fields)


def log_lifecycle(event: str, **fields: Any) -> None:
    """A server lifecycle event: loading, ready, draining, stopped."""
    _lifecycle_log.info(event, **fields)
