"""Verifying a step's speculative rows (scheduler/speculative.py proposes).

A row with k proposals is k + 1 tokens: the request's newest token and the
proposals. Its last k + 1 positions are each sampled as a plain step would
sample that position: the same raw logits (the model saw the proposals
before it), the same processing (penalties count the proposals before the
position, min_tokens its index) and the same random draw (a seeded request's
generator gives position i its (i+1)-th draw from where the step began, and
is wound back to just past the positions kept). Proposal i is accepted while
it equals the sample at position i; the sample at the first position that
differs, or after the last proposal, is the row's own new token. The tokens
a request produces are therefore the ones it would have produced one step at
a time, and each is a sample of the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.interface import SamplingParams, ScheduledRequest, TokenLogprobs


@dataclass(slots=True)
class SamplePosition:
    """One sampled position of a step: a row's last token (``offset`` 0 of a
    plain row) or position ``offset`` of a speculative row's last k + 1."""

    scheduled: ScheduledRequest
    offset: int = 0

    @property
    def request_id(self) -> str:
        return self.scheduled.request_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.scheduled.sampling_params

    @property
    def num_output_tokens(self) -> int:
        """Output tokens before this position (min_tokens counts them)."""
        return self.scheduled.num_output_tokens + self.offset

    @property
    def proposals_before(self) -> list[int]:
        """The proposals this position follows (penalties count them)."""
        return self.scheduled.spec_token_ids[:self.offset]


def sample_positions(rows, pools) -> tuple[list[SamplePosition], list[int]]:
    """The positions ``rows`` sample this step, in order, and the batch row of
    each: a plain row's last token, a speculative row's last k + 1 tokens.
    ``pools(row)``: an embedding request's row (pooled, never sampled)."""
    positions: list[SamplePosition] = []
    index: list[int] = []
    start = 0
    for row in rows:
        start += len(row.token_ids)
        if not row.sample or pools(row):
            continue
        k = len(row.spec_token_ids)
        for offset in range(k + 1):
            positions.append(SamplePosition(row, offset))
            index.append(start - 1 - k + offset)
    return positions, index


@dataclass(slots=True)
class Verified:
    """One request's outcome: the accepted proposals, then its own token."""

    request_id: str
    accepted: list[int]
    token_id: int
    accepted_logprobs: list[TokenLogprobs | None]
    logprobs: TokenLogprobs | None


class Rewind:
    """Keeps the state of each speculative row's seeded generator from before
    the step's draws, to wind it back to just past the positions kept."""

    def __init__(self, positions: list[SamplePosition],
                 generators: dict[str, torch.Generator | None], vocab: int) -> None:
        self.vocab = vocab
        self.saved: dict[str, tuple[torch.Generator, torch.Tensor]] = {}
        for p in positions:
            generator = generators.get(p.request_id)
            if p.offset == 1 and generator is not None:
                self.saved[p.request_id] = (generator, generator.get_state())

    def to(self, request_id: str, draws: int, drew: bool) -> None:
        """Leave ``request_id``'s generator as after ``draws`` positions'
        draws (``drew``: the step drew noise at all, as sampled steps do)."""
        saved = self.saved.get(request_id)
        if saved is None or not drew:
            return
        generator, state = saved
        generator.set_state(state)
        # The same draws, one position at a time, as the sampler makes them.
        buffer = torch.empty(self.vocab, dtype=torch.float32, device=generator.device)
        for _ in range(draws):
            buffer.exponential_(generator=generator)


def verify(positions: list[SamplePosition], token_ids: list[int],
           logprobs: list[TokenLogprobs | None]) -> tuple[list[Verified], dict[str, int]]:
    """Each request's accepted proposals and own token, from the samples of
    its positions; and, for a request one of whose kept positions could not
    be sampled (non-finite logits: token -1), the position it failed at."""
    out: list[Verified] = []
    failed: dict[str, int] = {}
    i = 0
    while i < len(positions):
        row = positions[i].scheduled
        proposals = row.spec_token_ids
        samples = token_ids[i:i + len(proposals) + 1]
        entries = logprobs[i:i + len(proposals) + 1]
        kept = 0
        while kept < len(proposals) and samples[kept] == proposals[kept]:
            kept += 1
        if any(t < 0 for t in samples[:kept + 1]):
            failed[row.request_id] = kept
        else:
            out.append(Verified(row.request_id, list(proposals[:kept]), samples[kept],
                                entries[:kept], entries[kept]))
        i += len(proposals) + 1
    return out, failed
