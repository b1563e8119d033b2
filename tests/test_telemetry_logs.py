"""Structured logs: one JSON object per line, stdlib logging included."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from telemetry.logs import configure_logging, log_lifecycle, log_request_finished
from telemetry.records import RequestRecord

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


@pytest.fixture
def json_lines(restore_logging):
    """configure_logging(json=True) into a buffer; returns a reader of its lines."""
    buf = io.StringIO()
    configure_logging(json=True, level="INFO", stream=buf)

    def read() -> list[dict]:
        text = buf.getvalue()
        assert text.endswith("\n")
        return [json.loads(line) for line in text.splitlines()]
    return read


def record(status: str = "ok") -> RequestRecord:
    return RequestRecord(
        request_id="chatcmpl-7", operation="chat", model="SmolLM2-135M-Instruct",
        status=status, finish_reason="length" if status == "ok" else "error",
        error_type=None if status == "ok" else "RuntimeError", prompt_tokens=11,
        output_tokens=16 if status == "ok" else 0, arrival=50.0, first_scheduled=50.02,
        first_token=50.25 if status == "ok" else None, finished=51.5)


def test_request_line_has_the_fields_and_no_prompt(json_lines):
    log_request_finished(record(), TRACE_ID, SPAN_ID, prompt_text="secret prompt",
                         output_text="secret answer")
    [line] = json_lines()
    assert line["event"] == "request_finished"
    assert line["logger"] == "baton.request"
    assert line["level"] == "info"
    assert "timestamp" in line
    assert line["request_id"] == "chatcmpl-7"
    assert line["trace_id"] == TRACE_ID
    assert line["span_id"] == SPAN_ID
    assert line["status"] == "ok"
    assert line["finish_reason"] == "length"
    assert line["prompt_tokens"] == 11
    assert line["output_tokens"] == 16
    assert line["ttft"] == pytest.approx(0.25)
    assert line["e2e"] == pytest.approx(1.5)
    assert line["queue_time"] == pytest.approx(0.02)
    assert "prompt" not in line and "output" not in line
    assert "secret" not in json.dumps(line)


def test_prompts_only_when_asked(json_lines):
    log_request_finished(record(), TRACE_ID, SPAN_ID, prompt_text="Hi there",
                         output_text="Hello!", log_prompts=True)
    [line] = json_lines()
    assert line["prompt"] == "Hi there"
    assert line["output"] == "Hello!"


def test_failed_request_is_a_warning_with_error_type(json_lines):
    log_request_finished(record("error"))  # tracing off: no ids
    [line] = json_lines()
    assert line["level"] == "warning"
    assert line["status"] == "error"
    assert line["error_type"] == "RuntimeError"
    assert line["ttft"] is None
    assert "trace_id" not in line and "span_id" not in line


def test_stdlib_and_lifecycle_share_the_format(json_lines):
    log_lifecycle("ready", host="127.0.0.1", port=8000)
    structlog.contextvars.bind_contextvars(request_id="cmpl-3")
    logging.getLogger("baton.engine").info("step took %.1f ms", 12.5)
    structlog.contextvars.clear_contextvars()
    logging.getLogger("baton.engine").debug("below the level")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("baton.http").exception("handler failed")
    lifecycle, engine, failure = json_lines()
    assert lifecycle["event"] == "ready"
    assert lifecycle["logger"] == "baton.lifecycle"
    assert (lifecycle["host"], lifecycle["port"]) == ("127.0.0.1", 8000)
    assert engine["event"] == "step took 12.5 ms"
    assert engine["logger"] == "baton.engine"
    assert engine["level"] == "info"
    assert engine["request_id"] == "cmpl-3"
    assert failure["level"] == "error"
    assert "RuntimeError: boom" in failure["exception"]


def test_console_format_and_reconfiguring_replaces_the_handler(restore_logging):
    first, second = io.StringIO(), io.StringIO()
    configure_logging(json=True, stream=first)
    configure_logging(json=False, stream=second)
    log_lifecycle("draining", in_flight=2)
    assert first.getvalue() == ""
    text = second.getvalue()
    assert "draining" in text and "in_flight=2" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_json_is_the_default_off_a_terminal(restore_logging):
    buf = io.StringIO()  # isatty() is False
    configure_logging(stream=buf)
    log_lifecycle("stopped")
    assert json.loads(buf.getvalue())["event"] == "stopped"
