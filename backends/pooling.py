"""Embedding requests' pooling: from a step's hidden states to one vector
per request.

The backend hands ``Pooler.pool`` the step's hidden states (after the final
norm, one row per scheduled token) and, for each embedding request in the
step, where its chunk sits in them (``PoolSpan``). Last-token pooling reads
the final chunk's last row. Mean pooling keeps each chunk's float32 sum until
the chunk that ends the prompt, so a prompt prefilled over several steps
pools exactly as one prefilled at once.

Invariants:
- A chunk's sum is kept under its start position: running the same chunk
  again (the StepRunner re-runs a failed step's rows in halves) replaces it
  rather than counting it twice, and a chunk starting at position 0 (a
  request recomputed after preemption) drops what came before.
- The pooled vector is computed only from chunks that cover positions
  0 .. end-1 without a gap; anything else fails the request (it would be a
  wrong vector), never returns one.
- Partial sums live until ``release`` is told the request ended (the
  backend passes it SchedulerOutput.finished_request_ids), whatever the exit
  path; ``request_ids`` lists what is held, for integrity checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.interface import PoolingParams, ScheduledRequest


@dataclass(frozen=True, slots=True)
class PoolSpan:
    """One embedding request's chunk in a step: positions
    ``start_pos .. start_pos + num_tokens - 1``, at batch rows
    ``offset ..``; ``final`` when the chunk ends the prompt."""

    request_id: str
    params: PoolingParams
    start_pos: int
    num_tokens: int
    offset: int
    final: bool


def pool_spans(rows: list[ScheduledRequest]) -> list[PoolSpan]:
    """The embedding requests' chunks among ``rows``, the step's rows in
    batch order (each row's tokens follow the previous row's). Host data only."""
    spans = []
    offset = 0
    for row in rows:
        n = len(row.token_ids)
        if row.pooling is not None:
            spans.append(PoolSpan(row.request_id, row.pooling, row.start_pos, n, offset,
                                  row.sample))
        offset += n
    return spans


class Pooler:
    def __init__(self) -> None:
        # request id -> {chunk start: (tokens in it, float32 sum of its rows)}
        self._sums: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}

    def pool(self, hidden: torch.Tensor, spans: list[PoolSpan]
             ) -> tuple[dict[str, list[float]], dict[str, str]]:
        """``hidden`` [num_tokens, hidden_size]: every row of the step.
        Returns the vectors of the requests whose prompt ends this step and,
        for requests that cannot be pooled, why."""
        vectors: list[torch.Tensor] = []
        done: list[PoolSpan] = []
        failed: dict[str, str] = {}
        for span in spans:
            rows = hidden[span.offset:span.offset + span.num_tokens]
            if span.params.pooling_type == "mean":
                sums = self._sums.setdefault(span.request_id, {})
                if span.start_pos == 0:
                    sums.clear()
                sums[span.start_pos] = (span.num_tokens, rows.sum(0, dtype=torch.float32))
            if not span.final:
                continue
            if span.params.pooling_type == "last":
                vectors.append(rows[-1].to(torch.float32))
            else:
                mean = self._mean(span)
                if mean is None:
                    failed[span.request_id] = (
                        "mean pooling did not see every position of the prompt "
                        "(an internal error; the request was not answered with a wrong vector)")
                    continue
                vectors.append(mean)
            done.append(span)
        if not done:
            return {}, failed
        stacked = torch.stack(vectors)
        out = _normalised(stacked, [s.params.dimensions for s in done])
        finite = [bool(ok) for ok in torch.isfinite(stacked).all(dim=-1).tolist()]
        pooled: dict[str, list[float]] = {}
        for span, vector, ok in zip(done, out, finite):
            if ok:
                pooled[span.request_id] = vector
            else:
                failed[span.request_id] = ("the model produced non-finite hidden states "
                                           "(NaN or infinity) for this input")
        return pooled, failed

    def _mean(self, span: PoolSpan) -> torch.Tensor | None:
        """The average over positions 0 .. end-1 from the kept chunk sums,
        or None when they do not cover exactly that."""
        sums = self._sums.get(span.request_id, {})
        end = span.start_pos + span.num_tokens
        covered = 0
        total = None
        for start in sorted(sums):
            n, part = sums[start]
            if start != covered:
                return None
            covered += n
            total = part if total is None else total + part
        if covered != end or total is None:
            return None
        return total / end

    def release(self, request_ids) -> None:
        """Forget the requests that ended (any exit path)."""
        for request_id in request_ids:
            self._sums.pop(request_id, None)

    def request_ids(self) -> set[str]:
        return set(self._sums)


def _normalised(vectors: torch.Tensor, dimensions: list[int | None]) -> list[list[float]]:
    """Each row cut to its ``dimensions`` (None: whole), L2-normalised, as
    float lists: the full-width rows in one call, the cut ones each alone."""
    out: list[list[float] | None] = [None] * len(dimensions)
    whole = [i for i, d in enumerate(dimensions) if d is None or d >= vectors.shape[1]]
    if whole:
        rows = F.normalize(vectors[whole], dim=-1).tolist()
        for i, row in zip(whole, rows):
            out[i] = row
    for i, d in enumerate(dimensions):
        if out[i] is None:
            out[i] = F.normalize(vectors[i, :d], dim=-1).tolist()
    return out  # type: ignore[return-value]
