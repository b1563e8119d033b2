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

A constrained row may instead defer its mask (``DeferredMasks``, llama.cpp's
order): it picks unmasked first, and only where its grammar rejects that
token is the mask filled and the row picked again, masked, from the same
noise. Where the grammar accepts the unmasked pick, that pick is the one the
masked row would have made: for greedy, the argmax over all tokens is, when
allowed, the argmax over the allowed ones; for the exponential race the
masked row compares the same p_j / E_j, up to one positive factor (the
renormalisation), over a subset that contains the unmasked winner (a pick
that wins by less than float rounding could blur, ``_RACE_MARGIN``, is
masked and picked again instead). Top-k,
top-p and min-p choose their cut from the row's distribution, which the mask
changes, so a row may defer only where ``mask_can_wait`` says none of them
acts on it. Penalties, ``logit_bias`` and banned tokens act before the mask
in both orders.
"""

from __future__ import annotations

from collections.abc import Callable
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
class DeferredMasks:
    """Constrained rows that pick unmasked first (see the module docstring).

    ``resolve`` gets the token each of ``rows`` picked unmasked (in order;
    None where the sampler cannot vouch for the pick: treat it as rejected),
    advances the grammar of every row that accepts its token, and returns
    the positions (into ``rows``) of those it rejected, with their bitmasks
    [len(rejected), W] (None when none was rejected). Those rows are then
    picked again, masked, and their grammar is advanced by the caller."""

    rows: list[int]
    resolve: Callable[[list[int]], tuple[list[int], torch.Tensor | None]]


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
    deferred: DeferredMasks | None = None   # constrained rows whose mask waits


def mask_can_wait(batch: SamplingBatch, greedy_row: bool) -> bool:
    """Whether a constrained row of ``batch`` may pick unmasked first and
    still get exactly the token the masked row would: a greedy row always;
    a sampled row only where no top-k, top-p or min-p acts on the batch
    (their tensors, when present, act on every row, a disabled one too)."""
    return (batch.all_greedy or greedy_row
            or (batch.top_k is None and batch.top_p is None and batch.min_p is None))


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor                 # [S]
    token_logprobs: torch.Tensor | None     # [S]
    top_ids: torch.Tensor | None            # [S, N]
    top_logprobs: torch.Tensor | None       # [S, N]


def plain_greedy(batch: SamplingBatch) -> bool:
    """Whether every row's token is the argmax of its raw logits: all
    greedy, and nothing that changes or reports the logits (bias, banned
    tokens, penalties, a grammar's mask, logprobs)."""
    return (batch.all_greedy and batch.num_logprobs is None and batch.bias is None
            and batch.banned is None and batch.penalties is None and batch.allowed is None
            and batch.deferred is None)


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a ``plain_greedy`` batch: the picked ids (``logits.argmax(-1)``,
    ties to the first index) and which rows are finite (a row with a NaN or
    an infinity as its largest value cannot be sampled). ``logits`` may be in
    the model's dtype: a pick that only compares values needs no float32
    copy. Both answers come from greedy_argmax's blocks: ``logits.max(dim=-1)``
    (values and indices) does not vectorise either, 3.3 ms a step for 32 rows
    of float32 logits on the AVX2 EPYC."""
    token_ids, best = _block_argmax(logits)
    return token_ids, torch.isfinite(best)


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

    noise = race = None
    if batch.all_greedy:
        token_ids = greedy_argmax(logits)
    else:
        token_ids, noise, race = _sample_random(logits, batch)
    if batch.deferred is not None:
        _resolve_deferred(logits, batch, token_ids, noise, race)

    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_ids = top_values = None
    if batch.num_logprobs:
        top_values, top_ids = raw_logprobs.topk(batch.num_logprobs, dim=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_values)


# greedy_argmax's block length: a block's maximum is a vectorised reduction,
# and only one block per row is searched for the index.
_ARGMAX_BLOCK = 1024


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [S, V] logits, the same index (the first
    maximum) found in two cheap passes: each block's maximum (amax, which
    torch vectorises), then the first index of the maximum inside the first
    block that holds it. torch's argmax over the whole row does not
    vectorise: ~0.9 ms for 16 rows of a 49,152-token vocabulary on 2 cores,
    ~0.1 ms this way, in every step. NaN compares as the maximum in both
    (amax propagates it, and argmax takes the first NaN), and so does a
    row of only -inf (index 0)."""
    return _block_argmax(logits)[0]


def _block_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_argmax's index and each row's maximum (NaN where the row holds
    one)."""
    rows, vocab = logits.shape
    nblocks = vocab // _ARGMAX_BLOCK
    if rows == 0 or nblocks < 2 or logits.stride(1) != 1:
        values, index = logits.max(dim=-1)
        return index, values
    main = nblocks * _ARGMAX_BLOCK
    blocks = logits.as_strided((rows, nblocks, _ARGMAX_BLOCK),
                               (logits.stride(0), _ARGMAX_BLOCK, 1))
    block_max = blocks.amax(dim=-1)                                   # [S, nblocks]
    if main < vocab:  # the tail as one more (shorter) block
        block_max = torch.cat([block_max, logits[:, main:].amax(dim=-1, keepdim=True)], 1)
    best = block_max.argmax(dim=-1)                                   # first block with the max
    rows_index = torch.arange(rows, device=logits.device)
    in_block = blocks[rows_index, best.clamp(max=nblocks - 1)].argmax(dim=-1)
    index = best * _ARGMAX_BLOCK + in_block
    if main < vocab:  # rows whose first maximum lies in the tail
        index = torch.where(best < nblocks, index, main + logits[:, main:].argmax(dim=-1))
    return index, block_max[rows_index, best]


# A sampled row's unmasked pick stands only if its p / E beats every other
# token's by this factor: the masked row computes the same ratios scaled by one
# positive factor, each with a few ulp (~1e-7) of rounding, so a closer race
# (a tie included) is left to the mask.
_RACE_MARGIN = 1.0 + 1e-4


def _resolve_deferred(logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor,
                      noise: torch.Tensor | None, race: torch.Tensor | None) -> None:
    """Ask the grammar about each deferred row's unmasked pick; pick the
    rejected rows again with their masks, as the masked path would have:
    the same processed logits and the same noise, row by row."""
    deferred = batch.deferred
    index = torch.tensor(deferred.rows, device=token_ids.device)
    picks = token_ids.index_select(0, index)
    if race is not None:
        # None (rejected unasked) where a sampled row's race is too close.
        top2 = race.index_select(0, index).topk(2, dim=-1).values
        close = top2[:, 0] <= top2[:, 1] * _RACE_MARGIN
        if batch.greedy is not None:
            close &= ~batch.greedy.index_select(0, index)
        tokens = [None if c else t for t, c in zip(picks.tolist(), close.tolist())]
    else:
        tokens = picks.tolist()
    rejected, bitmask = deferred.resolve(tokens)
    if not rejected:
        return
    rows = index[torch.tensor(rejected, device=index.device)]
    bitmask = bitmask.to(logits.device)
    greedy = batch.all_greedy or (batch.greedy is not None
                                  and bool(batch.greedy.index_select(0, rows).all()))
    if greedy:
        picked = masked_argmax(logits, rows, bitmask)
    else:
        sub = logits.index_select(0, rows)
        apply_token_bitmask(sub, torch.arange(len(rejected), device=sub.device), bitmask)
        scaled = sub / batch.temperature.index_select(0, rows).unsqueeze(1)
        picked = (torch.softmax(scaled, dim=-1) / noise.index_select(0, rows)).argmax(dim=-1)
        if batch.greedy is not None:
            picked = torch.where(batch.greedy.index_select(0, rows), sub.argmax(dim=-1), picked)
    token_ids.index_copy_(0, rows, picked)


def masked_argmax(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
                  ) -> torch.Tensor:
    """``logits[rows[i]]`` masked by ``bitmask[i]``, then argmax: the same
    token, ties included, as ``apply_token_bitmask`` followed by
    ``argmax``, but reading only the allowed entries (a grammar that forces
    bytes allows one token, where the full mask costs two passes over the
    vocabulary a row). The lowest allowed id among the largest values wins,
    as argmax takes the first; a row whose allowed entries are all -inf (or
    that allows none) gets 0, as argmax of an all -inf row does."""
    vocab = logits.shape[-1]
    num_rows = len(rows)
    row, word = bitmask.nonzero(as_tuple=True)
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[row, word].unsqueeze(1) >> shifts).bitwise_and_(1).bool()   # [n, 32]
    tokens = (word.unsqueeze(1) * 32 + shifts)[bits]
    owner = row.unsqueeze(1).expand(-1, 32)[bits]
    inside = tokens < vocab
    tokens, owner = tokens[inside], owner[inside]
    values = logits[rows[owner], tokens]
    best = torch.full((num_rows,), float("-inf"), device=logits.device, dtype=logits.dtype)
    best.scatter_reduce_(0, owner, values, "amax")
    first = torch.full((num_rows,), vocab, device=logits.device, dtype=torch.long)
    first.scatter_reduce_(0, owner, torch.where(values == best[owner], tokens, vocab), "amin")
    return first.masked_fill_(best == float("-inf"), 0)


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


def _sample_random(logits: torch.Tensor, batch: SamplingBatch
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The picked ids, the noise drawn for them (clamped) and the race
    (p / E) the sampled rows' ids won."""
    greedy_ids = greedy_argmax(logits) if batch.greedy is not None else None
    scaled = logits / batch.temperature.unsqueeze(1)
    if batch.top_k is not None or batch.top_p is not None:
        _mask_top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if batch.min_p is not None:
        threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = _exponential_noise(probs, batch)
    race = probs / noise
    sampled = greedy_argmax(race)
    if greedy_ids is not None:
        sampled = torch.where(batch.greedy, greedy_ids, sampled)
    return sampled, noise, race


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
