"""Device facts that decide defaults: which dtype is fast where."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """bfloat16 matmuls are only fast on CPUs with native bf16 instructions;
    elsewhere (AVX2-only CPUs) torch emulates them, several times slower than
    float32."""
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & flags) or "avx_ne_convert" in flags


def resolve_dtype(name: str, device: str) -> str:
    """``auto``: bfloat16 where the hardware computes it natively (CUDA with
    bf16 support, CPUs with AVX-512 BF16 / AMX), else float32."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"
