"""The synchronous engine: schedule, execute, postprocess.

``EngineCore.step()`` is the whole engine in three lines; the AsyncEngine runs
the same three parts with ``execute`` off the event loop thread. Requests are
validated in ``add_request`` before any compute; text-level stop conditions
(stop strings) are applied here, token-level ones in the Scheduler.
"""

from __future__ import annotations

import time

from backends.config import GenerationDefaults
from backends.errors import ContextLengthExceededError, InvalidRequestError
from backends.interface import Backend, SamplingParams, SchedulerOutput, StepResult
from backends.tokenizer import Tokenizer
from cache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.outputs import RequestOutput, SchedulerStats
from scheduler.request import FinishReason, Request
from scheduler.scheduler import Scheduler


class EngineCore:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: SchedulerConfig,
                 *, vocab_size: int, eos_token_ids: tuple[int, ...],
                 model_name: str = "model",
                 generation: GenerationDefaults | None = None) -> None:
        self.backend = backend
        self.model_name = model_name
        self.generation = generation or GenerationDefaults(eos_token_ids=tuple(eos_token_ids))
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache = KVCacheManager(backend.num_kv_blocks, backend.block_size,
                                       config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompt_logprobs: dict[str, list] = {}
        self.last_stats: SchedulerStats | None = None
        self._schedule_time = 0.0

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---------------------------------------------------------------- intake
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0) -> Request:
        """Validate and queue. Raises InvalidRequestError (or its subclass
        ContextLengthExceededError) before anything is computed."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if priority != 0 and self.config.policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} was given, but this server schedules first come, "
                f"first served; start it with --scheduling-policy priority to honour "
                f"priorities", "priority")
        self._validate(prompt_token_ids, params)
        n = len(prompt_token_ids)
        max_tokens = params.max_tokens or (self.max_model_len - n)
        request = Request(request_id, list(prompt_token_ids), params,
                          max_tokens=min(max_tokens, self.max_model_len - n),
                          eos_token_ids=self.eos_token_ids, priority=priority)
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer.backend, stop=params.stop,
            skip_special_tokens=params.skip_special_tokens)
        self.scheduler.add_request(request)
        return request

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                "prompt")
        limit = self.max_model_len
        n = len(prompt)
        asked = n + (params.max_tokens or 1)
        if n >= limit or asked > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {asked} tokens ({n} in the prompt, "
                f"{params.max_tokens or 1} for the completion). Please reduce the length "
                f"of the prompt or of max_tokens.")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{name} names token id {bad}, outside the vocabulary "
                    f"(0..{self.vocab_size - 1})", name)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> RequestOutput | None:
        """End a request now and free its blocks; None if it already ended."""
        request = self.scheduler.finish_request(request_id, reason)
        if request is None:
            return None
        return self._final_output(request, [], "", error)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        output = self.schedule()
        if output.is_empty:
            return []
        return self.postprocess(output, self.backend.execute(output))

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        output = self.scheduler.schedule()
        self._schedule_time = time.perf_counter() - t0
        return output

    def postprocess(self, output: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        for request_id, entries in result.prompt_logprobs.items():
            self._prompt_logprobs.setdefault(request_id, []).extend(entries)
        for update in self.scheduler.update_from_output(output, result):
            request = update.request
            detok = self._detokenizers[request.request_id]
            delta = detok.push([update.token_id])
            if delta.stop_string is not None and not request.is_finished:
                self.scheduler.finish_request(request.request_id, FinishReason.STOP,
                                              delta.stop_string)
            logprobs = [update.logprobs] if update.logprobs is not None else None
            prompt_logprobs = self._prompt_logprobs.pop(request.request_id, None)
            if request.is_finished:
                text = delta.text if delta.stop_string is not None else delta.text + detok.flush()
                outputs.append(self._final_output(request, [update.token_id], text, None,
                                                  logprobs))
            else:
                outputs.append(self._output(request, [update.token_id], delta.text, logprobs))
            outputs[-1].prompt_logprobs = prompt_logprobs
        result.timings.schedule = self._schedule_time
        result.timings.emit = time.perf_counter() - t0
        self.last_stats = self._stats(output, result)
        return outputs

    def fail_step(self, output: SchedulerOutput, error: str) -> list[RequestOutput]:
        """The backend raised on this step: fail exactly its requests."""
        return [self._final_output(request, [], "", error)
                for request in self.scheduler.fail_step(output)]

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
            num_cached_tokens=request.num_cached_tokens or 0)

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

    def _stats(self, output: SchedulerOutput, result: StepResult) -> SchedulerStats:
        decode = sum(1 for r in output.requests if not _is_prefill(r))
        kv = self.kv_cache
        prefix = kv.take_stats()
        return SchedulerStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_scheduled=len(output.requests),
            num_prefill_tokens=output.num_tokens - decode, num_decode_tokens=decode,
            num_preempted=output.num_preempted,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_free=kv.num_free_blocks, kv_usage=kv.usage,
            timings=result.timings,
            request_ids=[r.request_id for r in output.requests],
            prefill_request_ids=[r.request_id for r in output.requests if _is_prefill(r)],
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = set(self.scheduler.requests)
        if set(self._detokenizers) != live:
            raise AssertionError("detokenizer table out of sync with live requests")


def _is_prefill(scheduled) -> bool:
    """Prompt tokens (or a recompute after preemption), not a decode token."""
    return scheduled.num_output_tokens == 0 or len(scheduled.token_ids) > 1
