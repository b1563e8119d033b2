"""Device facts that decide defaults (which dtype is fast where), and
zeroed buffers that cost nothing until used."""

from __future__ import annotations

import math
import mmap

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CUDA_KV_FRACTION = 0.9  # of the memory left after the weights


def cuda_kv_budget(free: int, total: int, utilization: float | None) -> int:
    """Bytes for the KV cache on a CUDA device whose weights are already on
    it (``free`` and ``total`` as ``torch.cuda.mem_get_info`` reports them).

    Without ``utilization``: 0.9 of the free memory, the rest left for
    activations. With it (vLLM's ``--gpu-memory-utilization``): the cache
    fills the device up to that fraction of its total, counting everything
    on it now (the weights, and any other process's memory), so activations
    live in the remaining ``1 - utilization``. Raises ValueError when the
    device is already fuller than that."""
    if utilization is None:
        return int(free * CUDA_KV_FRACTION)
    used = total - free
    budget = int(total * utilization) - used
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g}: {used / 2**30:.2f} GiB of the device's "
            f"{total / 2**30:.2f} GiB are in use already (weights included), more than "
            f"{utilization:g} of it; raise the fraction or free device memory")
    return budget


def resolve_dtype(name: str, device: str) -> str:
    """``auto``: the fastest correct mode of the device. On CUDA, bfloat16
    where supported, else float16. On every CPU, bfloat16 weights: decoding
    is bound by streaming them, and bf16 halves the bytes. Where the CPU has
    native bf16 arithmetic (AVX-512 BF16 / AMX) the activations are bf16
    too; elsewhere the plan computes in float32 on the bf16 weights
    (backends/execution.py), as llama.cpp does there, and so do 4-bit
    models on a CPU without AMX. Quantized models too: their projections
    keep their codes, the rest (the embedding and output layer above all)
    is held in bf16."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16"


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU it lies in anonymous memory the kernel
    hands out zero-filled page by page on first touch, so a large KV pool
    costs no start-up time (torch.zeros writes every byte: about a second per
    GiB on a 2-core VM) and no resident memory until blocks are used. The
    mapping is private (Python's default, a shared one, faults in through
    shmem: ~150 ms per 256 MiB touched against ~109 ms) and in 4 KiB pages,
    whatever the kernel's transparent huge page mode: on a VM with free page
    reporting (virtio-balloon) a first touch of 2 MiB pages ran at 0.23-0.26
    GB/s against 5 GB/s for 4 KiB pages (the host backs each reported block
    again), so a served 512-token prefill step took twice as long while it
    wrote new blocks. Huge pages read scattered blocks 4-5% faster at 2,048
    positions once resident: not worth seconds of stalls (docs/benchmarks.md).
    The tensor holds the mapping alive."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass
    return torch.frombuffer(memory, dtype=dtype).view(shape)
