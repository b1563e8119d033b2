"""A request as the scheduler sees it. Owned and mutated by the Scheduler only."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from backends.interface import PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the context length
    ABORT = "abort"      # client went away or asked to cancel
    TIMEOUT = "timeout"  # request timeout; ends with what it has
    ERROR = "error"      # an engine fault in a step this request rode in


@dataclass(slots=True)
class Request:
    """``num_computed_tokens`` catches up with ``num_tokens``: prefill chunks,
    decode steps and recompute after preemption are the same motion."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    ever_scheduled: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Lower runs first under the priority policy; ties go by arrival_index,
    # the scheduler's intake order.
    priority: int = 0
    arrival_index: int = 0
    # Prompt tokens found in the prefix cache when first admitted (None until then).
    num_cached_tokens: int | None = None
    # Blocks of its table already sent to the backend (0 again after a
    # preemption: the recompute gets a new table).
    num_blocks_sent: int = 0
    # Tokens proposed to follow it (speculative decoding), verified in its
    # next decode step; none while it prefills.
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_proposed: int = 0   # proposals verified so far
    num_spec_accepted: int = 0   # of those, accepted
    # An embedding request: prefilled, never sampled; it ends when its
    # prompt is computed and the backend returns its pooled vector.
    pooling: PoolingParams | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of prompt + output, without joining the lists."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n_prompt]

    @property
    def is_pooling(self) -> bool:
        return self.pooling is not None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
