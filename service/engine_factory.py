"""Build an EngineCore from EngineArgs: load, place, size the KV pool."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from backends.config import LoadedModel
from backends.device import DTYPES, resolve_dtype
from backends.errors import InvalidRequestError, ModelLoadError
from backends.execution import ExecutionOptions
from backends.factory import BackendConfig, create_backend
from backends.interface import Backend
from backends.loader import (load_model, load_tokenizer, resolve_model, resolve_model_path,
                             resolve_tokenizer)
from backends.loader.generation_config import apply_generation_config, generation_config_file
from backends.loader.hub import hub_repo_name, is_hub_id
from backends.progress import heartbeat
from backends.quantization import QuantizationError, QuantizationSpec, gguf_block_types
from backends.tokenizer import Tokenizer
from scheduler.config import SchedulerConfig
from scheduler.engine import EngineCore
from service.config import EngineArgs

log = logging.getLogger("baton")


_QUANT_SUFFIX = re.compile(r"[.-](?:[QqIi][QqKk]?\d[\w]*|[Ff](?:16|32)|[Bb][Ff]16)$")


def model_name_for(model: str | None) -> str:
    """The id clients see: a Hub id as given (without a :TAG), the folder
    name, or the GGUF file name without its quantization tag
    (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct)."""
    if model is not None and is_hub_id(str(model)):
        return hub_repo_name(str(model))
    path = resolve_model_path(model)
    if path.is_dir():
        return path.resolve().name
    return _QUANT_SUFFIX.sub("", path.stem)


def read_chat_template(value: str) -> str:
    """--chat-template: a file holding a Jinja template, or the template.
    A template that does not parse is refused here, before any request."""
    from service.chat_template import template_variables

    if "{{" in value or "{%" in value:
        text = value
    elif (path := Path(value).expanduser()).is_file():
        text = path.read_text(encoding="utf-8")
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    try:
        template_variables(text)
    except InvalidRequestError as exc:
        raise ValueError(f"--chat-template: {exc}") from None
    return text


def _load(args: EngineArgs, path, quantization: QuantizationSpec, shard=None) -> LoadedModel:
    dtype = DTYPES[args.dtype]
    # --tokenizer: create_engine resolved it to a local path already.
    tokenizer = load_tokenizer(Path(args.tokenizer)) if args.tokenizer else None
    if quantization.mode != "gguf":
        return load_model(path, dtype=dtype, progress=args.progress, shard=shard,
                          conversion_cache=args.conversion_cache, tokenizer=tokenizer)
    if not (path.is_file() and path.suffix == ".gguf"):
        raise QuantizationError(
            f"--quantization gguf keeps a GGUF file's quantized blocks, but {str(path)!r} "
            f"is not a .gguf file; use int8 or int4 for other models")
    from backends.loader import with_tokenizer
    from backends.loader.gguf import load_gguf
    # Every block type comes through undecoded: the quantization step keeps
    # what a kernel runs and says what it did with the rest.
    return with_tokenizer(load_gguf(path, dtype=dtype, progress=args.progress,
                                     keep_quantized=gguf_block_types()), tokenizer)


def load_backend(args: EngineArgs, parallel=None, device: str | None = None,
                 ) -> tuple[LoadedModel, Backend]:
    """Load the model (``parallel``: this rank's shard of it) and build its
    backend; every tensor-parallel rank runs this with the same ``args``.
    The returned model's weights are already released."""
    quantization = QuantizationSpec(args.quantization, args.quantization_group_size)
    path = resolve_model(args.model, args.revision, args.download_dir, args.progress)
    loaded = _load(args, path, quantization, parallel.shard if parallel is not None else None)
    wanted_len = args.max_model_len or loaded.config.max_position_embeddings
    device = device or args.device
    # Placing the weights as the plan says (packed, tiled, quantized) and, within
    # it, building kernels or compiling the step, which say so themselves; the
    # "model loaded" line closes it.
    what = f"preparing the model for {device}" + (
        f" ({quantization.describe()})" if quantization.enabled else "")
    with heartbeat(what, enabled=args.progress, done_line=False):
        backend = create_backend(loaded, BackendConfig(
            device=device, dtype=args.dtype, block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
            max_positions=wanted_len, seed=args.seed, quantization=quantization,
            threads=args.threads, gpu_memory_utilization=args.gpu_memory_utilization,
            execution=ExecutionOptions(
                fast_paths=args.fast_paths, cpu_kind=args.cpu_kind,
                compile=args.compile is not False and not args.enforce_eager,
                tensor_parallel_size=args.parallel.tensor_parallel_size)),
            parallel=parallel)
    loaded.weights.clear()
    return loaded, backend


def _check_memory_flags(args: EngineArgs) -> None:
    if args.gpu_memory_utilization is None:
        return
    if not args.device.startswith("cuda"):
        raise ValueError("--gpu-memory-utilization sizes the KV cache on CUDA devices; on "
                         f"{args.device} give its size with --kv-cache-memory")
    if args.kv_cache_memory is not None:
        raise ValueError("give either --gpu-memory-utilization or --kv-cache-memory, not both")


def _speculator(args: EngineArgs, backend, tokenizer):
    """The speculative decoding of --speculative-config, or None."""
    if args.speculative_config is None:
        return None
    from scheduler.speculative import SpeculativeConfig, Speculator
    spec = SpeculativeConfig.parse(args.speculative_config)
    proposer = None
    if spec.method == "draft_model":
        proposer = _draft_proposer(spec, args, backend, tokenizer)
    speculator = Speculator(spec, backend.speculative_budget, proposer)
    log.info("speculative decoding: %s; a step holds at most %d tokens of decodes and "
             "proposals", spec.describe(), backend.speculative_budget)
    return speculator


def _draft_proposer(spec, args: EngineArgs, backend, tokenizer):
    """The draft model's backend, as the target's is built (dtype, device,
    fast paths) with its own quantization, and a KV pool of as many blocks
    as the target's (scheduler/draft.py reads it through the target's block
    tables). Its tokenizer must be the target's."""
    from scheduler.draft import DraftProposer
    draft_args = dataclasses.replace(args, model=spec.model, quantization=spec.quantization,
                                     quantization_group_size=None, kv_cache_memory=None,
                                     num_kv_blocks=backend.num_kv_blocks,
                                     speculative_config=None)
    loaded, draft = load_backend(draft_args)
    if loaded.config.vocab_size != backend.config.vocab_size or \
            loaded.tokenizer.tokenizer.get_vocab() != tokenizer.backend.get_vocab():
        raise ValueError(f"the draft model {spec.model} does not share the target's tokenizer "
                         "(its vocabulary differs): a draft must propose the target's tokens")
    log.info("draft model %s: %.1fM parameters, %s, %.0f MiB of weights; its KV pool mirrors "
             "the target's %d blocks", spec.model, draft.num_parameters / 1e6,
             draft.plan.describe().split(";")[0], draft.weight_bytes / 2**20,
             draft.num_kv_blocks)
    return DraftProposer(draft)


def create_engine_on_passing_thread(args: EngineArgs) -> EngineCore:
    """create_engine on a thread of its own that ends with the load, for an
    engine whose steps run on another thread (AsyncEngine's). libgomp, the
    OpenMP runtime under torch's CPU ops and Baton's kernels, keeps a pool of
    threads for every thread that ran a parallel region, as long as that
    thread lives; with a second pool beside the stepping thread's it counts
    more threads than cores, stops spinning between parallel regions, and
    each of a step's few hundred regions waits for a sleeping thread to wake
    (a one-row step of the embedded model in gguf mode, 2 cores: 25-28 ms
    against 15). The loading thread's pool goes with it. (`baton serve`
    loads on such a thread already: service/serve.py.)"""
    # Leaving the block joins the worker thread: its pool is gone on return.
    with ThreadPoolExecutor(1, thread_name_prefix="baton-load") as pool:
        return pool.submit(create_engine, args).result()


def create_engine(args: EngineArgs) -> EngineCore:
    args = dataclasses.replace(args, dtype=resolve_dtype(args.dtype, args.device))
    if args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but no CUDA device is available")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"threads must be at least 1, got {args.threads}")
    _check_memory_flags(args)
    quantization = QuantizationSpec(args.quantization, args.quantization_group_size)
    generation_config_file(args.generation_config)  # a bad path fails before the load
    chat_template = (read_chat_template(args.chat_template)   # and so does a bad template
                     if args.chat_template is not None else None)
    path = resolve_model(args.model, args.revision, args.download_dir, args.progress)
    if args.tokenizer is not None:  # fetched once; tensor-parallel ranks read the files
        args = dataclasses.replace(args, tokenizer=str(resolve_tokenizer(
            args.tokenizer, args.download_dir, args.progress)))
    t0 = time.perf_counter()
    group = None
    if args.parallel.enabled:
        if quantization.mode == "gguf":
            raise ValueError("--quantization gguf keeps a GGUF file's quantized blocks, which "
                             "cannot be split over tensor-parallel ranks; use int8 or int4")
        from service.tensor_parallel import start_ranks
        # The workers load the files this process resolved (a Hub id is
        # downloaded once).
        group = start_ranks(dataclasses.replace(args, model=str(path), revision=None))
    try:
        loaded, backend = load_backend(dataclasses.replace(args, model=str(path), revision=None),
                                       group, str(group.device) if group is not None else None)
    except BaseException:
        if group is not None:
            group.close()
        raise
    generation = apply_generation_config(args.generation_config, loaded.generation)
    config = loaded.config
    wanted_len = args.max_model_len or config.max_position_embeddings
    # A lone request must always fit the pool, or it could never finish.
    max_model_len = min(wanted_len, backend.kv_capacity_tokens)
    if max_model_len < wanted_len:
        log.warning("max_model_len lowered from %d to %d to fit the KV cache",
                    wanted_len, max_model_len)
    if chat_template is not None:
        loaded.tokenizer.chat_template = chat_template
    tokenizer = Tokenizer(loaded.tokenizer)
    eos = generation.eos_token_ids or (
        (loaded.tokenizer.eos_token_id,) if loaded.tokenizer.eos_token_id is not None else ())
    core = EngineCore(
        backend, tokenizer,
        SchedulerConfig(max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=max_model_len, policy=args.scheduling_policy,
                        enable_prefix_caching=args.enable_prefix_caching,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        prefill_only_step_tokens=args.prefill_only_step_tokens),
        vocab_size=config.vocab_size, eos_token_ids=tuple(eos),
        model_name=model_name_for(args.model),
        generation=generation, max_logprobs=args.max_logprobs, pooling=loaded.pooling,
        hidden_size=config.hidden_size, speculator=_speculator(args, backend, tokenizer))
    log.info("model loaded: %s, %.1fM parameters, dtype %s, quantization %s, weights %.0f MiB, "
             "device %s, KV capacity %d tokens (%d blocks of %d), max_model_len %d, "
             "prefix caching %s, scheduling %s, %.1fs",
             loaded.source or config.name, backend.num_parameters / 1e6,
             args.dtype, backend.quantization.describe(), backend.weight_bytes / 2**20,
             args.device + (f", tensor parallel {args.parallel.tensor_parallel_size} "
                            f"(weights and KV per rank)" if group is not None else ""),
             backend.kv_capacity_tokens, backend.num_kv_blocks,
             args.block_size, max_model_len, "on" if args.enable_prefix_caching else "off",
             args.scheduling_policy, time.perf_counter() - t0)
    return core
