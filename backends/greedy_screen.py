"""The greedy pick of a few rows without reading the whole output projection.

A plain greedy step (every row greedy; no logprobs, bias, penalties or
grammar: ``sampler.plain_greedy``) needs only each row's argmax. Reading the
bf16 output projection is ~21% of what a one-row decode step of SmolLM2
reads (57 of 269 MB). ``ScreenedGreedyPick`` keeps an int8 copy of it (half
the bytes, per-row scales) and for each row:

1. ``baton::greedy_screen`` (kernels/greedy_screen.c) computes every
   approximate logit from the int8 copy, with a rigorous bound on how far the
   projection's own bf16 logit can lie from it, and the largest lower bound;
2. only the vocabulary rows whose upper bound reaches that lower bound can
   hold the argmax (typically 2, at most a few hundred on random prompts);
   their exact logits come from the projection's own kernel on just those
   rows (the AMX tile linear or the gemv: a logit's bits depend only on its
   weight row and the input row), and the pick is the first largest of them.

So the token is the one ``row_max`` would pick over all the logits, ties to
the lowest id (tests/test_greedy_screen.py checks it against the full
projection, near-ties included). Anything the bound does not cover (a
non-finite row, logits near bf16's overflow, more than ``MAX_CANDIDATES``
candidates) returns None: the caller computes every logit as before.
"""

from __future__ import annotations

import torch

from backends import kernels
from backends.kernels import GemvBf16

# Above this many candidate rows the exact pass costs more than it saves.
MAX_CANDIDATES = 2048
# Vocabulary rows converted to the int8 copy at a time (float32 scratch).
_CHUNK = 4096


def untile(w_tiled: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """``GemvBf16.tile``'s inverse: the [out_features, in_features] weight."""
    n16, k32, pairs, lanes = w_tiled.shape
    r = GemvBf16.TILE_ROWS
    w = w_tiled.view(n16, k32, pairs, r, 2).permute(0, 3, 1, 2, 4)
    return w.reshape(n16 * r, k32 * GemvBf16.TILE_COLS)[:out_features, :in_features]


def int8_copy(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q int8 [ceil(V / 16), K, 16] (sixteen vocabulary rows side
    by side per column, greedy_screen.c's layout), scales float32 [V] with
    |w - scale * q| <= scale (0.5 + 1e-5) for every element (scale = max |row|
    / 127, q = round(w / scale); an all-zero row has scale 0 and q 0)."""
    v, k = weight.shape
    v16 = -(-v // 16)
    q = torch.zeros(v16 * 16, k, dtype=torch.int8)
    scales = torch.zeros(v, dtype=torch.float32)
    for start in range(0, v, _CHUNK):
        w = weight[start:start + _CHUNK].to(torch.float32)
        s = w.abs().amax(dim=1) / 127
        if not torch.isfinite(s).all():
            raise ValueError("the output projection holds a non-finite weight")
        # |w / s| <= 127 (1 + 2^-23): float32's quotient is within 2^-17 of
        # the real one, so |w - s q| <= s (0.5 + 2^-17) < s (0.5 + 1e-5).
        ratio = torch.where(s.unsqueeze(1) > 0, w / torch.where(s > 0, s, 1.0).unsqueeze(1), 0.0)
        q[start:start + len(w)] = ratio.round().clamp(-127, 127).to(torch.int8)
        scales[start:start + len(w)] = s
    return q.view(v16, 16, k).permute(0, 2, 1).contiguous(), scales


class ScreenedGreedyPick:
    """The plan's greedy screen (``plan.greedy_screen`` rows) over ``head``, a
    ``Bf16WeightLinear`` output projection with bf16 weights whose calls of
    up to ``max_rows`` rows run the AMX tile linear or the gemv."""

    def __init__(self, head, kind: str, max_rows: int) -> None:
        if head.weight_tiled.dtype != torch.bfloat16 or max_rows > GemvBf16.max_rows:
            raise ValueError("the greedy screen takes a bf16 tiled output projection and "
                             f"at most {GemvBf16.max_rows} rows")
        if head.bias is not None:  # the bound is on x @ W^T alone
            raise ValueError("the greedy screen takes an output projection without bias")
        self.head = head
        self.kind = kernels.kind_id(kind)
        self.max_rows = max_rows
        weight = untile(head.weight_tiled, head.out_features, head.in_features)
        self.q, self.scales = int8_copy(weight)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scales.numel()

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token ids, which rows are finite) as ``sampler.greedy_pick`` gives
        them for ``head(hidden)``, or None where the screen cannot decide."""
        rows = hidden.shape[0]
        if not 0 < rows <= self.max_rows or hidden.dtype != torch.bfloat16:
            return None
        hidden = hidden.contiguous()
        candidates, tiles = torch.ops.baton.greedy_screen(
            hidden, self.q, self.scales, self.head.weight_tiled, MAX_CANDIDATES, self.kind)
        if candidates.numel() == 0:
            return None
        # Every row's exact logits over every row's candidates (one call of
        # the step's rows, as the projection would make it): a row's own
        # candidates hold its argmax, and every other candidate's logit is
        # below the row's largest lower bound, so it cannot win or tie.
        logits = self.head.features_only(hidden, candidates, tiles)
        values, index = torch.ops.baton.row_max(logits, self.kind)
        return candidates[index], torch.isfinite(values)
