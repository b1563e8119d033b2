"""A first-request warm-up before the server reports ready, as vLLM runs a
dummy batch before it answers /health: the first user should not pay for
one-time costs (oneDNN choosing and building its primitives for a new
shape, the native kernels' first calls, the allocator growing, torch's lazy
initialisation of its paths).

The warm-up runs a few short greedy requests through the engine core the
server will use, covering a prefill chunk, a lone decode and a batched
decode (below and above the bf16 gemv's rows: 4) and
one request under a structured-output constraint (so the grammar engine's
tokenizer table, about a second for a large vocabulary, is built now rather
than by the first constrained request), with a draft model for speculative
decoding a request or two that measure the draft's cost (warm: the passes
before do not count), then checks that every KV block and every per-request table came back empty. It runs before the step loop starts
and before metrics are attached, so nothing it does shows in /metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from backends.interface import SamplingParams, StructuredOutputSpec
from scheduler.engine import EngineCore

log = logging.getLogger("baton")

PROMPT_TEXT = "Baton warms up before it serves: the first request should be as fast as any."
# Decode batches the warm-up runs: a lone sequence, then one past the bf16
# gemv's limit of 4 so oneDNN's batched path is built too.
BATCHES = (1, 5)
OUTPUT_TOKENS = 3
CONSTRAINT = StructuredOutputSpec("choice", '["yes", "no"]')
# With a draft model: requests of this many tokens until the draft's cost is
# measured (scheduler/speculative.py, COST_SAMPLES rounds and target steps).
CALIBRATION_TOKENS = 24
CALIBRATION_REQUESTS = 3


@dataclass(frozen=True, slots=True)
class WarmupReport:
    requests: int
    steps: int
    seconds: float


def warm_up(core: EngineCore) -> WarmupReport:
    """Run the warm-up requests to completion on ``core`` (idle, not yet
    serving). Raises what the engine raises: a model that cannot run a short
    request must not report ready."""
    start = time.perf_counter()
    prompt = _prompt(core)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    requests = steps = 0
    for batch in BATCHES:
        batch = min(batch, core.config.max_num_seqs)
        for i in range(batch):
            core.add_request(f"warmup-{batch}-{i}", prompt[:len(prompt) - i], params)
            requests += 1
        steps += _drain(core)
    if core.grammar is not None:
        core.add_request("warmup-constrained", prompt,
                         SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0,
                                        structured=CONSTRAINT))
        requests += 1
        steps += _drain(core)
    spec = core.speculator
    if spec is not None and spec.config.method == "draft_model":
        # A draft model's cost (its proposal round over a target step) is
        # measured now, warm, on a short prompt, so that the server knows
        # from its first request whether the draft pays: otherwise the first
        # request to probe makes the draft prefill its whole prompt, on the
        # user's time, for a draft that may then never propose again.
        spec.budget.forget_costs()
        for _ in range(CALIBRATION_REQUESTS):
            if spec.budget.draft_cost is not None:
                break
            core.add_request(f"warmup-draft-{requests}", prompt, SamplingParams(
                max_tokens=CALIBRATION_TOKENS, temperature=0.0, ignore_eos=True))
            requests += 1
            steps += _drain(core)
        if spec.budget.draft_cost is None:
            log.warning("warm-up: the draft model's cost is not measured yet; the first "
                        "requests probe it")
        else:
            log.info("warm-up: a draft proposal round costs %.2f target steps",
                     spec.budget.draft_cost)
    core.check_integrity()
    left = {table: n for table, n in core.state_sizes().items() if n}
    if left:
        raise RuntimeError(f"the warm-up left per-request state behind: {left}")
    report = WarmupReport(requests, steps, time.perf_counter() - start)
    log.info("warm-up: %d requests, %d engine steps, %.2fs", report.requests, report.steps,
             report.seconds)
    return report


def _drain(core: EngineCore) -> int:
    """Step until the engine has no work (finished requests released in the
    backend too); returns the steps taken."""
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    return steps


def _prompt(core: EngineCore) -> list[int]:
    """A prompt of a block or two of real text, short enough for any context."""
    ids = core.tokenizer.encode(PROMPT_TEXT)
    want = max(8, min(2 * core.kv_cache.block_size, core.max_model_len // 4))
    while len(ids) < want:
        ids = ids + ids
    return ids[:want]
