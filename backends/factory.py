"""``create_backend``: the one way to build an execution backend.

The caller (service/engine_factory.py) says what it wants in a
``BackendConfig``; this module probes what the machine offers, makes the
ExecutionPlan (backends/execution.py) and builds the backend that follows it.
The service never imports a concrete backend.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from backends.config import LoadedModel, ModelConfig
from backends.execution import (Availability, CpuFeatures, ExecutionOptions, ExecutionPlan,
                                make_plan)
from backends.interface import Backend
from backends.quantization.spec import QuantizationSpec, output_format, projection_formats

log = logging.getLogger("baton.backend")


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """``dtype`` is resolved (float32, bfloat16 or float16; see
    backends.device.resolve_dtype). ``num_kv_blocks`` overrides
    ``kv_cache_bytes`` (tests)."""

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_positions: int | None = None
    seed: int | None = None
    quantization: QuantizationSpec = field(default_factory=QuantizationSpec)
    execution: ExecutionOptions = field(default_factory=ExecutionOptions)
    # CPU threads for the model's math; None: as many as other processes leave
    # free, up to torch's default (backends/cpu_threads.py).
    threads: int | None = None
    # CUDA: the fraction of the device's memory weights and KV cache may fill
    # (vLLM's --gpu-memory-utilization); None: 0.9 of what the weights leave.
    gpu_memory_utilization: float | None = None


def probe_availability(device: str, cpu: CpuFeatures,
                       options: ExecutionOptions) -> Availability:
    """What this process can run on ``device`` for a CPU of ``cpu``'s kind:
    builds (or finds cached) that kind's native kernels, and asks oneDNN
    which dtypes it runs prepacked linears in."""
    if not device.startswith("cpu") or not options.fast_paths:
        return Availability()
    import torch

    from backends import kernels
    from backends.linear import packing_supported
    dev = torch.device("cpu")
    onednn = frozenset(name for name, dtype in (("float32", torch.float32),
                                                ("bfloat16", torch.bfloat16))
                       if packing_supported(dev, dtype))
    ok, reason = kernels.available(cpu.kind)
    amx = ok and cpu.amx_bf16 and kernels.amx_ready(cpu.kind)[0]
    return Availability(native_kernels=frozenset({cpu.kind}) if ok else frozenset(),
                        onednn_dtypes=onednn, reason=reason,
                        amx_tiles=amx, cpp_compiler=cpp_compiler_found())


def cpp_compiler_found() -> bool:
    """Whether the C++ compiler Inductor would run is on PATH ($CXX, else
    c++, g++ or clang++)."""
    import shutil
    cxx = os.environ.get("CXX")
    return any(shutil.which(c) for c in ([cxx] if cxx else ["c++", "g++", "clang++"]))


def plan_for(config: BackendConfig, cpu: CpuFeatures | None = None,
             model: ModelConfig | None = None,
             weight_formats: frozenset[str] = frozenset(),
             head_format: str = "") -> ExecutionPlan:
    """The plan ``create_backend`` follows on this machine (``cpu``: the
    detected CPU unless given) for the architecture ``model`` (None: a plain
    Llama / Qwen decoder) whose projections a GGUF file stores as
    ``weight_formats`` and its output layer as ``head_format``."""
    cpu = cpu or CpuFeatures.detect()
    options = config.execution
    target = cpu
    if options.cpu_kind != "auto" and config.device.startswith("cpu"):
        target = cpu.limited_to(options.cpu_kind)  # refuses a kind this CPU lacks
    available = probe_availability(config.device, target, options)
    return make_plan(config.device, config.dtype, config.quantization.mode, cpu, available,
                     options, model, weight_formats, head_format)


def create_backend(loaded: LoadedModel, config: BackendConfig, parallel=None) -> Backend:
    """Plan, then build the backend that follows the plan (the torch backend
    for CPU and CUDA today; a registry once there are others). ``parallel``:
    this process's TensorParallelGroup (backends/parallel) when the model is
    sharded; ``loaded`` then holds this rank's shard."""
    model = loaded.config
    options = model.options()
    log.info("architecture %s%s", model.architecture,
             f": {', '.join(options)}" if options else " (no options)")
    plan = plan_for(config, model=model,
                    weight_formats=projection_formats(loaded.source_formats),
                    head_format=output_format(loaded.source_formats,
                                              model.tie_word_embeddings))
    log.info("execution plan: %s", plan.describe())
    from backends.torch_backend import TorchBackend
    return TorchBackend(loaded, plan, block_size=config.block_size,
                        kv_cache_bytes=config.kv_cache_bytes,
                        num_kv_blocks=config.num_kv_blocks,
                        max_positions=config.max_positions, seed=config.seed,
                        quantization=config.quantization, threads=config.threads,
                        parallel=parallel,
                        gpu_memory_utilization=config.gpu_memory_utilization)
