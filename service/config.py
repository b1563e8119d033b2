"""One typed configuration for building an engine, from CLI flags and BATON_* env."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from backends.parallel.config import ParallelConfig
from scheduler.config import FaultPolicy

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10,
          "m": 10**6, "mb": 10**6, "mib": 2**20, "mi": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30,
          "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; '1000' -> 1000."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a memory size: {text!r} (try e.g. 2GiB or 512MiB)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_count(text: str | int) -> int:
    """A token count as vLLM reads one: '32k' -> 32000, '32K' -> 32768,
    '25.6k' -> 25600, '4096' -> 4096 (lower-case suffixes are powers of 1000,
    upper-case powers of 1024)."""
    if isinstance(text, int):
        return text
    match = _COUNT.match(text)
    if not match:
        raise ValueError(f"not a count: {text!r} (try e.g. 4096, 32k or 32K)")
    number, unit = match.groups()
    value = float(number) * _COUNT_UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number ({value:g})")
    return int(value)


def env_flag(name: str) -> bool:
    """A boolean BATON_* variable: 1, true, yes or on (any case) is True."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def env_choice(name: str) -> bool | None:
    """A BATON_* variable that may be left unset: None when unset or empty,
    else as env_flag reads it."""
    return env_flag(name) if os.environ.get(name, "").strip() else None


@dataclass(frozen=True, slots=True)
class EngineArgs:
    model: str | None = None          # None: the embedded default
    dtype: str = "auto"              # auto: bfloat16 where native, else float32
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int | None = None   # bytes; None: backend default
    num_kv_blocks: int | None = None     # overrides kv_cache_memory (tests)
    max_model_len: int | None = None     # None: the model's own, capped by the KV pool
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    seed: int | None = None
    progress: bool = False
    threads: int | None = None           # torch intra-op threads; None: torch's default
    quantization: str = "none"           # none, int8, int4, gguf (docs/quantization.md)
    quantization_group_size: int | None = None  # int4: 32, 64, 128; None: auto
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"      # fcfs | priority
    long_prefill_token_threshold: int | None = None  # None: a quarter of the step budget
    prefill_only_step_tokens: int = 2048  # a step without decodes: short prompts up to this
    fast_paths: bool = True              # False: portable torch ops only (backends/execution.py)
    # Token-row steps run the model's
    # compiled forward (backends/compiled_step.py): True or None (the
    # default: wherever the plan can), False (eager; backends/execution.py).
    # Default from BATON_COMPILE (1 / 0; unset: None), as the CLI's --compile.
    compile: bool | None = field(default_factory=lambda: env_choice("BATON_COMPILE"))
    # True: never compile, whatever ``compile`` says (vLLM's --enforce-eager;
    # BATON_ENFORCE_EAGER).
    enforce_eager: bool = field(default_factory=lambda: env_flag("BATON_ENFORCE_EAGER"))
    # --speculative-config's JSON (scheduler/speculative.py); None: none.
    speculative_config: str | None = None
    # Force a lower CPU kind: portable, avx2, avx512, avx512_bf16; default from
    # BATON_CPU_KIND, as the CLI's --cpu-kind.
    cpu_kind: str = field(default_factory=lambda: os.environ.get("BATON_CPU_KIND") or "auto")
    revision: str | None = None          # Hub ids only: branch, tag or commit
    download_dir: str | None = None      # Hub ids only: cache folder (None: HF's own)
    generation_config: str = "auto"      # auto | vllm | folder with generation_config.json
    # Tensor parallelism: ranks, nodes, rendezvous (docs/scaling.md)
    parallel: ParallelConfig = ParallelConfig()
    chat_template: str | None = None     # a Jinja file or string replacing the model's
    # Folder keeping GGUF conversions (backends/loader/conversion_cache.py); None: none.
    conversion_cache: str | None = None
    tokenizer: str | None = None         # a tokenizer from elsewhere (folder, .gguf, Hub id)
    gpu_memory_utilization: float | None = None  # CUDA: fraction of the device Baton may fill
    max_logprobs: int = 20               # top alternatives a request may ask for; -1: vocabulary


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # The first is the name responses and metrics carry; requests may use any.
    # Empty: the model's own name.
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 262_144
    request_timeout: float | None = 600.0  # seconds; None: no limit (OpenAI's SDK waits 600 s)
    default_max_tokens: int | None = None   # max_tokens when a request sends none (None: OpenAI's)
    drain_timeout: float = 30.0
    max_body_bytes: int = 8 * 1024 * 1024
    stall_timeout: float = 60.0             # /health fails when a busy loop makes no step this long
    unhealthy_after_failed_steps: int = 3   # /health fails after this many wholly failed steps
    step_timeout: float | None = None       # seconds before a backend step counts as hung
    body_read_timeout: float = 60.0         # seconds for a request body to arrive (else 408)
    max_connections: int = 1000             # open client connections; one more gets 503
    # Seconds a connection may stay open with no request in progress: before
    # its first request's headers are complete, and between requests.
    idle_timeout: float = 15.0
    metrics_public: bool = False            # serve /metrics without the API key
    # Message content may carry control tokens (<|im_end|> ...) as control
    # tokens, not as text: only for trusted clients (docs/security.md).
    trust_message_control_tokens: bool = False
    otlp_traces_endpoint: str | None = None  # besides OTEL_EXPORTER_OTLP_* in the environment
    trace_detail: str = "request"            # none | request | step
    log_prompts: bool = False
    log_requests: bool = True                # one log line per finished request
    allowed_origins: tuple[str, ...] = ()    # CORS; empty: no CORS headers ("*": any)
    tool_call_parser: str | None = None     # hermes | llama3_json | generic; None: detect
    trust_request_chat_template: bool = False  # let requests carry their own chat_template
    # Stored responses (POST /v1/responses with store): the bytes they may
    # hold in all (0: none are kept) and seconds each is kept.
    responses_store_bytes: int = 128 * 2**20
    responses_store_ttl: float = 3600.0

    def fault_policy(self) -> FaultPolicy:
        return FaultPolicy(unhealthy_after_failed_steps=self.unhealthy_after_failed_steps,
                           stall_timeout=self.stall_timeout, step_timeout=self.step_timeout)
