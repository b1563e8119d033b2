"""Rotary position embeddings: cos/sin tables built once, indexed per step.

Computed the way Hugging Face transformers does it (inverse frequencies and
angles in float32, then cast), so greedy tokens match it exactly in float32.
"""

from __future__ import annotations

import math

import torch

from backends.config import ModelConfig
from backends.errors import ModelLoadError


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = config.rope_scaling
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling.factor, scaling.low_freq_factor,
                                scaling.high_freq_factor,
                                scaling.original_max_position_embeddings)
    raise ModelLoadError(f"unsupported rope scaling type {scaling.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                     high_freq_factor: float, old_context_len: int) -> torch.Tensor:
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band in
    # between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_table(config: ModelConfig, max_positions: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_positions, head_dim], in ``dtype``."""
    inv_freq = inverse_frequencies(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
