"""Token sampling for a batch whose rows each have their own parameters.

Everything is vectorised over rows; the only per-row Python work is drawing
noise from a seeded request's own generator. Sampling uses the exponential
race (argmax of p / E with E ~ Exp(1)), which draws exactly one number per
vocabulary entry per step, so a seeded request sees the same random stream
whatever else shares its batch. Greedy rows take the argmax of the processed
logits (after bias and penalties).

Rows under a structured-output constraint carry a token bitmask (bit j of
int32 word w allows token 32 * w + j); every other token of such a row is set
to -inf before anything picks, so greedy, sampled, top-k and top-p rows all
stay inside their grammar while unconstrained rows in the same batch are
untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PenaltyInputs:
    rows: torch.Tensor             # [P] batch rows that use penalties
    output_counts: torch.Tensor    # [P, V] how often each token was generated
    prompt_mask: torch.Tensor      # [P, V] token occurs in the prompt
    repetition: torch.Tensor       # [P]
    frequency: torch.Tensor        # [P]
    presence: torch.Tensor         # [P]


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters for the rows that sample this step, on the device."""

    temperature: torch.Tensor               # [S]; 1.0 on greedy rows
    greedy: torch.Tensor | None             # [S] bool; None when no row is greedy
    all_greedy: bool
    top_k: torch.Tensor | None              # [S] long; vocab size where disabled
    top_p: torch.Tensor | None              # [S]
    min_p: torch.Tensor | None              # [S]
    penalties: PenaltyInputs | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # rows, tokens, values
    banned: tuple[torch.Tensor, torch.Tensor] | None               # rows, tokens
    allowed: tuple[torch.Tensor, torch.Tensor] | None              # rows [C], bitmask [C, W]
    generators: list[torch.Generator | None]  # a seeded row's own generator
    shared_generator: torch.Generator
    num_logprobs: int | None                # max top-N over rows; None: no row wants any


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor                 # [S]
    token_logprobs: torch.Tensor | None     # [S]
    top_ids: torch.Tensor | None            # [S, N]
    top_logprobs: torch.Tensor | None       # [S, N]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [S, V] float32, modified in place."""
    raw_logprobs = None
    if batch.num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)

    if batch.bias is not None:
        rows, tokens, values = batch.bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if batch.penalties is not None:
        _apply_penalties(logits, batch.penalties)
    if batch.banned is not None:
        logits.index_put_(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.allowed is not None:
        apply_token_bitmask(logits, *batch.allowed)

    if batch.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        token_ids = _sample_random(logits, batch)

    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_ids = top_values = None
    if batch.num_logprobs:
        top_values, top_ids = raw_logprobs.topk(batch.num_logprobs, dim=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_values)


_BYTE_PENALTIES: dict[torch.device, torch.Tensor] = {}


def _byte_penalties(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: entry (b, k) is 0 where bit k of byte b is set, else -inf."""
    table = _BYTE_PENALTIES.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _BYTE_PENALTIES.setdefault(
            device, torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device))
    return table


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> None:
    """Set ``logits[rows[i], t]`` to -inf wherever bit t of ``bitmask[i]`` is 0
    (and for every t past the bitmask's width); ``rows`` has no duplicates.

    One table lookup per mask byte (an embedding gather of 8 penalties, 0 or
    -inf) and one add: the mask costs two passes over [C, V] floats. Unpacking
    bits with shifts and ``masked_fill`` took ~10x longer at 32 rows of a 49k
    vocabulary (docs/benchmarks.md, "Structured outputs"). Reading an int32
    word as 4 bytes, lowest first, puts bit j of word w at byte j // 8, bit
    j % 8: the little-endian layout of every platform torch runs on.
    """
    vocab = logits.shape[-1]
    num_rows = bitmask.shape[0]
    words = bitmask.contiguous().view(torch.uint8).long()           # [C, 4W]
    penalty = torch.nn.functional.embedding(words, _byte_penalties(logits.device))
    penalty = penalty.view(num_rows, -1)[:, :vocab]                 # [C, <=V]
    if penalty.shape[1] < vocab:
        penalty = torch.nn.functional.pad(penalty, (0, vocab - penalty.shape[1]),
                                          value=float("-inf"))
    logits.index_add_(0, rows, penalty)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    greedy_ids = logits.argmax(dim=-1) if batch.greedy is not None else None
    scaled = logits / batch.temperature.unsqueeze(1)
    if batch.top_k is not None or batch.top_p is not None:
        _mask_top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if batch.min_p is not None:
        threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = _exponential_noise(probs, batch)
    sampled = (probs / noise).argmax(dim=-1)
    if greedy_ids is not None:
        sampled = torch.where(batch.greedy, greedy_ids, sampled)
    return sampled


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    noise = torch.empty_like(probs)
    if all(g is None for g in batch.generators):
        noise.exponential_(generator=batch.shared_generator)
    else:
        for row, generator in enumerate(batch.generators):
            noise[row].exponential_(generator=generator or batch.shared_generator)
    # A zero draw would turn a masked (p = 0) entry into 0/0 = nan, which
    # argmax would pick.
    return noise.clamp_min_(1e-20)


def _mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> None:
    """Set to -inf every entry outside a row's top-k and nucleus (top-p)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        remove |= ranks >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the first token
        # always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p.unsqueeze(1)
    mask = torch.empty_like(remove).scatter_(1, sorted_ids, remove)
    logits.masked_fill_(mask, float("-inf"))


def _apply_penalties(logits: torch.Tensor, p: PenaltyInputs) -> None:
    rows = logits[p.rows]
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = p.repetition.unsqueeze(1)
    rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
    rows = rows - p.frequency.unsqueeze(1) * p.output_counts
    rows = rows - p.presence.unsqueeze(1) * (p.output_counts > 0).to(rows.dtype)
    logits[p.rows] = rows
