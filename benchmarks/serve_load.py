"""Serving load: N streaming completions at a fixed concurrency against any
OpenAI-compatible server (Baton, vLLM, llama.cpp's llama-server).

Each request is `POST /v1/completions` with a random prompt, temperature 0,
`ignore_eos` and `stream_options.include_usage`; a pool of `concurrency`
workers keeps exactly that many requests in flight. Prints one markdown row
per concurrency (paste into docs/benchmarks.md); `--json` keeps every figure.

    .venv/bin/python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 \
        [--model NAME] [--concurrency 1 8 32] [--num-requests N] [--prompt-len 128] \
        [--output-len 128] [--seed S] [--api-key K] [--timeout 300] [--json OUT.json] \
        [--text-prompts] [--vocab 49152] [--no-warmup]

Every request of every run gets a fresh prompt (servers cache prefixes, and a
repeated prompt would measure the cache, not the server): request k draws its
prompt from an RNG seeded with (seed, k), and k keeps counting across runs.
TTFT is send -> first event carrying a choice; inter-token latency is the gap
between successive token events (a chunk carrying several tokens counts once);
output tokens come from the final usage chunk, else the number of token events.
Errors (HTTP status other than 200, error events, timeouts, refused
connections) are counted, never fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

import aiohttp
import numpy as np

DEFAULT_VOCAB = 49152
# Low ids are special or control tokens in most vocabularies.
MIN_TOKEN_ID = 1000
DEFAULT_TIMEOUT_S = 300.0

# For --text-prompts: about one token per word in common BPE vocabularies.
_WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education river stone garden window"
).split()


class LoadSetupError(RuntimeError):
    """The server could not be set up for a run (e.g. no model to name)."""


@dataclass(slots=True)
class RequestRecord:
    """What one request measured; `error` is None when it succeeded."""

    index: int
    error: str | None = None
    error_detail: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    token_events: int = 0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None   # from the usage chunk
    cached_tokens: int | None = None   # usage.prompt_tokens_details.cached_tokens, if sent
    text: str = ""                     # the streamed text (multi-turn sends it back)
    # speculative decoding, where the server says per request (llama-server's
    # ``timings.draft_n`` / ``draft_n_accepted``)
    draft_tokens: int | None = None
    draft_accepted: int | None = None

    def fail(self, kind: str, detail: str = "") -> None:
        self.error, self.error_detail = kind, detail[:300]

    def summary(self) -> dict[str, Any]:
        return {"index": self.index, "error": self.error, "error_detail": self.error_detail,
                "ttft_s": self.ttft_s, "e2e_s": self.e2e_s,
                "output_tokens": self.output_tokens, "token_events": self.token_events,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}


@dataclass(slots=True)
class LoadResult:
    """Figures of one run at one concurrency. Latency figures cover successful
    requests only and are None when there were none; `output_tokens` likewise."""

    base_url: str
    model: str
    concurrency: int
    num_requests: int
    prompt_len: int
    output_len: int
    text_prompts: bool
    seed: int
    first_request: int
    num_ok: int
    num_errors: int
    errors: dict[str, int]
    num_short: int  # ok requests with fewer than output_len tokens (ignore_eos not honoured?)
    wall_s: float
    output_tokens: int
    output_tok_per_s: float
    req_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_p50_ms: float | None  # (e2e - ttft) / (tokens - 1): fair when chunks carry several tokens
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    requests: list[RequestRecord]
    # prompt tokens the server reported, and the share it said came from its
    # prefix cache (None when it reports no cached tokens)
    prompt_tokens: int = 0
    cached_share: float | None = None
    # speculative decoding's proposed and accepted tokens over the run, where
    # the server reports them (per request, as llama-server does, or in its
    # metrics: benchmarks/workloads.py reads Baton's)
    spec_proposed: int | None = None
    spec_accepted: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "requests"}
        out["requests"] = [r.summary() for r in self.requests]
        return out


class SSEDecoder:
    """Incremental text/event-stream decoder: feed raw bytes as they arrive,
    get back the data of each complete event. Comments (keep-alives) and
    fields other than `data` are dropped; multi-line data is joined by "\\n"."""

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()  # incomplete last line; b"\n" never sits inside a UTF-8 char
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif not line.startswith(b":"):
                name, _, value = line.partition(b":")
                if name == b"data":
                    self._data.append(value.removeprefix(b" ").decode("utf-8", "replace"))
        return events

    def finish(self) -> list[str]:
        """Events left when the stream ends without a final blank line."""
        events = self.feed(b"\n\n") if self._tail else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events


class _StreamFailed(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(kind)
        self.kind, self.detail = kind, detail


class _StreamTally:
    """Timestamps and counts of one completion stream, event by event. A chat
    stream carries text in ``delta.content`` and opens with a role-only chunk,
    which is not a token."""

    def __init__(self, t_send: float, chat: bool = False) -> None:
        self.t_send = t_send
        self.chat = chat
        self.text: list[str] = []
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.ttft_s: float | None = None
        self.t_done: float | None = None
        self.t_last_token: float | None = None
        self.itl_s: list[float] = []
        self.token_events = 0
        self.usage_tokens: int | None = None
        self.draft: tuple[int, int] | None = None
        self.finished = False

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.t_done = now
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise _StreamFailed("bad event", data) from None
        if not isinstance(event, dict):
            raise _StreamFailed("bad event", data)
        if event.get("error"):
            raise _StreamFailed("error event", json.dumps(event["error"]))
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
            self.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]
        timings = event.get("timings")
        if isinstance(timings, dict) and isinstance(timings.get("draft_n"), int):
            self.draft = (timings["draft_n"], int(timings.get("draft_n_accepted") or 0))
        choices = [c for c in event.get("choices") or () if isinstance(c, dict)]
        if not choices:
            return
        self.finished |= any(c.get("finish_reason") for c in choices)
        if any(self._is_token(c) for c in choices):
            if self.ttft_s is None:
                self.ttft_s = now - self.t_send
            if self.t_last_token is not None:
                self.itl_s.append(now - self.t_last_token)
            self.t_last_token = now
            self.token_events += 1

    def _is_token(self, choice: dict) -> bool:
        # A chunk with empty text that only closes the stream is not a token;
        # one with empty text and no finish_reason is (text held back by a
        # detokenizer), unless it is a chat stream's opening role chunk.
        if self.chat:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                self.text.append(content)
                return True
            return not choice.get("finish_reason") and "role" not in delta
        text = choice.get("text")
        if text:
            self.text.append(text)
            return True
        return not choice.get("finish_reason")


async def _stream_completion(session: aiohttp.ClientSession, url: str, body: bytes,
                             headers: dict[str, str], record: RequestRecord) -> None:
    tally = _StreamTally(time.perf_counter(), chat=url.endswith("/chat/completions"))
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            raise _StreamFailed(f"http {resp.status}", await resp.text(errors="replace"))
        decoder = SSEDecoder()
        # Read to the end even after [DONE], as the OpenAI client does, so the
        # connection goes back to the pool instead of being closed.
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            for data in decoder.feed(chunk):
                if tally.t_done is None:
                    tally.on_event(data, now)
        if tally.t_done is None:
            for data in decoder.finish():
                tally.on_event(data, time.perf_counter())
    if tally.t_done is None and not tally.finished:
        raise _StreamFailed("stream ended early", f"after {tally.token_events} token events")
    record.ttft_s = tally.ttft_s
    record.e2e_s = (tally.t_done or time.perf_counter()) - tally.t_send
    record.itl_s = tally.itl_s
    record.token_events = tally.token_events
    record.output_tokens = (tally.usage_tokens if tally.usage_tokens is not None
                            else tally.token_events)
    record.prompt_tokens = tally.prompt_tokens
    record.cached_tokens = tally.cached_tokens
    record.text = "".join(tally.text)
    if tally.draft is not None:
        record.draft_tokens, record.draft_accepted = tally.draft


async def timed_request(session: aiohttp.ClientSession, url: str, body: bytes,
                         headers: dict[str, str], record: RequestRecord,
                         timeout: float) -> None:
    try:
        await asyncio.wait_for(_stream_completion(session, url, body, headers, record), timeout)
    except asyncio.TimeoutError:
        record.fail("timeout", f"no complete response within {timeout:g} s")
    except _StreamFailed as exc:
        record.fail(exc.kind, exc.detail)
    except (aiohttp.ClientError, OSError) as exc:
        record.fail(f"connection: {type(exc).__name__}", str(exc))


def normalize_base_url(base_url: str) -> str:
    """`http://host:8000`, `.../` and `.../v1` all name the same server."""
    return base_url.rstrip("/").removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def make_prompt(seed: int, request_index: int, prompt_len: int, vocab: int = DEFAULT_VOCAB,
                text: bool = False) -> list[int] | str:
    """Prompt of request `request_index`: reproducible from the pair, and
    different for every index."""
    rng = np.random.default_rng([seed, request_index])
    if text:
        return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), prompt_len))
    return rng.integers(MIN_TOKEN_ID, vocab, prompt_len).tolist()


async def fetch_model_id(base_url: str, api_key: str | None = None,
                         timeout: float = 30.0) -> str:
    """The first model `GET /v1/models` lists."""
    url = normalize_base_url(base_url) + "/v1/models"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url, headers=auth_headers(api_key)) as resp:
            if resp.status != 200:
                detail = (await resp.text(errors="replace"))[:200]
                raise LoadSetupError(f"GET {url} answered HTTP {resp.status} ({detail}); "
                                     "pass --model")
            listing = await resp.json(content_type=None)
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise LoadSetupError(f"GET {url} lists no models; pass --model")
    return str(models[0]["id"])


def _percentile(values: list[float], q: float, scale: float) -> float | None:
    return float(np.percentile(values, q)) * scale if values else None


def summarize(records: list[RequestRecord], wall_s: float, **run: Any) -> LoadResult:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.output_tokens > 1 and r.ttft_s is not None and r.e2e_s is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    drafted = [r for r in ok if r.draft_tokens is not None]
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached_share = (sum(r.cached_tokens for r in reported)
                    / sum(r.prompt_tokens for r in reported)) if reported else None
    return LoadResult(
        **run, num_ok=len(ok), num_errors=len(records) - len(ok),
        errors=dict(Counter(r.error for r in records if r.error is not None)),
        num_short=sum(r.output_tokens < run["output_len"] for r in ok),
        wall_s=wall_s, output_tokens=output_tokens,
        output_tok_per_s=output_tokens / wall_s if wall_s > 0 else 0.0,
        req_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_ms=_percentile(ttft, 50, 1e3), ttft_p99_ms=_percentile(ttft, 99, 1e3),
        itl_p50_ms=_percentile(itl, 50, 1e3), itl_p99_ms=_percentile(itl, 99, 1e3),
        tpot_p50_ms=_percentile(tpot, 50, 1e3),
        e2e_p50_s=_percentile(e2e, 50, 1.0), e2e_p99_s=_percentile(e2e, 99, 1.0),
        requests=records, prompt_tokens=prompt_tokens, cached_share=cached_share,
        spec_proposed=sum(r.draft_tokens for r in drafted) if drafted else None,
        spec_accepted=sum(r.draft_accepted or 0 for r in drafted) if drafted else None)


def client_session(limit: int) -> aiohttp.ClientSession:
    """Requests are bounded by their own `timeout` (asyncio.wait_for), not the session."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None))


async def run_pool(url: str, bodies: list[bytes], concurrency: int, api_key: str | None,
                   timeout: float) -> tuple[list[RequestRecord], float]:
    """Send every body, `concurrency` in flight at a time; (records, wall seconds)."""
    records = [RequestRecord(i) for i in range(len(bodies))]
    headers = auth_headers(api_key)
    pending = iter(range(len(bodies)))  # shared: each index is taken by exactly one worker
    async with client_session(concurrency) as session:
        async def worker() -> None:
            for i in pending:
                await timed_request(session, url, bodies[i], headers, records[i], timeout)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        wall_s = time.perf_counter() - t0
    return records, wall_s


async def run_load(base_url: str, model: str | None, concurrency: int, num_requests: int,
                   prompt_len: int, output_len: int, *, seed: int | None = None,
                   first_request: int = 0, vocab: int = DEFAULT_VOCAB,
                   text_prompts: bool = False, api_key: str | None = None,
                   timeout: float = DEFAULT_TIMEOUT_S,
                   extra_body: dict[str, Any] | None = None) -> LoadResult:
    """Send `num_requests` streaming completions, `concurrency` at a time, and
    measure them. Request k of this run uses prompt (seed, first_request + k):
    callers that run several loads with one seed advance `first_request` by
    the previous run's `num_requests`; with seed None a fresh seed is drawn.
    `model` None means the first model the server lists. `extra_body` fields
    are merged into every request (a None value removes the field). Failed
    requests are counted in the result; only bad arguments and model
    discovery raise."""
    for name, value in (("concurrency", concurrency), ("num_requests", num_requests),
                        ("prompt_len", prompt_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if vocab <= MIN_TOKEN_ID:
        raise ValueError(f"vocab must exceed {MIN_TOKEN_ID} (prompt ids are drawn from "
                         f"[{MIN_TOKEN_ID}, vocab)), got {vocab}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    seed = secrets.randbits(63) if seed is None else seed
    if seed < 0 or first_request < 0:
        raise ValueError("seed and first_request must not be negative")
    base = normalize_base_url(base_url)
    if model is None:
        model = await fetch_model_id(base, api_key, timeout=min(timeout, 30.0))

    def body(i: int) -> bytes:
        fields = {
            "model": model,
            "prompt": make_prompt(seed, first_request + i, prompt_len, vocab, text_prompts),
            "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **(extra_body or {})}
        return json.dumps({k: v for k, v in fields.items() if v is not None}).encode()

    bodies = [body(i) for i in range(num_requests)]
    records, wall_s = await run_pool(base + "/v1/completions", bodies, concurrency,
                                     api_key, timeout)
    return summarize(records, wall_s, base_url=base, model=model, concurrency=concurrency,
                      num_requests=num_requests, prompt_len=prompt_len,
                      output_len=output_len, text_prompts=text_prompts, seed=seed,
                      first_request=first_request)


TABLE_HEADER = (
    "| concurrency | ok / errors | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) "
    "| ITL p50 (ms) | ITL p99 (ms) | e2e p50 (s) |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_row(r: LoadResult) -> str:
    cells = (str(r.concurrency), f"{r.num_ok} / {r.num_errors}",
             _cell(r.output_tok_per_s, ".1f"), _cell(r.req_per_s, ".2f"),
             _cell(r.ttft_p50_ms, ".1f"), _cell(r.ttft_p99_ms, ".1f"),
             _cell(r.itl_p50_ms, ".1f"), _cell(r.itl_p99_ms, ".1f"),
             _cell(r.e2e_p50_s, ".2f"))
    return "| " + " | ".join(cells) + " |"


def format_header(date: str, base_url: str, model: str, prompt_len: int, output_len: int,
                  text_prompts: bool) -> str:
    kind = "words" if text_prompts else "random token ids"
    return (f"{date} · {base_url} · model `{model}` · prompt {prompt_len} {kind} · "
            f"output {output_len} tokens (ignore_eos, temperature 0, streaming)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, default=None,
                    help="per concurrency; default max(8, 4 * concurrency)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                    help=f"prompt token ids are drawn from [{MIN_TOKEN_ID}, vocab)")
    ap.add_argument("--text-prompts", action="store_true",
                    help="send random words instead of token ids")
    ap.add_argument("--seed", type=int, default=None,
                    help="default: a fresh one. The same seed in a later invocation resends "
                         "the same prompts, which a running server may still have cached")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds per request")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the one short request sent before the first run")
    ap.add_argument("--json", default=None, metavar="OUT.json", help="write all figures here")
    _workloads().add_workload_args(ap)
    args = ap.parse_args(argv)
    _workloads().check_workload_args(ap, args)
    if min(args.concurrency) < 1 or (args.num_requests is not None and args.num_requests < 1):
        ap.error("--concurrency and --num-requests must be at least 1")
    return args


async def wait_until_serving(base_url: str, model: str, api_key: str | None = None,
                             deadline_s: float = 600.0, seed: int = 0,
                             vocab: int = DEFAULT_VOCAB) -> None:
    """Send one short request until it succeeds; a server that listens before
    its model is loaded answers 503 meanwhile (retried until ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    while True:
        warm = await run_load(base_url, model, 1, 1, 8, 4, seed=seed, vocab=vocab,
                              api_key=api_key, timeout=min(deadline_s, 300.0))
        if not warm.num_errors:
            return
        rec = warm.requests[0]
        if rec.error != "http 503" or time.monotonic() > deadline:
            raise LoadSetupError(f"warm-up request failed: {rec.error}: {rec.error_detail}")
        await asyncio.sleep(1.0)


def _workloads():
    """benchmarks/workloads.py, which builds on this module (imported late;
    this file also runs as a script)."""
    import importlib
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks.workloads")


async def _main_workload(args: argparse.Namespace, base: str, seed: int) -> int:
    workloads = _workloads()
    model = args.model or await fetch_model_id(base, args.api_key, min(args.timeout, 30.0))
    if not args.no_warmup:
        await wait_until_serving(base, model, args.api_key, seed=seed + 1, vocab=args.vocab)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = {"date": date, "base_url": base, "model": model, "seed": seed, "workloads": {}}
    for workload in args.workload_names:
        options = workloads.workload_options(args, workload)
        try:
            figures = await workloads.run_workload(workload, base, model, seed, options)
        except RuntimeError as exc:
            print(f"serve_load: {workload}: {exc}", file=sys.stderr)
            return 1
        print(f"{date} · {base} · model `{model}` · workload {workload} · "
              f"{options | {'api_key': None}} · seed {seed}")
        for key, value in figures.items():
            if key != "result":
                print(f"  {key}: {value:.4g}" if isinstance(value, float)
                      else f"  {key}: {value}")
        report["workloads"][workload] = {"options": options | {"api_key": None},
                                         "figures": figures}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


async def _main(args: argparse.Namespace) -> int:
    base = normalize_base_url(args.base_url)
    seed = secrets.randbits(63) if args.seed is None else args.seed
    if args.workload_names:
        return await _main_workload(args, base, seed)
    common = dict(prompt_len=args.prompt_len, seed=seed, vocab=args.vocab,
                  text_prompts=args.text_prompts, api_key=args.api_key, timeout=args.timeout)
    model = args.model or await fetch_model_id(base, args.api_key, min(args.timeout, 30.0))
    next_request = 0
    if not args.no_warmup:
        # Keeps one-time costs (compilation, graph capture, connection setup)
        # out of the first row, and fails fast on a wrong URL or model.
        warm = await run_load(base, model, 1, 1, output_len=min(4, args.output_len),
                              first_request=next_request, **common)
        next_request += 1
        if warm.num_errors:
            rec = warm.requests[0]
            print(f"warm-up request failed: {rec.error}: {rec.error_detail}", file=sys.stderr)
            return 1
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(format_header(date, base, model, args.prompt_len, args.output_len,
                        args.text_prompts))
    print()
    print(TABLE_HEADER, flush=True)
    results = []
    for concurrency in args.concurrency:
        n = args.num_requests or max(8, 4 * concurrency)
        result = await run_load(base, model, concurrency, n, output_len=args.output_len,
                                first_request=next_request, **common)
        next_request += n
        results.append(result)
        print(format_row(result), flush=True)
        if result.errors:
            print(f"concurrency {concurrency}: errors {result.errors}; first: "
                  f"{next(r.error_detail for r in result.requests if r.error)!r}",
                  file=sys.stderr)
        if result.num_short:
            print(f"concurrency {concurrency}: {result.num_short} requests returned fewer "
                  f"than {args.output_len} tokens (ignore_eos not honoured?)", file=sys.stderr)
    if args.json:
        report = {"date": date, "base_url": base, "model": model, "seed": seed,
                  "prompt_len": args.prompt_len, "output_len": args.output_len,
                  "text_prompts": args.text_prompts, "runs": [r.to_dict() for r in results]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_cli(prog: str, main_coro) -> int:
    """Run a benchmark's async main; setup and connection failures become one
    line on stderr and exit status 1 (130 when interrupted)."""
    try:
        return asyncio.run(main_coro)
    except (LoadSetupError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return run_cli("serve_load", _main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
