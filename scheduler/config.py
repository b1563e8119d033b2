"""Scheduler limits: one typed object, built by the CLI and passed down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``max_num_batched_tokens`` is the per-step token budget shared by decode
    tokens and prefill chunks; ``max_model_len`` bounds prompt + output."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
