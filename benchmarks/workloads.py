"""Prefix-cache and fairness workloads for serve_load.py and compare.py.

They reuse serve_load's streaming client and figures; only the prompts and
the arrival pattern differ from its random workload:

- ``shared-prefix``: ``users`` clients at once, each sending ``requests_per_user``
  completions one after another; every prompt is one common system prompt
  (``prefix_len`` token ids) followed by a question of its own
  (``question_len`` token ids). One request with the prefix goes first (not
  measured): a running service has its system prompt cached.
- ``multi-turn``: ``users`` chat conversations at once, ``turns`` turns each;
  every turn resends the whole history (a user-specific context of
  ``context_words`` words, then each question and the answer streamed back)
  plus a new question of ``question_words`` words.
- ``grounded``: ``users`` chat clients at once asking for a given passage
  (``passage_words`` words of the public-domain texts in benchmarks/data,
  each request its own stretch) to be copied out with one sentence per line:
  an answer that repeats much of its prompt, where speculative decoding by
  prompt lookup shines (editing, extraction, RAG, code).
- ``chat``: ``users`` chat clients at once, open questions with nothing to
  copy from.
- ``long-prefill``: ``num_short`` short completions (``short_len`` token ids)
  arriving ``spacing_s`` apart on an idle server, then the same number of
  such requests (fresh prompts of the same shape) arriving while one
  ``long_len``-token prompt is being prefilled: their time to first token,
  idle against during.

Every request is greedy with ``ignore_eos``, streamed with usage; token ids
are drawn from [MIN_TOKEN_ID, vocab) by an RNG seeded with (seed, stream, k),
so runs reproduce and no two requests of a run share more than intended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serve_load import (_WORDS, MIN_TOKEN_ID, LoadResult, RequestRecord,
                                   auth_headers, client_session, normalize_base_url,
                                   run_pool, summarize, timed_request)

WORKLOADS = ("shared-prefix", "multi-turn", "long-prefill", "grounded", "chat")

# RNG streams, so that prefixes, questions and contexts never coincide
_PREFIX, _QUESTION, _CONTEXT, _LONG, _SHORT = range(1, 6)


def token_ids(seed: int, stream: int, index: int, n: int, vocab: int) -> list[int]:
    rng = np.random.default_rng([seed, stream, index])
    return rng.integers(MIN_TOKEN_ID, vocab, n).tolist()


def words(seed: int, stream: int, index: int, n: int) -> str:
    rng = np.random.default_rng([seed, stream, index])
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n))


def _completion(model: str, prompt: list[int], output_len: int) -> bytes:
    return json.dumps({
        "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()


def _run_fields(base: str, model: str, users: int, num_requests: int, prompt_len: int,
                output_len: int, seed: int) -> dict[str, Any]:
    return dict(base_url=base, model=model, concurrency=users, num_requests=num_requests,
                prompt_len=prompt_len, output_len=output_len, text_prompts=False, seed=seed,
                first_request=0)


async def run_shared_prefix(base_url: str, model: str, *, users: int = 32, requests_per_user: int = 2,
                            prefix_len: int = 1000, question_len: int = 100,
                            output_len: int = 64, seed: int = 0, vocab: int = 49152,
                            api_key: str | None = None, timeout: float = 900.0) -> LoadResult:
    base = normalize_base_url(base_url)
    url = base + "/v1/completions"
    prefix = token_ids(seed, _PREFIX, 0, prefix_len, vocab)
    warm, _ = await run_pool(url, [_completion(
        model, prefix + token_ids(seed, _QUESTION, 10**6, question_len, vocab), 4)],
        1, api_key, timeout)
    if warm[0].error:
        raise RuntimeError(f"warm-up failed: {warm[0].error}: {warm[0].error_detail}")
    n = users * requests_per_user
    bodies = [_completion(model, prefix + token_ids(seed, _QUESTION, k, question_len, vocab),
                          output_len) for k in range(n)]
    records, wall_s = await run_pool(url, bodies, users, api_key, timeout)
    return summarize(records, wall_s, **_run_fields(base, model, users, n,
                                                    prefix_len + question_len, output_len,
                                                    seed))


async def run_multi_turn(base_url: str, model: str, *, users: int = 16, turns: int = 4,
                         context_words: int = 400, question_words: int = 30,
                         output_len: int = 64, seed: int = 0, api_key: str | None = None,
                         timeout: float = 900.0) -> tuple[LoadResult, LoadResult]:
    """(every turn, turns 2 and later): the later turns are where a prefix
    cache finds the conversation so far."""
    base = normalize_base_url(base_url)
    url = base + "/v1/chat/completions"
    headers = auth_headers(api_key)
    records = [[RequestRecord(u * turns + t) for t in range(turns)] for u in range(users)]

    async def conversation(session, user: int) -> None:
        messages = [{"role": "system", "content": words(seed, _CONTEXT, user, context_words)}]
        for turn in range(turns):
            question = words(seed, _QUESTION, user * turns + turn, question_words)
            messages.append({"role": "user", "content": question})
            body = json.dumps({
                "model": model, "messages": messages, "max_tokens": output_len,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}).encode()
            record = records[user][turn]
            await timed_request(session, url, body, headers, record, timeout)
            if record.error:
                return  # the conversation cannot go on without its answer
            messages.append({"role": "assistant", "content": record.text})

    async with client_session(users) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(session, u) for u in range(users)))
        wall_s = time.perf_counter() - t0
    everything = [r for user in records for r in user]
    later = [r for user in records for r in user[1:]]
    fields = _run_fields(base, model, users, len(everything), context_words, output_len, seed)
    return (summarize(everything, wall_s, **fields),
            summarize(later, wall_s, **{**fields, "num_requests": len(later)}))


_DATA = Path(__file__).resolve().parent / "data"
_TOPICS = ("the sea", "a lighthouse keeper", "bread", "winter in a city", "a lost key",
           "the first bicycle", "bees", "a night train", "an old map", "rain on a roof",
           "a chess game", "mountains", "a letter never sent", "the moon", "a garden",
           "a clockmaker")
_ASKS = ("Write a short story about {}.", "Explain how {} changed someone's life.",
         "Describe {} to a child.", "Write a poem about {}.")


def passage(index: int, n_words: int) -> str:
    """Request ``index``'s stretch of ``n_words`` words of the benchmark texts
    (each request starts elsewhere, so no two share a prompt prefix)."""
    text = " ".join(" ".join((_DATA / name).read_text().split())
                    for name in sorted(p.name for p in _DATA.glob("*.txt")))
    all_words = text.split()
    start = (index * 97) % max(1, len(all_words) - n_words)
    return " ".join(all_words[start:start + n_words])


def grounded_asks(seed: int, num_requests: int, passage_words: int) -> list[str]:
    """The grounded workload's user messages: copy out a passage."""
    return [f"Task {seed}-{k}. Copy out the following text exactly, one sentence per "
            f"line:\n\n{passage(seed * 1000 + k, passage_words)}" for k in range(num_requests)]


def chat_asks(seed: int, num_requests: int) -> list[str]:
    """The chat workload's user messages: a story, an explanation or a poem."""
    asks = []
    for k in range(num_requests):
        i = seed * 1000 + k
        ask = _ASKS[i % len(_ASKS)].format(_TOPICS[(i // len(_ASKS)) % len(_TOPICS)])
        asks.append(f"({i}) {ask}")
    return asks


def _chat(model: str, content: str, output_len: int) -> bytes:
    return json.dumps({
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}).encode()


async def spec_counters(base: str, api_key: str | None = None) -> tuple[float, float] | None:
    """Baton's proposed and accepted speculative tokens so far (its
    ``baton_spec_decode_*_tokens_total``, every method), or None where the
    server has no such metrics."""
    import aiohttp
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(base + "/metrics", headers=auth_headers(api_key)) as resp:
                text = await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return None
    return spec_totals(text)


def spec_totals(metrics_text: str) -> tuple[float, float] | None:
    """(proposed, accepted) summed over the ``baton_spec_decode_*`` counters of
    a Prometheus page; (0, 0) for a Baton page without them yet (a labelled
    counter has no sample before its first increment); None for a server
    that is not Baton."""
    totals = {"proposed": 0.0, "accepted": 0.0}
    baton = False
    for line in metrics_text.splitlines():
        baton = baton or line.startswith("baton_")
        for key in totals:
            if line.startswith(f"baton_spec_decode_{key}_tokens_total"):
                totals[key] += float(line.rsplit(" ", 1)[-1])
    return (totals["proposed"], totals["accepted"]) if baton else None


async def _spec_run(base: str, url: str, bodies: list[bytes], users: int,
                    api_key: str | None, timeout: float, **fields) -> LoadResult:
    """run_pool and summarize, with the speculative tokens of the run from
    Baton's metrics where the streams did not carry them."""
    before = await spec_counters(base, api_key)
    records, wall_s = await run_pool(url, bodies, users, api_key, timeout)
    result = summarize(records, wall_s, **fields)
    after = await spec_counters(base, api_key) if before is not None else None
    if result.spec_proposed is None and after is not None:
        result.spec_proposed = int(after[0] - before[0])
        result.spec_accepted = int(after[1] - before[1])
    return result


async def run_grounded(base_url: str, model: str, *, users: int = 1, num_requests: int = 4,
                       passage_words: int = 300, output_len: int = 256, seed: int = 0,
                       api_key: str | None = None, timeout: float = 900.0) -> LoadResult:
    base = normalize_base_url(base_url)
    bodies = [_chat(model, ask, output_len)
              for ask in grounded_asks(seed, num_requests, passage_words)]
    return await _spec_run(base, base + "/v1/chat/completions", bodies, users, api_key,
                           timeout, **_run_fields(base, model, users, num_requests,
                                                  passage_words, output_len, seed))


async def run_chat(base_url: str, model: str, *, users: int = 1, num_requests: int = 4,
                   output_len: int = 256, seed: int = 0, api_key: str | None = None,
                   timeout: float = 900.0) -> LoadResult:
    base = normalize_base_url(base_url)
    bodies = [_chat(model, ask, output_len) for ask in chat_asks(seed, num_requests)]
    return await _spec_run(base, base + "/v1/chat/completions", bodies, users, api_key,
                           timeout, **_run_fields(base, model, users, num_requests, 0,
                                                  output_len, seed))


async def run_long_prefill(base_url: str, model: str, *, long_len: int = 4000,
                           short_len: int = 100, num_short: int = 8, spacing_s: float = 0.1,
                           delay_s: float = 0.1, output_len: int = 16, seed: int = 0,
                           vocab: int = 49152, api_key: str | None = None,
                           timeout: float = 900.0) -> dict[str, Any]:
    """Short requests' TTFT on an idle server, then while a long prompt is
    being prefilled (the first short one ``delay_s`` after the long one)."""
    base = normalize_base_url(base_url)
    url = base + "/v1/completions"
    headers = auth_headers(api_key)

    async def send(session, body: bytes, at: float, record: RequestRecord) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        await timed_request(session, url, body, headers, record, timeout)

    async def shorts(session, first: int, start: float) -> list[RequestRecord]:
        recs = [RequestRecord(first + i) for i in range(num_short)]
        await asyncio.gather(*(send(session, _completion(
            model, token_ids(seed, _SHORT, first + i, short_len, vocab), output_len),
            start + i * spacing_s, rec) for i, rec in enumerate(recs)))
        return recs

    async with client_session(num_short + 1) as session:
        idle = await shorts(session, 0, time.perf_counter())
        long_rec = RequestRecord(-1)
        t0 = time.perf_counter()
        long_task = asyncio.ensure_future(send(session, _completion(
            model, token_ids(seed, _LONG, 0, long_len, vocab), output_len), t0, long_rec))
        during = await shorts(session, num_short, t0 + delay_s)
        await long_task
    failed = [r for r in idle + during + [long_rec] if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed; first: {failed[0].error}: "
                           f"{failed[0].error_detail}")

    def ttft_ms(recs: list[RequestRecord], q: float) -> float:
        return float(np.percentile([r.ttft_s for r in recs], q)) * 1e3

    # a short request "during" must have arrived before the long one's first token
    arrived_during = sum(delay_s + i * spacing_s < (long_rec.ttft_s or 0.0)
                         for i in range(num_short))
    return {
        "short_ttft_p50_idle_ms": ttft_ms(idle, 50),
        "short_ttft_p50_during_ms": ttft_ms(during, 50),
        "short_ttft_max_during_ms": ttft_ms(during, 100),
        "long_ttft_ms": long_rec.ttft_s * 1e3,
        "slowdown_p50": ttft_ms(during, 50) / ttft_ms(idle, 50),
        "shorts_arrived_during_prefill": arrived_during,
        "long_len": long_len, "short_len": short_len, "num_short": num_short,
    }


async def run_workload(workload: str, base_url: str, model: str, seed: int,
                       options: dict[str, Any]) -> dict[str, Any]:
    """One workload's figures as a flat dict (compare.py's table and ratios)."""
    if workload == "shared-prefix":
        r = await run_shared_prefix(base_url, model, seed=seed, **options)
        return {**_figures(r), "result": r.to_dict()}
    if workload == "multi-turn":
        everything, later = await run_multi_turn(base_url, model, seed=seed, **options)
        return {**_figures(everything), "later_ttft_p50_ms": later.ttft_p50_ms,
                "later_cached_share": later.cached_share, "result": everything.to_dict()}
    if workload == "long-prefill":
        return await run_long_prefill(base_url, model, seed=seed, **options)
    # grounded and chat measure throughput: a peer's failed request is
    # counted (num_errors) and the figures cover the rest, as compare.py's
    # random workload does.
    if workload == "grounded":
        return _figures(await run_grounded(base_url, model, seed=seed, **options), True)
    if workload == "chat":
        return _figures(await run_chat(base_url, model, seed=seed, **options), True)
    raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")


def _figures(r: LoadResult, count_failures: bool = False) -> dict[str, Any]:
    if r.num_errors and not count_failures:
        first = next(x for x in r.requests if x.error)
        raise RuntimeError(f"{r.num_errors} requests failed: {r.errors}; first: "
                           f"{first.error_detail!r}")
    return {"ttft_p50_ms": r.ttft_p50_ms, "ttft_p99_ms": r.ttft_p99_ms,
            "output_tok_per_s": r.output_tok_per_s, "req_per_s": r.req_per_s,
            "itl_p50_ms": r.itl_p50_ms, "e2e_p50_s": r.e2e_p50_s,
            "cached_share": r.cached_share, "num_ok": r.num_ok, "num_errors": r.num_errors,
            "wall_s": r.wall_s,
            "concurrency": r.concurrency, "spec_proposed": r.spec_proposed,
            "spec_accepted": r.spec_accepted,
            "spec_acceptance": (r.spec_accepted / r.spec_proposed
                                if r.spec_proposed else None)}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", nargs="+", default=["random"], choices=("random", *WORKLOADS),
                    help="random: fresh random prompts at each --concurrency; or one or "
                         "more of the workloads of benchmarks/workloads.py, run in turn")
    ap.add_argument("--users", type=int, default=None,
                    help="shared-prefix (default 32) and multi-turn (16) clients at once")
    ap.add_argument("--requests-per-user", type=int, default=2, help="shared-prefix")
    ap.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix")
    ap.add_argument("--question-len", type=int, default=100, help="shared-prefix")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn")
    ap.add_argument("--context-words", type=int, default=400, help="multi-turn")
    ap.add_argument("--question-words", type=int, default=30, help="multi-turn")
    ap.add_argument("--long-len", type=int, default=4000, help="long-prefill")
    ap.add_argument("--short-len", type=int, default=100, help="long-prefill")
    ap.add_argument("--num-short", type=int, default=8, help="long-prefill")
    ap.add_argument("--passage-words", type=int, default=300, help="grounded")
    ap.add_argument("--workload-requests", type=int, default=None,
                    help="grounded and chat: requests (default 4 x --users)")


def check_workload_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if "random" in args.workload and len(args.workload) > 1:
        ap.error("--workload random runs alone")
    args.workload_names = [] if args.workload == ["random"] else list(dict.fromkeys(args.workload))


def workload_options(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    """The keyword arguments of ``workload``'s run_* function."""
    common = dict(output_len=args.output_len, api_key=args.api_key, timeout=args.timeout)
    if workload == "long-prefill":
        common["output_len"] = min(args.output_len, 16)   # only the first token matters
    if workload == "shared-prefix":
        return dict(users=args.users or 32, requests_per_user=args.requests_per_user,
                    prefix_len=args.prefix_len, question_len=args.question_len,
                    vocab=args.vocab, **common)
    if workload == "multi-turn":
        return dict(users=args.users or 16, turns=args.turns, context_words=args.context_words,
                    question_words=args.question_words, **common)
    if workload in ("grounded", "chat"):
        users = args.users or 1
        extra = dict(passage_words=args.passage_words) if workload == "grounded" else {}
        return dict(users=users, num_requests=args.workload_requests or 4 * users, **extra,
                    **common)
    return dict(long_len=args.long_len, short_len=args.short_len, num_short=args.num_short,
                vocab=args.vocab, **common)
