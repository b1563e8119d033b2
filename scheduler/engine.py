"""The synchronous engine: schedule, execute, postprocess.

``EngineCore.step()`` is the one step sequence; the AsyncEngine runs it on a
worker thread. Requests are validated in ``add_request`` before any compute.
Every stop condition (EOS, stop token ids, stop strings, length) is decided
in one pass over the step's tokens.

Thread safety: every public method may be called from any thread. One lock
guards the scheduler, the detokenizers and the per-request tables; ``step``
holds it while scheduling and while postprocessing, never during the
backend's forward pass, so an ``add_request`` or ``abort`` waits at most for
one postprocess.

Faults: the StepRunner (scheduler/step_runner.py) finds the requests that
make a step fail and reports only those; a request whose detokenization
raises fails alone too. Failed requests end with finish reason ``error`` and
the reason in ``RequestOutput.error``; the others go on untouched.
"""

from __future__ import annotations

import logging
import threading
import time

from backends.config import GenerationDefaults, PoolingConfig
from backends.errors import ContextLengthExceededError, InvalidRequestError
from backends.interface import (Backend, PoolingParams, SamplingParams, SchedulerOutput,
                                StepResult, StepTimings)
from backends.tokenizer import Tokenizer
from cache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.outputs import (EngineLoad, ModelInfo, RequestOutput, SchedulerStats,
                               StepOutcome)
from scheduler.request import FinishReason, Request
from scheduler.speculative import Speculator
from scheduler.scheduler import Scheduler
from scheduler.step_runner import StepRunner, fault_text

log = logging.getLogger("baton.engine")


class EngineCore:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: SchedulerConfig,
                 *, vocab_size: int, eos_token_ids: tuple[int, ...],
                 model_name: str = "model",
                 generation: GenerationDefaults | None = None,
                 max_logprobs: int = 20,
                 pooling: PoolingConfig | None = None, hidden_size: int = 0,
                 speculator: Speculator | None = None) -> None:
        self.model_name = model_name
        # The most top alternatives a request may ask for (--max-logprobs;
        # -1: the whole vocabulary).
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        # How embedding requests pool, and the width of their vectors.
        self.pooling = pooling or PoolingConfig()
        self.hidden_size = hidden_size
        self.generation = generation or GenerationDefaults(eos_token_ids=tuple(eos_token_ids))
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache = KVCacheManager(backend.num_kv_blocks, backend.block_size,
                                       config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache)
        # Speculative decoding (scheduler/speculative.py): proposes each
        # decoding request's next tokens after every step.
        self.speculator = speculator
        if speculator is not None:
            self.scheduler.proposal_budget = speculator.budget
        self._lock = threading.RLock()
        # Compiles structured-output constraints (backends/grammar.py); the
        # gateway warms its cache off the event loop before add_request.
        self.grammar = getattr(backend, "grammar", None)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompt_logprobs: dict[str, list] = {}
        # Seconds a backend step may take before it is abandoned as hung
        # (None: wait for ever). Set by the AsyncEngine from its FaultPolicy.
        self.runner = StepRunner(backend)

    @property
    def backend(self) -> Backend:
        return self.runner.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self.runner.backend = backend  # tests put a fault-injecting one in between

    @property
    def step_timeout(self) -> float | None:
        return self.runner.step_timeout

    @step_timeout.setter
    def step_timeout(self, seconds: float | None) -> None:
        self.runner.step_timeout = seconds

    @property
    def tainted(self) -> str | None:
        """Why the engine can no longer be trusted (a hung step came back), or None."""
        return self.runner.tainted

    @property
    def num_abandoned_steps(self) -> int:
        return self.runner.num_abandoned_steps

    def close(self) -> None:
        self.runner.close()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.model_name, self.max_model_len, self.vocab_size,
                         self.kv_cache.capacity_tokens, self.generation, self.max_logprobs,
                         self.config.max_num_seqs, self.pooling, self.hidden_size)

    # ---------------------------------------------------------------- intake
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0,
                    pooling: PoolingParams | None = None) -> None:
        """Validate and queue. Raises InvalidRequestError (or its subclass
        ContextLengthExceededError) before anything is computed. With
        ``pooling`` it is an embedding request: the prompt is prefilled and
        its final output carries the pooled vector (``params`` is unused)."""
        if priority != 0 and self.config.policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} was given, but this server schedules first come, "
                f"first served; start it with --scheduling-policy priority to honour "
                f"priorities", "priority")
        n = len(prompt_token_ids)
        detokenizer = None
        if pooling is not None:
            self.validate_pooling(prompt_token_ids, pooling)
            request = Request(request_id, list(prompt_token_ids), params, max_tokens=0,
                              priority=priority, pooling=pooling)
        else:
            self.validate(prompt_token_ids, params)
            max_tokens = (self.max_model_len - n if params.max_tokens is None
                          else params.max_tokens)
            request = Request(request_id, list(prompt_token_ids), params,
                              max_tokens=min(max_tokens, self.max_model_len - n),
                              eos_token_ids=self.eos_token_ids, priority=priority)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer.backend, stop=params.stop,
                skip_special_tokens=params.skip_special_tokens)
        with self._lock:
            if request_id in self.scheduler.requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                          "request_id")
            if detokenizer is not None:
                self._detokenizers[request_id] = detokenizer
            self.scheduler.add_request(request)

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Everything about one request that can be checked before it runs.
        Pure: reads only the engine's fixed limits."""
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                "prompt")
        limit = self.max_model_len
        n = len(prompt)
        wanted = 1 if params.max_tokens is None else params.max_tokens
        asked = n + wanted
        # A scored prompt (max_tokens 0) may fill the context; others need room for a token.
        if asked > limit or (n >= limit and wanted > 0):
            # Name what overflows: the prompt alone, or the completion asked for.
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {max(asked, n + 1)} tokens ({n} in the prompt, "
                f"{max(wanted, 1)} for the completion). Please reduce the length "
                f"of the prompt or of max_tokens.",
                "prompt" if n >= limit else "max_tokens")
        for asked in (params.logprobs, params.prompt_logprobs):
            if asked is not None and asked > self.max_logprobs:
                raise InvalidRequestError(
                    f"logprobs must be at most {self.max_logprobs} (this server's "
                    f"--max-logprobs), got {asked}", "logprobs")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{name} names token id {bad}, outside the vocabulary "
                    f"(0..{self.vocab_size - 1})", name)
        if params.structured is not None:
            if self.grammar is None:
                raise InvalidRequestError("this backend does not support structured outputs",
                                          params.structured.param)
            self.grammar.compile(params.structured)

    def validate_pooling(self, prompt: list[int], pooling: PoolingParams) -> None:
        """An embedding request's checks: its prompt may fill the whole
        context (nothing is generated after it), and ``dimensions`` must fit
        the model's vector."""
        if not prompt:
            raise InvalidRequestError("input must not be empty", "input")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"input token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                "input")
        if len(prompt) > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, an input holds {len(prompt)} tokens. Shorten it, or send "
                f"truncate_prompt_tokens to keep only its last tokens.", "input")
        if self.hidden_size and pooling.dimensions is not None \
                and pooling.dimensions > self.hidden_size:
            raise InvalidRequestError(
                f"dimensions {pooling.dimensions} exceeds the model's embedding size "
                f"{self.hidden_size}", "dimensions")

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> RequestOutput | None:
        """End a request now and free its blocks; None if it already ended."""
        with self._lock:
            request = self.scheduler.finish_request(request_id, reason)
            if request is None:
                return None
            if self.speculator is not None:
                self.speculator.release({*self.scheduler.requests})
            return self._final_output(request, [], "", error)

    def abort_all(self, reason: FinishReason = FinishReason.ABORT,
                  error: str | None = None) -> list[RequestOutput]:
        """End every live request (shutdown, or a fault the engine cannot
        pin on fewer requests)."""
        with self._lock:
            ids = list(self.scheduler.requests)
            outputs = [self.abort(request_id, reason, error) for request_id in ids]
        return [out for out in outputs if out is not None]

    def release_finished(self) -> None:
        """Hand the backend the ids of requests that ended since the last step
        (a step does this too; this is for an engine about to stop)."""
        with self._lock:
            output = self.scheduler.schedule() if not self.scheduler.has_unfinished() \
                else None
        if output is not None and output.finished_request_ids:
            self.runner.release(output)

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Requests to run, or finished ones whose backend state is still held."""
        with self._lock:
            return self.scheduler.has_unfinished() or self.scheduler.num_finished_pending > 0

    def load(self) -> EngineLoad:
        with self._lock:
            s, kv = self.scheduler, self.kv_cache
            return EngineLoad(s.num_running, s.num_waiting, s.num_waiting_tokens,
                              kv.num_free_blocks, kv.num_blocks)

    # ------------------------------------------------------------------ step
    def step(self) -> StepOutcome:
        """Schedule, execute, postprocess. Statistics come back with the
        outputs (``stats`` is None when nothing ran)."""
        t0 = time.perf_counter()
        with self._lock:
            output = self.scheduler.schedule()
        schedule_time = time.perf_counter() - t0
        if output.is_empty:
            if output.finished_request_ids:
                self.runner.release(output)
            return StepOutcome([])
        result, faults = self.runner.run(output)
        with self._lock:
            return self._postprocess(output, result, faults, schedule_time)

    def _postprocess(self, output: SchedulerOutput, result: StepResult,
                     faults: dict[str, str], schedule_time: float) -> StepOutcome:
        t0 = time.perf_counter()
        live = self.scheduler.requests
        for request_id, entries in result.prompt_logprobs.items():
            # A request aborted while the step ran has nobody to send them to.
            if request_id in live and request_id not in faults:
                self._prompt_logprobs.setdefault(request_id, []).extend(entries)
        faults = dict(faults)
        failed_requests: list[Request] = []
        # Fail the culprits first: what their rows wrote into the KV cache
        # must not be named in the prefix cache by update_from_output.
        for request_id in faults:
            # None when it was aborted meanwhile: it has had its final output.
            request = self.scheduler.finish_request(request_id, FinishReason.ERROR)
            if request is not None:
                failed_requests.append(request)

        def text_hook(request: Request, token_id: int) -> tuple[str, str | None]:
            try:
                delta = self._detokenizers[request.request_id].push([token_id])
            except Exception as exc:  # noqa: BLE001 - this request's fault only
                faults[request.request_id] = fault_text(exc, "detokenization failed")
                return "", None
            return delta.text, delta.stop_string

        outputs: list[RequestOutput] = []
        hook_failed: list[Request] = []
        for update in self.scheduler.update_from_output(output, result, text_hook):
            request = update.request
            if request.request_id in faults:  # its detokenization failed
                hook_failed.append(request)
                continue
            logprobs = update.logprobs or None
            prompt_logprobs = self._prompt_logprobs.pop(request.request_id, None)
            new_ids = update.token_ids  # none: a scored prompt
            if request.is_finished:
                text = update.text + self._detokenizers[request.request_id].flush()
                outputs.append(self._final_output(request, new_ids, text, None, logprobs))
            else:
                outputs.append(self._output(request, new_ids, update.text, logprobs))
            outputs[-1].prompt_logprobs = prompt_logprobs
        pooled, unpooled = self.scheduler.finish_pooled(output, result)
        for request, vector in pooled:
            outputs.append(self._final_output(request, [], "", None))
            outputs[-1].embedding = vector
        for request in unpooled:
            faults[request.request_id] = "the backend returned no vector for this input"
            failed_requests.append(request)
        for request in hook_failed:
            if request.is_finished:  # it ended on this very token all the same
                failed_requests.append(request)
            elif self.scheduler.finish_request(request.request_id, FinishReason.ERROR):
                failed_requests.append(request)
        for request in failed_requests:
            request.finish_reason = FinishReason.ERROR
            outputs.append(self._final_output(request, [], "", faults[request.request_id]))
            outputs[-1].error_type = result.error_types.get(request.request_id)
        if self.speculator is not None:
            if output.requests:
                prefill = any(_is_prefill(r) for r in output.requests)
                self.speculator.observe_step(None if prefill else result.timings.forward,
                                             output.num_tokens, len(output.requests))
            self.speculator.release({*self.scheduler.requests})
            self.speculator.propose(self.scheduler.running, self.max_model_len, self.kv_cache)
        num_faulted = len(failed_requests)
        timings = result.timings
        timings.schedule = schedule_time
        timings.emit = time.perf_counter() - t0
        stats = self._stats(output, timings, num_faulted)
        scheduled = {r.request_id for r in output.requests}
        failed = bool(scheduled) and scheduled <= faults.keys()
        fault = next(iter(faults.values()), None) if faults else None
        return StepOutcome(outputs, stats, failed, fault)

    # --------------------------------------------------------------- outputs
    def _output(self, request: Request, new_ids: list[int], text: str,
                logprobs=None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id, new_token_ids=new_ids, text=text,
            finished=False, finish_reason=None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, logprobs=logprobs,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens or 0,
            spec_proposed=request.num_spec_proposed, spec_accepted=request.num_spec_accepted)

    def _final_output(self, request: Request, new_ids: list[int], text: str,
                      error: str | None, logprobs=None) -> RequestOutput:
        self._detokenizers.pop(request.request_id, None)
        self._prompt_logprobs.pop(request.request_id, None)
        out = self._output(request, new_ids, text, logprobs)
        out.finished = True
        out.finish_reason = request.finish_reason.value if request.finish_reason else None
        out.stop_reason = request.stop_reason
        out.error = error
        return out

    def _stats(self, output: SchedulerOutput, timings: StepTimings,
               num_faulted: int) -> SchedulerStats:
        decode = sum(1 for r in output.requests if not _is_prefill(r))
        kv = self.kv_cache
        prefix = kv.take_stats()
        spec = self.scheduler.spec_stats.take()
        return SchedulerStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_scheduled=len(output.requests),
            num_prefill_tokens=output.num_tokens - decode, num_decode_tokens=decode,
            num_preempted=output.num_preempted,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_free=kv.num_free_blocks, kv_usage=kv.usage,
            timings=timings, num_faulted=num_faulted,
            request_ids=[r.request_id for r in output.requests],
            prefill_request_ids=[r.request_id for r in output.requests if _is_prefill(r)],
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            spec_method=self.speculator.config.method if self.speculator else "",
            spec_proposed=spec.proposed, spec_accepted=spec.accepted,
            spec_verified_rows=spec.verified_rows)

    # ------------------------------------------------------------- integrity
    def state_sizes(self) -> dict[str, int]:
        """Entries in every per-request table the engine owns (and the
        backend's, when it says); all zero on an idle engine."""
        with self._lock:
            kv = self.kv_cache
            sizes = {"scheduler": len(self.scheduler.requests),
                     "detokenizer": len(self._detokenizers),
                     "prompt_logprobs": len(self._prompt_logprobs),
                     "finished_pending": self.scheduler.num_finished_pending,
                     "kv_cache": len(kv.request_ids),
                     # not a table, but the per-request resource that matters most
                     "kv_blocks_held": kv.pool.num_used_blocks}
            if self.speculator is not None:
                sizes["speculator"] = len(self.speculator.request_ids)
            backend_ids = _backend_request_ids(self.backend)
            if backend_ids is not None:
                sizes["backend"] = len(backend_ids)
            return sizes

    def check_integrity(self) -> None:
        """Every per-request table agrees with the scheduler's live requests.
        Call between steps (the AsyncEngine runs it on its step thread)."""
        with self._lock:
            self.scheduler.check_integrity()
            live = set(self.scheduler.requests)
            generating = {rid for rid, r in self.scheduler.requests.items()
                          if not r.is_pooling}
            if set(self._detokenizers) != generating:
                raise AssertionError(
                    f"detokenizers {sorted(set(self._detokenizers) ^ generating)} out of "
                    f"sync with the live generation requests")
            stale = set(self._prompt_logprobs) - live
            if stale:
                raise AssertionError(f"prompt logprobs kept for ended requests {sorted(stale)}")
            stale = self.kv_cache.request_ids - live
            if stale:
                raise AssertionError(f"KV cache state kept for ended requests {sorted(stale)}")
            backend_ids = _backend_request_ids(self.backend)
            if backend_ids is not None:
                ended = backend_ids - live - set(self.scheduler.finished_pending_ids)
                if ended:
                    raise AssertionError(
                        f"backend holds state for ended requests {sorted(ended)}")


def _backend_request_ids(backend) -> set[str] | None:
    ids = getattr(backend, "request_state_ids", None)
    return set(ids()) if callable(ids) else None


def _is_prefill(scheduled) -> bool:
    """Prompt tokens (or a recompute after preemption), not a decode token
    (with or without proposals to verify)."""
    own = len(scheduled.token_ids) - len(scheduled.spec_token_ids)
    return scheduled.num_output_tokens == 0 or own > 1
