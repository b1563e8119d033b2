"""Device facts that decide defaults: which dtype is fast where."""

from __future__ import annotations

import torch

from backends.execution import CpuFeatures

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str, cpu_kind: str = "auto") -> str:
    """``auto``: bfloat16 where the hardware computes it natively (CUDA with
    bf16 support, CPUs of kind avx512_bf16 / with AMX; ``cpu_kind`` limits
    the CPU as ExecutionOptions does), else float32."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    cpu = CpuFeatures.detect()
    if cpu_kind != "auto":
        cpu = cpu.limited_to(cpu_kind)
    return "bfloat16" if cpu.native_bf16 else "float32"
