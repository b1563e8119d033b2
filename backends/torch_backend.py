"""The torch backend: CPU and CUDA, float32 / bfloat16 / float16, following an
ExecutionPlan.

It owns the model weights, the paged KV tensors (one K and one V tensor per
layer, ``[num_blocks * block_size, kv_heads, head_dim]``) and the per-request
sampling state. ``execute`` turns a SchedulerOutput into tensors, runs one
forward pass over the flattened batch and samples.

Under tensor parallelism (``parallel``: backends/parallel) it holds one
rank's shard of the weights and of the KV cache. Rank 0's ``execute``
broadcasts the step's rows before its forward pass and samples alone; the
other ranks run ``follow_step`` with what it sent, in lockstep.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch

from backends.attention import (AttentionMetadata, PrefillSegment, SharedPrefix,
                                find_shared_prefixes)
from backends.errors import GRAMMAR_ERROR
from backends.grammar import (BitmaskFiller, GrammarCompiler, GrammarMatcher, settle_kept,
                              settle_tokens)
from backends.config import LoadedModel, ModelConfig
from backends.cpu_threads import DEFAULT_THREADS, ThreadGovernor, own_child_work
from backends.device import DTYPES, cuda_kv_budget, zeros_lazily
from backends.interface import (SamplingParams, ScheduledRequest, SchedulerOutput,
                                StepResult, StepTimings, TokenLogprobs)
from backends.execution import ExecutionPlan
from backends.input_batch import InputBatch
from backends.linear import swap_linears
from backends.models.decoder import DecoderLM
from backends.ops import build_ops
from backends.parallel.group import ForwardRow, TensorParallelGroup
from backends.pooling import Pooler, pool_spans
from backends.quantization.spec import QuantizationSpec, projection_formats
from backends.rope import local_rope_table, rope_table
from backends.speculative import Rewind, SamplePosition, sample_positions, verify
from backends.sampler import (DeferredMasks, PenaltyInputs, SamplerOutput, SamplingBatch,
                             greedy_pick, mask_can_wait, plain_greedy, sample)

log = logging.getLogger("baton.backend")

DEFAULT_CPU_KV_BYTES = 2 * 1024**3


@dataclass(slots=True)
class _RequestState:
    params: SamplingParams
    generator: torch.Generator | None
    # Kept only for prompt logprobs (the targets of each position).
    prompt_token_ids: list[int] = field(default_factory=list)
    # Penalties only: how often each token was generated, and which tokens
    # the prompt holds; [vocab] on the device, built once and counted up with
    # each sampled token rather than rebuilt from id lists every step.
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    # Prompt positions whose next-token logprob was already returned; a
    # request recomputed after preemption must not return them twice.
    prompt_logprobs_done: int = 0
    # Where a constrained request stands in its grammar; it advances with
    # each sampled token and, like the rest, survives preemption.
    grammar: GrammarMatcher | None = None


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def _out_rows(logits_index: torch.Tensor, num_tokens: int,
              spans: list, pooling: bool = False) -> torch.Tensor | None:
    """The rows the model's last layer carries past its attention: the
    sampled ones, when they are fewer than the step's tokens (a prefill chunk
    samples its last row only) and neither prompt logprobs nor an embedding
    request's pooling (``pooling``) read the others; else None (every row).
    Rank 0 and the other tensor-parallel ranks decide alike from what they
    share (the rows and the spans)."""
    n = logits_index.shape[0]
    return logits_index if 0 < n < num_tokens and not spans and not pooling else None


# A token-row step sends every token to the decode kernel, which reads a
# token's whole context once per token: cheap for decodes, verification rows
# and short chunks, but a long chunk over a long context re-reads it per query
# token where SDPA (torch's flash attention) reads it once per block of queries.
# A step holding a chunk of at least SEGMENT_MIN_TOKENS tokens whose query-key
# pairs (its tokens times the positions up to its end) number at least
# SEGMENT_MIN_PAIRS takes the segment path instead: decodes to the kernel, each
# chunk to SDPA. Measured on a 2-core AMX Xeon, SmolLM2-135M bf16, one step
# (benchmarks/profile_step.py): a 512-token chunk over 3,000 cached tokens
# 370 ms against 910, 64 over 2,000 60 against 88, 4 chunks of 120 over 192
# beside 28 decodes 166 against 194; below the line the kernel wins (16 over
# 3,000: 44 against 53; 4 of 64 over 192: 114 against 131).
SEGMENT_MIN_TOKENS = 64
SEGMENT_MIN_PAIRS = 32768


def segment_attention_pays(rows: list[ScheduledRequest]) -> bool:
    """Whether a step's chunks are long enough to go to SDPA as segments
    rather than to the decode kernel token by token (see SEGMENT_MIN_TOKENS)."""
    return any(len(r.token_ids) >= SEGMENT_MIN_TOKENS
               and len(r.token_ids) * (r.start_pos + len(r.token_ids)) >= SEGMENT_MIN_PAIRS
               for r in rows)


def _pools(row: ScheduledRequest | ForwardRow) -> bool:
    """An embedding request's row: pooled, never sampled."""
    return getattr(row, "pooling", None) is not None or getattr(row, "pool", False)


class TorchBackend:
    """Runs a model as its ExecutionPlan says (backends/execution.py): the
    plan fixes the numerics (activation, weight and KV dtypes) and which
    implementation every op and linear layer gets; this class only follows
    it. Build one with ``backends.factory.create_backend``."""

    def __init__(self, loaded: LoadedModel, plan: ExecutionPlan, *, block_size: int = 16,
                 kv_cache_bytes: int | None = None, num_kv_blocks: int | None = None,
                 max_positions: int | None = None, seed: int | None = None,
                 quantization: QuantizationSpec | None = None,
                 parallel: TensorParallelGroup | None = None,
                 grammar: GrammarCompiler | None = None,
                 threads: int | None = None,
                 gpu_memory_utilization: float | None = None) -> None:
        self.plan = plan
        self.parallel = parallel
        self.device = torch.device(plan.device)
        self.dtype = DTYPES[plan.dtype]
        self.compute_dtype = act = DTYPES[plan.activation_dtype]
        self.kv_dtype = DTYPES[plan.kv_dtype]
        # ``config`` is the model's; ``model_config`` this rank's share of it
        # (the same without tensor parallelism).
        self.config = loaded.config
        shard = parallel.shard(self.config) if parallel is not None else None
        self.model_config = shard.local_config if shard is not None else self.config
        self.block_size = block_size
        self.eos_token_ids = tuple(loaded.generation.eos_token_ids)
        self.quantization = quantization or QuantizationSpec(plan.quantization)
        eos = self.eos_token_ids or tuple(
            t for t in (loaded.tokenizer.eos_token_id,) if t is not None)
        self.grammar = grammar or GrammarCompiler(loaded.tokenizer.tokenizer,
                                                  self.config.vocab_size, eos)
        self._bitmasks = BitmaskFiller(self.config.vocab_size)
        self._num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        # When a constrained row's mask is filled: None (the default) defers
        # it on a CPU (see ``_grammar_rows``); True / False force either
        # order (the tokens are the same; tests compare them).
        self.defer_grammar_masks: bool | None = None
        # Constrained rows sampled so far, by how their mask was handled:
        # "masked" (filled before picking), "unmasked" (deferred, and the
        # grammar accepted the unmasked pick: no mask filled), "repicked"
        # (deferred, rejected, filled and picked again).
        self.grammar_rows = {"masked": 0, "unmasked": 0, "repicked": 0}

        positions = max_positions or self.config.max_position_embeddings
        cos_table, sin_table = rope_table(self.config, positions, act, self.device)
        local_tables = local_rope_table(self.config, positions, act, self.device)
        self.ops = build_ops(plan)
        with torch.device("meta"):
            self.model = DecoderLM(self.model_config, self.ops, cos_table, sin_table,
                                   local_tables)
        if self.quantization.enabled:
            from backends.quantization import load_quantized, resolve_group_size
            # The group size is chosen here, where the file's formats are
            # known: a GGUF's 4-bit projections keep their groups of 32.
            self.quantization, why = resolve_group_size(
                self.quantization, self.model_config, projection_formats(loaded.source_formats))
            if why and (parallel is None or parallel.rank == 0):
                log.info(why)
            load_quantized(self.model, loaded.weights, self.quantization, self.device, act,
                           plan.kernels if plan.int4_linear else None,
                           DTYPES[plan.weight_dtype], int4_q8=plan.int4_linear == "native-q8",
                           output_q8=plan.lm_head == "q8_0-native")
        else:
            weights = loaded.weights
            if plan.weight_dtype != plan.activation_dtype:
                # Every tensor rounded to the weight dtype (bfloat16) first,
                # then held in the activation dtype (float32).
                weight_dtype = DTYPES[plan.weight_dtype]
                weights = {name: t.to(weight_dtype) for name, t in weights.items()}
            self.model.load_weights(weights, self.device, act)
        self.model.eval()
        n = swap_linears(self.model, plan)
        log.debug("%d linear layers as %s, output projection as %s", n, plan.linear,
                  plan.lm_head)
        if parallel is not None:
            from backends.parallel.layers import parallelize
            parallelize(self.model, parallel, shard.partition)

        self.num_kv_blocks = num_kv_blocks or self._blocks_for_budget(kv_cache_bytes,
                                                                      gpu_memory_utilization)
        if parallel is not None:  # every rank must hold every block rank 0 hands out
            self.num_kv_blocks = parallel.agree_min(self.num_kv_blocks)
        num_slots = self.num_kv_blocks * block_size
        shape = (num_slots, self.model_config.num_kv_heads, self.model_config.head_dim)
        # Zeroed, not empty: padded attention reads masked slots, and garbage
        # NaNs there would survive a zero attention weight (0 * nan = nan).
        # Lazily: a CPU pool's pages are zeroed by the OS on first touch.
        self.kv_caches = [
            (zeros_lazily(shape, self.kv_dtype, self.device),
             zeros_lazily(shape, self.kv_dtype, self.device))
            for _ in range(self.config.num_layers)]
        # Token ids, positions, slots and block tables of every step, in
        # buffers allocated once (backends/input_batch.py).
        self._batch = InputBatch(
            max_tokens=4096, max_blocks=-(-positions // block_size) + 1,
            block_size=block_size, device=self.device)
        # Every token attends as a decode does, through the native decode
        # kernel reading the pool in place (decodes, verification rows and
        # short prefill chunks alike: segment_attention_pays), where the plan
        # has that kernel for every layer; the step's forward is then compiled
        # where the plan says so.
        self._token_rows = (plan.decode_attention == "native" and parallel is None
                            and plan.sliding_attention == "none"
                            and plan.softcap_attention == "none")
        self._compiled = None
        if plan.step == "compiled" and self._token_rows:
            from backends.compiled_step import CompiledStep
            self._compiled = CompiledStep(self.model, self.kv_caches)

        # A fixed thread count, or (None, on CPU) one that follows what other
        # processes leave free. A tensor-parallel rank keeps the cores and
        # threads its launcher dealt it (service/tensor_parallel.py).
        self._governor = None
        if threads is not None:
            if threads < 1:
                raise ValueError(f"threads must be at least 1, got {threads}")
            torch.set_num_threads(threads)
        elif self.device.type == "cpu" and parallel is None:
            self._governor = ThreadGovernor(DEFAULT_THREADS)

        self._states: dict[str, _RequestState] = {}
        # Embedding requests' pooled partial sums (backends/pooling.py).
        self._pooler = Pooler()
        self._shared_generator = torch.Generator(device=self.device)
        if seed is None:
            self._shared_generator.seed()
        else:
            self._shared_generator.manual_seed(seed)
        if self._compiled is not None:
            # The compiler's workers are this engine's (and the thread
            # governors' samples start after them).
            with own_child_work():
                self.compile_seconds = self._compiled.warm_up(
                    block_size, self.device, progress=parallel is None or parallel.rank == 0)

    @property
    def speculative_budget(self) -> int:
        """Tokens a decode step may hold and still cost about what a decode
        of that many requests costs (speculative proposals fill the rest):
        the rows the plan's few-row linear takes (the bf16 gemv's 4; 32 on
        AMX tiles), else 8 (a few rows of a linear read the weights once, as
        one does)."""
        return self.plan.few_rows or 8

    @property
    def bf16_weights(self) -> bool:
        return self.plan.bf16_weights

    @property
    def num_parameters(self) -> int:
        """The trained model's parameter count, whatever the storage: linear
        layers (plain, prepacked, bf16-tiled or quantized, all with
        in/out_features) by their shape, everything else by its parameters;
        a tied output projection is the embedding and counted once. Under
        tensor parallelism, the whole model's (from its weight spec)."""
        if self.parallel is not None:
            from backends.models.weight_spec import checkpoint_shapes
            return sum(math.prod(shape) for shape in checkpoint_shapes(self.config).values())
        linears = [m for m in self.model.modules()
                   if hasattr(m, "in_features") and hasattr(m, "out_features")]
        if self.config.tie_word_embeddings:
            linears = [m for m in linears if m is not self.model.lm_head]
        total = 0
        for module in linears:
            bias = getattr(module, "bias", None)
            total += module.in_features * module.out_features
            total += bias.numel() if bias is not None else 0
        linear_params = {id(p) for m in linears for p in m.parameters(recurse=False)}
        return total + sum(p.numel() for p in self.model.parameters()
                           if id(p) not in linear_params)

    @property
    def fatal_error(self) -> str | None:
        """Why this backend can never step again (a tensor-parallel rank
        died or hangs), else None."""
        return self.parallel.fatal_error if self.parallel is not None else None

    @property
    def weight_bytes(self) -> int:
        from backends.quantization import resident_weight_bytes
        return resident_weight_bytes(self.model)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def _blocks_for_budget(self, kv_cache_bytes: int | None,
                           gpu_memory_utilization: float | None = None) -> int:
        per_block = kv_bytes_per_token(self.model_config, self.kv_dtype) * self.block_size
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = cuda_kv_budget(free, total, gpu_memory_utilization)
            else:
                kv_cache_bytes = DEFAULT_CPU_KV_BYTES
        blocks = kv_cache_bytes // per_block
        if blocks < 1:
            raise ValueError(
                f"KV cache budget of {kv_cache_bytes} bytes is below one block "
                f"({per_block} bytes)")
        return int(blocks)

    def shutdown(self) -> None:
        if self.parallel is not None:
            self.parallel.close()
        self.kv_caches = []
        self._states.clear()
        self._bitmasks.shutdown()
        if any(self.grammar_rows.values()):
            log.info("constrained rows sampled: %(masked)d masked first, %(unmasked)d "
                     "picked unmasked, %(repicked)d rejected and picked again masked",
                     self.grammar_rows)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _spare_core(self) -> bool:
        """Whether work beside the forward pass (the grammar's masks) runs
        without taking a core from it: on a GPU, or with fewer torch threads
        than cores."""
        return self.device.type != "cpu" or torch.get_num_threads() < self._num_cores

    def request_state_ids(self) -> set[str]:
        return set(self._states) | self._pooler.request_ids()

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> StepResult:
        timings = StepTimings()
        t0 = time.perf_counter()
        if self._governor is not None:
            self._governor.before_step()
        for request_id in scheduler_output.finished_request_ids:
            self._states.pop(request_id, None)
        self._batch.release(scheduler_output.finished_request_ids)
        self._pooler.release(scheduler_output.finished_request_ids)
        for scheduled in scheduler_output.requests:
            if scheduled.request_id not in self._states:
                self._states[scheduled.request_id] = self._new_state(scheduled)
        if scheduler_output.is_empty:
            return StepResult([], [], [], timings)

        # Single-token rows (decodes) first: they share one attention call.
        rows = sorted(scheduler_output.requests, key=lambda r: len(r.token_ids) != 1)
        spans = self._prompt_logprob_spans(rows)
        pools = pool_spans(rows)
        if self.parallel is not None:  # the other ranks prepare while this one does
            self.parallel.broadcast_step(rows, [(lo, lo + last - first)
                                                for _, first, last, lo in spans])
        # Prompt logprobs and pooling read every row's hidden state: those
        # steps take the eager path over whole chunks.
        shared = self._shared_prefix_groups(rows)
        token_rows = (self._token_rows and not spans and not pools and not shared
                      and not segment_attention_pays(rows))
        filled = self._batch.fill(rows, token_rows)
        if token_rows:
            sample_rows, logits_index = self._sample_rows(rows)
        else:
            input_ids, positions, meta, sample_rows, logits_index = self._prepare(
                rows, filled, shared)
        batch = self._sampling_batch(sample_rows)
        rewind_rows = len(sample_rows) > len({p.request_id for p in sample_rows})
        constrained, waiting = self._grammar_rows(sample_rows, batch)
        grammar_rows = constrained + waiting
        masks = self._bitmasks.start([m for _, m in constrained], self._spare_core()) \
            if constrained else None
        spec_grammar = self._speculative_grammar_rows(sample_rows) if rewind_rows else []
        spec_masks = self._speculative_masks(spec_grammar) if spec_grammar else None
        t1 = time.perf_counter()
        timings.prepare = t1 - t0

        plain = not constrained and not waiting and not spec_grammar and plain_greedy(batch)
        prompt_logprobs = {}
        pooled, pool_failed = {}, {}
        if token_rows:
            # The sampled rows' logits, in the activation dtype.
            meta = filled.token_rows
            if self._compiled is not None:
                logits = self._compiled(filled.input_ids, filled.positions, meta, logits_index)
            else:
                out_rows = _out_rows(logits_index, filled.input_ids.shape[0], spans)
                hidden = self.model(filled.input_ids, filled.positions, self.kv_caches,
                                    filled.token_rows, out_rows)
                if out_rows is None:
                    hidden = hidden.index_select(0, logits_index)
                logits = self.model.compute_logits(hidden, float32=False)
            if not plain:
                logits = logits.float()
        else:
            out_rows = _out_rows(logits_index, input_ids.shape[0], spans, bool(pools))
            hidden = self.model(input_ids, positions, self.kv_caches, meta, out_rows)
            # With out_rows the model returned the sampled rows alone, in order.
            picked_hidden = hidden if out_rows is not None else hidden[logits_index]
            logits = self.model.compute_logits(picked_hidden, float32=not plain)
            prompt_logprobs = self._prompt_logprobs(spans, hidden)
            pooled, pool_failed = self._pooler.pool(hidden, pools) if pools else ({}, {})
        t2 = time.perf_counter()
        timings.forward = t2 - t1

        if masks is not None or spec_masks is not None:
            index = [i for i, _ in constrained]
            parts = [masks.result()] if masks is not None else []
            if spec_masks is not None:
                index += spec_masks[0]
                parts.append(spec_masks[1])
            batch.allowed = (torch.tensor(index).to(self.device),
                             torch.cat(parts).to(self.device))
        # A row with a NaN or an infinity cannot be sampled; its request fails
        # alone (amax propagates NaN). -1 marks it in the one host transfer.
        rewind = None
        if rewind_rows:  # speculative rows
            rewind = Rewind(sample_rows, {rid: state.generator
                                          for rid, state in self._states.items()},
                            self.config.vocab_size)
        if plain:
            ids, finite = greedy_pick(logits)
            out = SamplerOutput(ids, None, None, None)
        else:
            finite = torch.isfinite(logits.amax(dim=-1))
            if waiting:
                repicked = self._defer_masks(batch, waiting, finite)
            out = sample(logits, batch)
        token_ids = out.token_ids.where(finite, -1).tolist()
        if waiting:
            constrained += repicked
        grammar_failed = settle_tokens(constrained, grammar_rows, token_ids,
                                       [r.request_id for r in sample_rows]) \
            if grammar_rows else {}
        logprobs = self._logprobs_lists(out, token_ids, sample_rows)
        failed: dict[str, str] = dict(pool_failed)
        error_types: dict[str, str] = {}
        result = StepResult([], [], [], timings, prompt_logprobs, failed, error_types, pooled)
        for i, row in enumerate(sample_rows):
            if i in grammar_failed:
                failed[row.request_id] = grammar_failed[i]
                error_types[row.request_id] = GRAMMAR_ERROR
        verified, nonfinite = verify(sample_rows, token_ids, logprobs)
        for request_id in nonfinite:
            failed.setdefault(request_id, "the model produced non-finite logits (NaN or "
                                          "infinity) for this request")
        if spec_grammar:
            kept = {v.request_id: (*v.accepted, v.token_id) for v in verified}
            for first, matcher, _ in spec_grammar:
                request_id = sample_rows[first].request_id
                if request_id not in kept or request_id in failed:
                    continue
                why = settle_kept(matcher, kept[request_id], request_id)
                if why is not None:
                    failed[request_id] = why
                    error_types[request_id] = GRAMMAR_ERROR
        for v in verified:
            if v.request_id in failed:
                continue
            result.request_ids.append(v.request_id)
            result.token_ids.append(v.token_id)
            result.logprobs.append(v.logprobs)
            if v.accepted or rewind is not None and v.request_id in rewind.saved:
                result.accepted[v.request_id] = v.accepted
                if v.logprobs is not None:
                    result.accepted_logprobs[v.request_id] = v.accepted_logprobs
                if rewind is not None:
                    rewind.to(v.request_id, len(v.accepted) + 1, drew=not batch.all_greedy)
            counts = self._states[v.request_id].output_counts
            if counts is not None:
                for token_id in (*v.accepted, v.token_id):
                    counts[token_id] += 1
        timings.sample = time.perf_counter() - t2
        return result

    def _speculative_grammar_rows(self, rows: list[SamplePosition]
                                  ) -> list[tuple[int, GrammarMatcher, list[int]]]:
        """``(first position, matcher, proposals)`` of each constrained
        speculative row: its positions are masked up front, each at the
        grammar's state after the proposals before it (``fill_bitmasks_along``);
        after verification its matcher takes the tokens the row kept."""
        return [(i, state.grammar, p.scheduled.spec_token_ids) for i, p in enumerate(rows)
                if p.offset == 0 and p.scheduled.spec_token_ids
                and (state := self._states[p.request_id]).grammar is not None]

    def _speculative_masks(self, rows: list[tuple[int, GrammarMatcher, list[int]]]
                           ) -> tuple[list[int], torch.Tensor]:
        index, width = [], self._bitmasks.width
        masks = torch.empty((sum(len(p) + 1 for _, _, p in rows), width), dtype=torch.int32)
        for first, matcher, proposals in rows:
            n = len(proposals) + 1
            matcher.fill_bitmasks_along(proposals, masks[len(index):len(index) + n])
            index += range(first, first + n)
        self.grammar_rows["masked"] += len(index)
        return index, masks

    def _grammar_rows(self, rows: list[ScheduledRequest], batch: SamplingBatch
                      ) -> tuple[list[tuple[int, GrammarMatcher]],
                                 list[tuple[int, GrammarMatcher]]]:
        """The constrained rows of this step's batch as ``(row, matcher)``:
        those whose mask is filled before sampling, and those that pick
        unmasked first (backends/sampler.py, ``DeferredMasks``).

        A row defers where the sampler can do so exactly (``mask_can_wait``)
        and filling its mask up front would cost the step: on a CPU. There a
        mask of a JSON schema costs 10-500 us a row, while checking the
        unmasked pick costs ~3 us and most picks inside strings and numbers
        are allowed, so deferring does far less grammar work; a core that
        looks spare (the thread governor runs fewer torch threads than
        cores) is one another process was found to use, so a helper thread
        filling masks there still competes for it. On a GPU the masks are
        filled on a helper thread while the forward pass runs, at no cost to
        the step, and every row is masked first."""
        constrained = [(i, state.grammar) for i, r in enumerate(rows)
                       if (state := self._states[r.request_id]).grammar is not None
                       and not r.scheduled.spec_token_ids]
        defer = self.defer_grammar_masks
        if defer is None:
            defer = self.device.type == "cpu"
        if not constrained or not defer:
            self.grammar_rows["masked"] += len(constrained)
            return constrained, []
        first, waiting = [], []
        for i, matcher in constrained:
            wait = mask_can_wait(batch, rows[i].sampling_params.greedy)
            (waiting if wait else first).append((i, matcher))
        self.grammar_rows["masked"] += len(first)
        return first, waiting

    def _defer_masks(self, batch: SamplingBatch, waiting: list[tuple[int, GrammarMatcher]],
                     finite: torch.Tensor) -> list[tuple[int, GrammarMatcher]]:
        """Set ``batch.deferred`` for the ``waiting`` rows. The returned list
        fills, during ``sample``, with the rows the grammar rejected: they are
        picked again masked and still to be accepted by their matcher."""
        repicked: list[tuple[int, GrammarMatcher]] = []
        ok = finite.tolist()

        def resolve(tokens: list[int | None]) -> tuple[list[int], torch.Tensor | None]:
            rejected = []
            for k, ((i, matcher), token) in enumerate(zip(waiting, tokens)):
                if not ok[i]:
                    continue  # fails its request; its grammar stays put
                if token is not None and matcher.try_accept_unmasked(token):
                    self.grammar_rows["unmasked"] += 1
                else:
                    rejected.append(k)
                    repicked.append((i, matcher))
            self.grammar_rows["repicked"] += len(rejected)
            if not rejected:
                return [], None
            return rejected, self._bitmasks.start([m for _, m in repicked], False).result()

        batch.deferred = DeferredMasks([i for i, _ in waiting], resolve)
        return repicked

    def _prompt_logprob_spans(self, rows: list[ScheduledRequest]
                              ) -> list[tuple[ScheduledRequest, int, int, int]]:
        """``(row, first, last, offset)`` for each row whose prompt positions
        ``first .. last - 1`` get next-token logprobs this step; ``offset``
        is the batch row of position ``first``. Host data only."""
        spans = []
        start = 0
        for row in rows:
            n = len(row.token_ids)
            state = self._states[row.request_id]
            first = max(row.start_pos, state.prompt_logprobs_done)
            last = min(row.start_pos + n, len(state.prompt_token_ids) - 1)
            if state.params.prompt_logprobs is not None and first < last:
                spans.append((row, first, last, start + first - row.start_pos))
            start += n
        return spans

    def _prompt_logprobs(self, spans: list[tuple[ScheduledRequest, int, int, int]],
                         hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """Next-token logprobs at the prompt positions this step computed."""
        result: dict[str, list[TokenLogprobs]] = {}
        for row, first, last, offset in spans:
            state = self._states[row.request_id]
            top_n = state.params.prompt_logprobs
            hidden_rows = hidden[offset:offset + last - first]
            lp = torch.log_softmax(self.model.compute_logits(hidden_rows), dim=-1)
            targets = state.prompt_token_ids[first + 1:last + 1]
            chosen = lp.gather(1, torch.tensor(targets, device=self.device)[:, None])
            top_v, top_i = (lp.topk(top_n, dim=-1) if top_n else (None, None))
            chosen_l = chosen.squeeze(1).tolist()
            top_vl = top_v.tolist() if top_v is not None else None
            top_il = top_i.tolist() if top_i is not None else None
            result[row.request_id] = [
                TokenLogprobs(t, c, list(zip(top_il[k], top_vl[k])) if top_il else [])
                for k, (t, c) in enumerate(zip(targets, chosen_l))]
            state.prompt_logprobs_done = last
        return result

    @torch.inference_mode()
    def follow_step(self, rows: list[ForwardRow], spans: list[tuple[int, int]]) -> None:
        """A tensor-parallel rank other than 0: the collective part of rank
        0's ``execute`` (the forward pass, the logits of the sampled rows,
        then of each prompt-logprob span), on what rank 0 broadcast."""
        input_ids, positions, meta, _, logits_index = self._prepare(rows, self._batch.fill(rows))
        out_rows = _out_rows(logits_index, input_ids.shape[0], spans,
                             any(row.pool for row in rows))
        hidden = self.model(input_ids, positions, self.kv_caches, meta, out_rows)
        self.model.compute_logits(hidden if out_rows is not None else hidden[logits_index])
        for lo, hi in spans:
            self.model.compute_logits(hidden[lo:hi])

    def _new_state(self, scheduled: ScheduledRequest) -> _RequestState:
        params = scheduled.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        prompt = scheduled.prompt_token_ids or []
        grammar = None
        if params.structured is not None:
            grammar = self.grammar.compile(params.structured).new_matcher()
        state = _RequestState(params, generator,
                              list(prompt) if params.prompt_logprobs is not None else [],
                              grammar=grammar)
        if params.uses_penalties:
            vocab = self.config.vocab_size
            state.output_counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
            state.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            if prompt:
                state.prompt_mask[torch.tensor(prompt, dtype=torch.long, device=self.device)] = True
        return state

    def _sample_rows(self, rows) -> tuple[list[SamplePosition], torch.Tensor]:
        """The positions this step samples (a row's last token; a speculative
        row's last k + 1) and the batch row of each."""
        positions, index = sample_positions(rows, _pools)
        return positions, torch.tensor(index, dtype=torch.long).to(self.device)

    def _shared_prefix_groups(self, rows) -> list[tuple[list[int], int]]:
        """Groups of this step's decodes (the single-token rows, first in
        ``rows``) that share a cached prefix the eager path's cascade
        attention computes once (backends/attention.py); [] where the plan
        has no cascade or none share one."""
        if self.plan.shared_prefix_decode != "cascade":
            return []
        decodes = [r for r in rows if len(r.token_ids) == 1]
        if not decodes:
            return []
        return find_shared_prefixes([r.block_table for r in decodes],
                                    [r.start_pos for r in decodes], self.block_size)

    def _prepare(self, rows: list[ScheduledRequest], filled,
                 shared: list[tuple[list[int], int]] | None = None):
        """The eager step's attention metadata over ``filled`` (the batch's
        flat inputs for ``rows``); ``shared``: the decodes' shared-prefix
        groups where already found."""
        decode_rows: list[ScheduledRequest] = []
        prefill_rows: list[tuple[int, ScheduledRequest]] = []
        start = 0
        for row in rows:
            n = len(row.token_ids)
            if n == 1:
                decode_rows.append(row)
            else:
                prefill_rows.append((start, row))
            start += n
        sample_rows, logits_index = self._sample_rows(rows)
        slot_mapping = filled.slot_mapping
        bs = self.block_size
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_size=bs,
            num_decode=len(decode_rows), decode_blocks=None, decode_mask=None,
            prefills=[self._prefill_segment(start, row) for start, row in prefill_rows])
        if decode_rows:
            self._decode_gather(decode_rows, meta, shared)
        window = self.config.sliding_window
        if self.config.has_sliding_layers:
            meta.sliding = AttentionMetadata(
                slot_mapping=slot_mapping, block_size=bs, num_decode=len(decode_rows),
                decode_blocks=None, decode_mask=None,
                prefills=[self._prefill_segment(start, row, window)
                          for start, row in prefill_rows])
            if decode_rows:
                self._decode_window(decode_rows, meta.sliding, window)
        return filled.input_ids, filled.positions, meta, sample_rows, logits_index

    def _prefill_segment(self, start: int, row: ScheduledRequest,
                         window: int | None = None) -> PrefillSegment:
        """The chunk's blocks and causal mask; with a sliding ``window``,
        only the blocks that hold a position some query of the chunk sees,
        and a mask that also hides positions before each query's window."""
        bs = self.block_size
        n = len(row.token_ids)
        ctx = row.start_pos + n
        num_blocks = -(-ctx // bs)
        first = 0 if window is None else max(0, row.start_pos - window + 1) // bs
        q_pos = torch.arange(row.start_pos, ctx).unsqueeze(1)
        kv_pos = torch.arange(first * bs, num_blocks * bs).unsqueeze(0)
        mask = kv_pos <= q_pos
        if window is not None:
            mask &= kv_pos > q_pos - window
        blocks = torch.tensor(row.block_table[first:num_blocks], dtype=torch.long)
        mask = mask.to(self.device)
        bias = torch.zeros(mask.shape, dtype=self.compute_dtype, device=self.device).masked_fill_(
            ~mask, float("-inf"))
        return PrefillSegment(start, start + n, blocks.to(self.device), mask, row.start_pos,
                              bias)

    def _decode_gather(self, rows: list[ScheduledRequest], meta: AttentionMetadata,
                       shared: list[tuple[list[int], int]] | None = None) -> None:
        bs = self.block_size
        lengths = [r.start_pos + 1 for r in rows]
        max_len = max(lengths)
        max_blocks = -(-max_len // bs)
        # Padding entries point at block 0; the mask (or the length) hides them.
        tables = [r.block_table[:max_blocks] + [0] * (max_blocks - min(len(r.block_table),
                                                                        max_blocks))
                  for r in rows]
        meta.decode_blocks = torch.tensor(tables, dtype=torch.long).to(self.device)
        lens = torch.tensor(lengths, dtype=torch.long)
        meta.decode_lens = lens.to(self.device)
        meta.decode_max_len = max_len
        if self.plan.shared_prefix_decode == "cascade":
            self._shared_prefixes(rows, meta, shared)
        if not self.plan.torch_decode_masks:
            return
        pos = torch.arange(max_blocks * bs)
        meta.decode_mask = (pos.unsqueeze(0) < lens.unsqueeze(1)).view(
            len(rows), 1, 1, max_blocks * bs).to(self.device)

    def _shared_prefixes(self, rows: list[ScheduledRequest], meta: AttentionMetadata,
                         groups: list[tuple[list[int], int]] | None = None) -> None:
        """Groups of decodes sharing a cached prefix (``groups``, else found
        here), and every decode's table and length past its group's prefix
        (backends/attention.py, cascade attention)."""
        bs = self.block_size
        if groups is None:
            groups = find_shared_prefixes([r.block_table for r in rows],
                                          [r.start_pos for r in rows], bs)
        if not groups:
            return
        cut = [0] * len(rows)
        dev = self.device
        for members, n in groups:
            for i in members:
                cut[i] = n
            meta.shared_prefixes.append(SharedPrefix(
                torch.tensor(members, dtype=torch.long).to(dev),
                torch.tensor(rows[members[0]].block_table[:n], dtype=torch.long).to(dev)))
        lengths = [r.start_pos + 1 - c * bs for r, c in zip(rows, cut)]
        width = -(-max(lengths) // bs)
        tables = []
        for r, c, n in zip(rows, cut, lengths):
            table = r.block_table[c:c - (-n // bs)]
            tables.append(table + [0] * (width - len(table)))
        meta.rest_blocks = torch.tensor(tables, dtype=torch.long).to(dev)
        meta.rest_lens = torch.tensor(lengths, dtype=torch.long).to(dev)
        meta.rest_max_len = max(lengths)

    def _decode_window(self, rows: list[ScheduledRequest], meta: AttentionMetadata,
                       window: int) -> None:
        """Decode block tables and masks as sliding-window layers see them:
        each row's table starts at the block of its window's first position
        (so the gather reads at most window + block_size - 1 slots per row)
        and its mask hides what lies before the window."""
        bs = self.block_size
        lengths = [r.start_pos + 1 for r in rows]
        firsts = [max(0, n - window) // bs for n in lengths]
        counts = [-(-n // bs) - f for n, f in zip(lengths, firsts)]
        width = max(counts)
        # Padding entries point at block 0; the mask hides them.
        tables = [r.block_table[f:f + c] + [0] * (width - c)
                  for r, f, c in zip(rows, firsts, counts)]
        meta.decode_blocks = torch.tensor(tables, dtype=torch.long).to(self.device)
        kv_pos = (torch.tensor(firsts).unsqueeze(1) * bs
                  + torch.arange(width * bs).unsqueeze(0))
        lens = torch.tensor(lengths).unsqueeze(1)
        mask = (kv_pos < lens) & (kv_pos >= lens - window)
        meta.decode_mask = mask.view(len(rows), 1, 1, width * bs).to(self.device)

    # -------------------------------------------------------------- sampling
    def _sampling_batch(self, rows: list[ScheduledRequest]) -> SamplingBatch:
        dev = self.device
        vocab = self.config.vocab_size
        params = [r.sampling_params for r in rows]
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                                   dtype=torch.float32).to(dev)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).to(dev)
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(dev)
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).to(dev)

        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for i, (row, p) in enumerate(zip(rows, params)):
            for token_id, value in p.logit_bias:
                bias_rows.append(i)
                bias_tokens.append(token_id)
                bias_values.append(value)
            if row.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stops.update(self.eos_token_ids)
                banned_rows.extend([i] * len(stops))
                banned_tokens.extend(stops)
        bias = None
        if bias_rows:
            bias = (torch.tensor(bias_rows).to(dev), torch.tensor(bias_tokens).to(dev),
                    torch.tensor(bias_values, dtype=torch.float32).to(dev))
        banned = None
        if banned_rows:
            banned = (torch.tensor(banned_rows).to(dev), torch.tensor(banned_tokens).to(dev))

        wants = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            temperature=temperature,
            greedy=None if all_greedy or not any(greedy) else torch.tensor(greedy).to(dev),
            all_greedy=all_greedy, top_k=top_k, top_p=top_p, min_p=min_p,
            penalties=self._penalty_inputs(rows, params),
            bias=bias, banned=banned, allowed=None,
            generators=[self._states[r.request_id].generator for r in rows],
            shared_generator=self._shared_generator,
            num_logprobs=max(wants) if wants else None)

    def _penalty_inputs(self, rows: list[ScheduledRequest],
                        params: list[SamplingParams]) -> PenaltyInputs | None:
        index = [i for i, p in enumerate(params) if p.uses_penalties]
        if not index:
            return None
        states = [self._states[rows[i].request_id] for i in index]
        dev = self.device
        sel = [params[i] for i in index]
        counts = torch.stack([s.output_counts for s in states])
        for j, i in enumerate(index):
            # A speculative row's later positions follow its proposals.
            before = getattr(rows[i], "proposals_before", None)
            if before:
                counts[j].index_add_(0, torch.tensor(before, device=dev),
                                     torch.ones(len(before), device=dev))
        return PenaltyInputs(
            rows=torch.tensor(index).to(dev),
            output_counts=counts,
            prompt_mask=torch.stack([s.prompt_mask for s in states]),
            repetition=torch.tensor([p.repetition_penalty for p in sel]).to(dev),
            frequency=torch.tensor([p.frequency_penalty for p in sel]).to(dev),
            presence=torch.tensor([p.presence_penalty for p in sel]).to(dev))

    @staticmethod
    def _logprobs_lists(out, token_ids: list[int],
                        rows: list[ScheduledRequest]) -> list[TokenLogprobs | None]:
        if out.token_logprobs is None:
            return [None] * len(rows)
        chosen = out.token_logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_values = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result: list[TokenLogprobs | None] = []
        for i, row in enumerate(rows):
            n = row.sampling_params.logprobs
            if n is None:
                result.append(None)
                continue
            top = list(zip(top_ids[i][:n], top_values[i][:n])) if n and top_ids else []
            result.append(TokenLogprobs(token_ids[i], chosen[i], top))
        return result
