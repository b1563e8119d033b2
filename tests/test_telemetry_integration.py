"""Telemetry against real components on 127.0.0.1: a Prometheus server
(Debian package `prometheus`) scrapes a live Baton, and an OTLP receiver
(oteltest's `otelsink`) receives Baton's spans. scripts/test.sh installs both."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import openai
import pytest

from service.config import ServerConfig
from telemetry.tracing import setup_tracing
from tests.engine_helpers import make_engine
from tests.server_helpers import free_port, running_server

# Slow (a real Prometheus and an OTLP receiver): the full suite runs these, ./scripts/test.sh
# --quick does not.
pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


def _need(binary: str) -> str:
    # console scripts of the test environment live beside its python
    path = shutil.which(binary) or shutil.which(binary, path=os.path.dirname(sys.executable))
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is not installed; scripts/test.sh installs it")
        pytest.skip(f"{binary} is not installed (scripts/test.sh installs it)")
    return path


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _query(prom_port: int, expr: str) -> float:
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    results = body["data"]["result"]
    return sum(float(r["value"][1]) for r in results)


def test_prometheus_scrapes_ttft_histogram(tiny_llama_dir, tmp_path):
    binary = _need("prometheus")
    core = make_engine(tiny_llama_dir)
    with running_server(core, ServerConfig(), model_name=MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        for _ in range(3):
            client.completions.create(model=MODEL, prompt="scrape me", max_tokens=3)
        target = server.base_url.removeprefix("http://")
        (tmp_path / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n  - job_name: baton\n"
            f"    static_configs:\n      - targets: ['{target}']\n")
        prom_port = free_port()
        prom = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            count = 0.0
            while time.monotonic() < deadline:
                assert prom.poll() is None, "prometheus exited"
                if _port_open(prom_port):
                    try:
                        count = _query(prom_port, "gen_ai_server_time_to_first_token_seconds_count"
                                       f'{{model_name="{MODEL}"}}')
                    except OSError:
                        count = 0.0
                    if count > 0:
                        break
                time.sleep(0.5)
            assert count >= 3, f"Prometheus saw TTFT count {count}"
            assert _query(prom_port, f'up{{job="baton"}}') == 1
        finally:
            prom.terminate()
            try:
                prom.wait(timeout=10)
            except subprocess.TimeoutExpired:
                prom.kill()


def test_otlp_receiver_gets_baton_spans(tiny_llama_dir, monkeypatch):
    binary = _need("otelsink")
    if _port_open(4317):
        pytest.skip("port 4317 is taken (a collector is running?)")
    sink = subprocess.Popen([binary], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in sink.stdout],
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 20
        while not _port_open(4317):
            assert sink.poll() is None, "otelsink exited"
            assert time.monotonic() < deadline, "otelsink did not start listening"
            time.sleep(0.05)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        tracing = setup_tracing(otlp_endpoint="http://127.0.0.1:4317", detail="step")
        core = make_engine(tiny_llama_dir)
        with running_server(core, ServerConfig(), model_name=MODEL, tracing=tracing) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x",
                                   max_retries=0)
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "trace me"}], max_tokens=3)
            assert tracing.force_flush(10_000)
        seen = ""
        deadline = time.monotonic() + 15
        while not (f"chat {MODEL}" in seen and "engine_step" in seen):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"otelsink did not report Baton's spans: {seen[-500:]!r}"
            try:
                seen += lines.get(timeout=remaining)
            except queue.Empty:
                pass
        tracing.shutdown()
    finally:
        sink.kill()
        sink.wait(timeout=5)
        reader.join(timeout=5)
