"""Rotary position embeddings: cos/sin tables built once, indexed per step.

Computed the way Hugging Face transformers does it (inverse frequencies and
angles in float32, then cast), so greedy tokens match it exactly in float32.
"""

from __future__ import annotations

import math

import torch

from backends.config import ModelConfig, RopeScaling
from backends.errors import ModelLoadError


def inverse_frequencies(config: ModelConfig, theta: float | None = None,
                        scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies of the rotary dimensions (``rotary_width`` / 2 of
    them), for base ``theta`` and ``scaling`` (the config's by default). For
    longrope, the short-context set."""
    dim = config.rotary_width
    theta = config.rope_theta if theta is None else theta
    scaling = config.rope_scaling if scaling is None else scaling
    if scaling.rope_type == "longrope":
        return _longrope_inv_freq(theta, dim, scaling.short_factor)
    inv_freq = 1.0 / (theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
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


def _longrope_inv_freq(theta: float, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ModelLoadError(f"longrope needs {dim // 2} factors per set (half the rotary "
                             f"dimensions), the config gives {len(factors)}")
    # The reference's operation order, for bit-equal tables.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)


def _angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs, freqs), dim=-1)


def rope_table(config: ModelConfig, max_positions: int, dtype: torch.dtype,
               device: torch.device, theta: float | None = None,
               scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_positions, rotary_width], in ``dtype``
    (base ``theta`` and ``scaling``: the config's unless given).

    longrope takes its short factors below the original context and its long
    ones from there on, position by position. Hugging Face switches the whole
    sequence to the long factors once it outgrows the original context, so a
    prompt longer than that sees other rotations there; Baton keeps each
    position's rotation fixed, so a token's cached K never depends on how
    long the prompt that computed it was (prefix caching, chunked prefill and
    recomputation after preemption all rely on that). Both agree wherever the
    prompt fits the original context, decoding past it included.
    """
    scaling = config.rope_scaling if scaling is None else scaling
    positions = torch.arange(max_positions, dtype=torch.float32)
    emb = _angles(inverse_frequencies(config, theta, scaling), positions)
    if scaling.rope_type == "longrope":
        start = min(scaling.original_max_position_embeddings, max_positions)
        long_inv = _longrope_inv_freq(config.rope_theta if theta is None else theta,
                                      config.rotary_width, scaling.long_factor)
        emb[start:] = _angles(long_inv, positions[start:])
    cos, sin = emb.cos(), emb.sin()
    if scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos.to(dtype).to(device), sin.to(dtype).to(device)


def local_rope_table(config: ModelConfig, max_positions: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tables of sliding-window layers when their rotary base differs
    (Gemma 3's local layers: own base, no scaling), else None."""
    if config.local_rope_theta is None:
        return None
    return rope_table(config, max_positions, dtype, device, config.local_rope_theta,
                      RopeScaling())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, rotary_dim] (rotate-half layout
    over the first rotary_dim dimensions; the rest pass through)."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
