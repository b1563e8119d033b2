"""The built-in dashboard against a live server: /dashboard/stats follows
finished requests, and the page, loaded in headless Chromium under a short
bounded load, updates its figures, lists the recent requests and asks nothing
of any other host. A screenshot is kept in test-artifacts/dashboard.png."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from service.config import ServerConfig
from tests.chromium_helpers import chromium_binary, open_page
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server

MODEL = "tiny-llama"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
PAGE = Path(__file__).resolve().parent.parent / "service" / "static" / "dashboard.html"
# shared by every request of the load: the prefix cache has something to hit
SYSTEM = "You are a careful storyteller who answers briefly. " * 6


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    core = make_engine(tiny_llama_dir)
    with running_server(core, ServerConfig(), model_name=MODEL) as srv:
        yield srv


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read()


def _stats(server) -> dict:
    return json.loads(_get(f"{server.base_url}/dashboard/stats")[2])


class _Load:
    """A few dozen small requests from a background thread, four at a time;
    stops by itself (count and time bounded) or when told."""

    def __init__(self, base_url: str, total: int = 48, workers: int = 4,
                 time_limit: float = 40.0) -> None:
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                                    timeout=20)
        self.left = total
        self.ids: list[str] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.deadline = time.monotonic() + time_limit
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True)
                        for i in range(workers)]

    def _take(self) -> bool:
        with self.lock:
            if self.left <= 0 or self.stop.is_set() or time.monotonic() > self.deadline:
                return False
            self.left -= 1
            return True

    def _work(self, worker: int) -> None:
        n = 0
        while self._take():
            n += 1
            try:
                resp = self.client.completions.create(
                    model=MODEL, prompt=f"{SYSTEM}worker {worker} request {n}: tell me a story",
                    max_tokens=8 + (n % 3) * 8, extra_body={"ignore_eos": True})
                with self.lock:
                    self.ids.append(resp.id)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
            time.sleep(0.25)  # spread over a few seconds, for the page to follow

    def __enter__(self) -> _Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def test_stats_endpoint_follows_requests(server):
    before = _stats(server)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    ids = [client.completions.create(model=MODEL, prompt="count me", max_tokens=6,
                                     extra_body={"ignore_eos": True}).id for _ in range(3)]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="bad", temperature=-1)
    after = _stats(server)
    assert after["model"] == MODEL
    assert after["requests_finished"] == before["requests_finished"] + 4
    assert after["requests_failed"] == before["requests_failed"] + 1
    assert after["output_tokens"] == before["output_tokens"] + 18
    assert after["steps"] > before["steps"]
    assert after["ttft"]["count"] >= 3 and after["ttft"]["p50"] > 0
    assert after["itl"]["count"] >= 15  # 5 gaps per request
    assert after["e2e"]["p99"] >= after["e2e"]["p50"] > 0
    recent = after["recent"]
    assert recent[0]["status"] == "error"  # newest first
    assert recent[0]["error_type"] == "invalid_request_error"
    assert [r["id"] for r in recent[1:4]] == ids[::-1]
    assert all(r["output_tokens"] == 6 and r["finish_reason"] == "length"
               for r in recent[1:4])
    split = after["step_split"]
    assert split["forward"] > 0 and 0 <= split["host_overhead_share"] <= 1
    assert len(after["history"]) == 60 and after["history"][-1]["t"] == 0
    assert sum(p["tokens_out"] for p in after["history"]) > 0
    # the same prompt twice: the second finds the first one's blocks
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2)
    cached = _stats(server)
    assert cached["prefix_cache_queries"] > after["prefix_cache_queries"]
    assert cached["prefix_cache_hits"] >= after["prefix_cache_hits"] + 32
    assert 0 < cached["prefix_cache_hit_rate"] <= 1


def test_dashboard_page_is_self_contained(server):
    status, content_type, body = _get(f"{server.base_url}/dashboard")
    assert status == 200 and content_type.startswith("text/html")
    html = body.decode()
    assert html == PAGE.read_text()
    # no script, style, image or font from anywhere else
    for ref in re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html):
        assert ref.startswith("data:"), ref
    assert "@import" not in html and "url(" not in html
    # the only absolute URL is the SVG namespace, which is a name, not a request
    assert set(re.findall(r"https?://[^\s\"'`)]+", html)) == {"http://www.w3.org/2000/svg"}
    period = int(re.search(r"PERIOD_MS = (\d+)", html).group(1))
    assert period <= 1000  # at least one update a second


_FIGURES = """JSON.stringify({
  updates: Number(document.body.dataset.updates || 0),
  finished: document.getElementById('requests-finished').textContent,
  steps: document.getElementById('steps').textContent,
  tokensOut: document.getElementById('output-total').textContent,
  ttftCount: document.querySelector('#lat-ttft td:last-child').textContent,
  prefixHit: document.getElementById('prefix-hit').textContent,
  prefixTokens: document.getElementById('prefix-tokens').textContent,
  forward: document.querySelector('#split-forward b') &&
           document.querySelector('#split-forward b').textContent,
  rows: [...document.querySelectorAll('#recent tbody tr.request')].map(tr => ({
      id: tr.title, status: tr.children[3].textContent,
      output: tr.children[6].textContent, e2e: tr.children[9].textContent})),
  points: document.querySelector('#chart-tokens polyline').getAttribute('points'),
  status: document.getElementById('status').textContent,
})"""


def _look_until(page, predicate, timeout: float, what: str) -> dict:
    """The page's figures, once ``predicate`` holds for them."""
    deadline = time.monotonic() + timeout
    while True:
        figures = json.loads(page.evaluate(_FIGURES))
        if predicate(figures):
            return figures
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {figures}")
        time.sleep(0.1)


@pytest.mark.slow
def test_dashboard_in_chromium_under_load(server):
    if chromium_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; scripts/test.sh installs it")
        pytest.skip("chromium is not installed (scripts/test.sh installs it)")
    ARTIFACTS.mkdir(exist_ok=True)

    def finished_is_not(text: str) -> str:
        return f"document.getElementById('requests-finished').textContent !== {json.dumps(text)}"

    with open_page(f"{server.base_url}/dashboard") as page:
        page.wait_for("Number(document.body.dataset.updates) >= 1", timeout=30,
                      what="the page's first update")
        idle = json.loads(page.evaluate(_FIGURES))
        # the load starts once the page is up, so it is still going between the looks
        with _Load(server.base_url) as load:
            page.wait_for(finished_is_not(idle["finished"]), timeout=30,
                          what="the page to count the load's requests")
            first = json.loads(page.evaluate(_FIGURES))
            second = _look_until(
                page, lambda f: (f["updates"] >= first["updates"] + 2
                                 and f["finished"] != first["finished"]
                                 and sum(r["id"] in set(load.ids) for r in f["rows"]) >= 3),
                timeout=30, what="the figures to change and the load's requests to show")
            page.screenshot(ARTIFACTS / "dashboard.png")
        urls = {e["params"]["request"]["url"] for e in page.events
                if e.get("method") == "Network.requestWillBeSent"}
    assert not load.errors, load.errors[:3]
    assert second["status"].startswith("live")
    assert int(second["finished"].replace(",", "")) > int(first["finished"].replace(",", ""))
    assert second["steps"] != first["steps"]
    assert second["tokensOut"] != first["tokensOut"]
    assert int(second["ttftCount"]) > 0
    # the load shares a long prefix: the hit-rate tile shows a percentage
    assert re.fullmatch(r"\d+(\.\d)?%", second["prefixHit"]), second["prefixHit"]
    assert float(second["prefixHit"][:-1]) > 0
    assert second["prefixTokens"].endswith("prompt tokens cached")
    assert second["forward"] and second["forward"] != "— ms"
    assert len(second["points"].split()) == 60
    rows = second["rows"]
    assert 3 <= len(rows) <= 20
    served = set(load.ids)
    assert sum(r["id"] in served for r in rows) >= 3
    for row in rows:
        if row["id"] in served:
            assert row["status"] == "ok"
            assert int(row["output"]) in (8, 16, 24)
            assert float(row["e2e"].replace(",", "")) > 0
    # the page talks to Baton alone
    assert urls and all(u.startswith(server.base_url) for u in urls), urls
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
