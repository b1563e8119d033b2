"""Scheduler limits and policy: one typed object, built by the CLI and passed down."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``max_num_batched_tokens`` is the per-step token budget shared by decode
    tokens and prefill chunks; ``max_model_len`` bounds prompt + output.

    ``policy``: ``fcfs`` admits in arrival order; ``priority`` admits by the
    request's ``priority`` (lower first, ties by arrival) and preempts the
    lowest-priority running request first.

    ``long_prefill_token_threshold`` (None: a quarter of the budget): a prompt
    with more than this many tokens left to compute is *long*. A prefill chunk
    gets at most this many tokens until decodes and the other prefills have
    had their share of the step, then whatever budget is left; and only one
    long prompt is prefilled at a time, so shorter requests arriving meanwhile
    are admitted past the waiting long ones.

    ``prefill_only_step_tokens`` (None: off; the server's default is 2048,
    service/config.py): a step that holds no decodes (nobody's next token
    waits for it: an idle engine's first step, a burst's) may admit *short*
    prompts up to this many tokens in all; a long prompt's chunks keep
    ``max_num_batched_tokens``. At or below the budget: no difference.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int | None = None
    prefill_only_step_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")
        if self.prefill_only_step_tokens is not None and self.prefill_only_step_tokens < 1:
            raise ValueError("prefill_only_step_tokens must be >= 1, got "
                             f"{self.prefill_only_step_tokens}")
        if self.long_prefill_token_threshold is not None \
                and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1, got "
                             f"{self.long_prefill_token_threshold}")

    @property
    def long_prefill_threshold(self) -> int:
        """The threshold in effect."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return max(1, self.max_num_batched_tokens // 4)


@dataclass(frozen=True, slots=True)
class FaultPolicy:
    """How the AsyncEngine judges its own health.

    ``unhealthy_after_failed_steps``: this many steps in a row in which every
    scheduled request failed (a broken engine, not one bad request) make
    ``health()`` report unhealthy until a step succeeds again.
    ``stall_timeout``: seconds a busy engine may go without finishing a step
    before ``health()`` reports it stalled.
    ``step_timeout``: seconds one backend step may take before it is
    abandoned as hung and its requests are run again without the one that
    hangs (None: never; a legitimately slow step must never reach it).
    """

    unhealthy_after_failed_steps: int = 3
    stall_timeout: float = 60.0
    step_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.unhealthy_after_failed_steps < 1:
            raise ValueError("unhealthy_after_failed_steps must be >= 1, got "
                             f"{self.unhealthy_after_failed_steps}")
        if self.step_timeout is not None and self.step_timeout <= 0:
            raise ValueError(f"step_timeout must be > 0, got {self.step_timeout}")
        if self.stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be > 0, got {self.stall_timeout}")
