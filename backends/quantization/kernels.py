"""The weight-only matmul kernels torch ships, one thin wrapper per op and
device, and the dtype each one computes in.

  int8 (per output channel): ``aten._weight_int8pack_mm`` on CPU and CUDA.
  int4 (groups along K):     ``aten._weight_int4pack_mm_for_cpu`` with weights
                             from ``_convert_weight_to_int4pack_for_cpu`` on CPU;
                             ``aten._weight_int4pack_mm`` (tinygemm, sm80+) with
                             ``_convert_weight_to_int4pack`` on CUDA.

Every op takes activations and scales of one dtype. On CPU only the int8 and
int4 kernels' bfloat16 paths are fast (float32 and float16 ran 8-40x slower
on an AVX2 machine), so CPU modules cast activations to bfloat16 and back; CUDA's
int4 kernel accepts bfloat16 only. CUDA's int8 kernel computes in float32
whatever it is given, so there activations stay in the serving dtype.
"""

from __future__ import annotations

import torch

from backends.quantization.spec import QuantizationError

aten = torch.ops.aten

# torch's CPU int4 packing works on blocks of 16 output rows; CUDA's on 8.
INT4_ROW_MULTIPLE = 16


def compute_dtype(kind: str, device: torch.device, serving_dtype: torch.dtype) -> torch.dtype:
    """Activation (and scale) dtype of the ``kind`` ("int8" or "int4") kernel."""
    if device.type == "cuda" and kind == "int8":
        return serving_dtype
    return torch.bfloat16


# ------------------------------------------------------------------- int8
def int8_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (weight int8 [N, K] * scales [N, 1]).T -> [M, N] in x's dtype."""
    return aten._weight_int8pack_mm(x, weight, scales)


# ------------------------------------------------------------------- int4
def int4_inner_k_tiles(in_features: int) -> int:
    """CUDA's tinygemm layout packs 2, 4 or 8 k-tiles of 16 back to back; the
    input width must be a multiple of 16 times that. 8 loads widest."""
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    raise QuantizationError(
        f"int4 needs an input width that is a multiple of 32, got {in_features}")


def int4_pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Codes uint8 [N, K] in 0..15 (N a multiple of 16) to the kernel's layout."""
    if device.type == "cuda":
        # [N, K/2] bytes, even column in the high nibble, as the op expects.
        pairs = codes.to(torch.uint8).view(codes.shape[0], -1, 2)
        packed = (pairs[..., 0] << 4) | pairs[..., 1]
        return aten._convert_weight_to_int4pack(
            packed.contiguous().to(device), int4_inner_k_tiles(codes.shape[1]))
    # The CPU op takes one int32 code per element and repacks into its own
    # blocked layout; its inner-k-tiles argument is unused there.
    return aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).to(device), 2)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
            scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the packed int4 weight; ``scales_and_zeros`` [K/G, N, 2]
    holds (scale, zero) per group and row: w = (q - 8) * scale + zero."""
    if x.is_cuda:
        return aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


# ------------------------------------------------------------------- probe
def probe(kind: str, device: torch.device, serving_dtype: torch.dtype) -> None:
    """Run ``kind``'s kernel once on a tiny matrix so a torch build or GPU
    without it fails at load with a clear message, not in the first request."""
    dtype = compute_dtype(kind, device, serving_dtype)
    n, k = INT4_ROW_MULTIPLE, 32
    try:
        x = torch.zeros(1, k, dtype=dtype, device=device)
        if kind == "int8":
            int8_mm(x, torch.zeros(n, k, dtype=torch.int8, device=device),
                    torch.ones(n, dtype=dtype, device=device))
        else:
            packed = int4_pack(torch.zeros(n, k, dtype=torch.uint8), device)
            int4_mm(x, packed, 32, torch.zeros(1, n, 2, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QuantizationError(
            f"torch {torch.__version__} cannot run the {kind} weight-only kernel on "
            f"{device} ({first_line}); int4 on CUDA needs compute capability 8.0 or newer"
        ) from exc
