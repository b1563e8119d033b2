"""Weight-only int8 with one scale per output channel (row), and the
module that runs it: w[n, k] ~= q[n, k] * scale[n], q in -127..127."""

from __future__ import annotations

import torch
from torch import nn

from backends.quantization import kernels


def quantize_int8(weight: torch.Tensor,
                  scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes int8 [N, K], scales [N] in ``scale_dtype``).

    The scale is rounded to ``scale_dtype`` before the codes are chosen, so the
    codes fit the scale the kernel will actually multiply by.
    """
    w = weight.to(torch.float32)
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(scale_dtype)
    codes = torch.round(w / scales.to(torch.float32)[:, None]).clamp(-127, 127)
    return codes.to(torch.int8), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scales.to(torch.float32)[:, None]


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, through ``aten._weight_int8pack_mm``.

    Buffers: ``weight`` int8 [N, K], ``scales`` [N] in the kernel's dtype,
    ``bias`` [N] in the serving dtype or None. Activations are cast to the
    kernel's dtype and the result back to theirs (see kernels.compute_dtype).
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   device: torch.device, serving_dtype: torch.dtype) -> Int8Linear:
        scale_dtype = kernels.compute_dtype("int8", device, serving_dtype)
        codes, scales = quantize_int8(weight, scale_dtype)
        if bias is not None:
            bias = bias.to(device=device, dtype=serving_dtype)
        return cls(codes.to(device), scales.to(device), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = kernels.int8_mm(x2.to(self.scales.dtype).contiguous(), self.weight, self.scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel_dtype={self.scales.dtype}, bias={self.bias is not None}")
