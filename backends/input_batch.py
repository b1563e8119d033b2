"""The persistent input batch: a step's token ids, positions, cache slots
and block tables, written in place into buffers allocated once.

Every request the backend serves owns a row of ``request_tables`` (its KV
block ids) from its first step until it finishes. The scheduler sends each
request's whole table, and with it how many leading blocks it already sent
(``ScheduledRequest.num_known_blocks``: 0 on the first step and after a
preemption, whose recompute gets a new table); only the rest is written, so
a decode step costs a copy of at most one new block id per request.

``fill`` lays a step's rows out token by token: the flat ``input_ids``,
``positions`` and ``slot_mapping`` every step reads, and, for steps whose
every token attends as a decode does (``TokenRowsMetadata``: decodes,
speculative verification rows, prefill chunks), each token's block table
and context length. Those tensors are views of the persistent buffers, valid
until the next ``fill``.

Host arithmetic is numpy on views of the CPU buffers; on CUDA the filled
prefix is copied to the device once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backends.attention import TokenRowsMetadata


@dataclass(slots=True)
class FilledStep:
    """One step's flat inputs (views of the batch's buffers, on the device)
    and, where every row is short enough, its token-rows metadata."""

    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    slot_mapping: torch.Tensor  # [T]
    token_rows: TokenRowsMetadata | None


class InputBatch:
    """Buffers for up to ``max_tokens`` tokens a step; request rows grow as
    needed. ``max_blocks`` bounds a request's table (its longest context
    over the block size)."""

    def __init__(self, max_tokens: int, max_blocks: int, block_size: int,
                 device: torch.device, initial_requests: int = 64) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.device = device
        self._tokens = max_tokens
        self._alloc_tokens(max_tokens)
        self._tables = np.zeros((initial_requests, max_blocks), dtype=np.int64)
        self._known = np.zeros(initial_requests, dtype=np.int64)
        self._rows: dict[str, int] = {}
        self._free: list[int] = list(range(initial_requests - 1, -1, -1))

    def _alloc_tokens(self, n: int) -> None:
        self._tokens = n
        self._ids = torch.zeros(n, dtype=torch.long)
        self._pos = torch.zeros(n, dtype=torch.long)
        self._slots = torch.zeros(n, dtype=torch.long)
        self._lens = torch.zeros(n, dtype=torch.long)
        self._token_tables = torch.zeros(n * 8, dtype=torch.long)
        self._req = np.zeros(n, dtype=np.int64)

    # ------------------------------------------------------------- requests
    @property
    def request_ids(self) -> set[str]:
        return set(self._rows)

    def release(self, request_ids) -> None:
        """Give the rows of these (finished) requests back."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._known[row] = 0
                self._free.append(row)

    def _row(self, request_id: str, table: list[int], known: int) -> int:
        row = self._rows.get(request_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._rows[request_id] = self._free.pop()
            known = 0
        if len(table) > self.max_blocks:
            raise ValueError(f"a block table of {len(table)} blocks exceeds the batch's "
                             f"{self.max_blocks}")
        known = min(known, int(self._known[row]))
        if len(table) > known:
            self._tables[row, known:len(table)] = table[known:]
        self._known[row] = len(table)
        return row

    def _grow(self) -> None:
        old = self._tables.shape[0]
        self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
        self._known = np.concatenate([self._known, np.zeros_like(self._known)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    # ------------------------------------------------------------------ step
    def fill(self, rows, token_rows: bool = False) -> FilledStep:
        """Lay out ``rows`` (ScheduledRequests, or tensor-parallel
        ForwardRows: anything with token_ids, start_pos and block_table) in
        order; with ``token_rows``, each token's block table and context
        length too (TokenRowsMetadata)."""
        num_tokens = sum(len(r.token_ids) for r in rows)
        if num_tokens > self._tokens:
            self._alloc_tokens(max(num_tokens, 2 * self._tokens))
        ids = self._ids.numpy()
        pos = self._pos.numpy()
        req = self._req
        t = 0
        transient = []  # rows without a request id (a tensor-parallel rank's): this step only
        for r in rows:
            n = len(r.token_ids)
            request_id = getattr(r, "request_id", None)
            if request_id is None:
                request_id = ("transient", len(transient))
                transient.append(request_id)
            row = self._row(request_id, r.block_table, getattr(r, "num_known_blocks", 0))
            ids[t:t + n] = r.token_ids
            pos[t:t + n] = np.arange(r.start_pos, r.start_pos + n)
            req[t:t + n] = row
            t += n
        self.release(transient)
        bs = self.block_size
        p = pos[:t]
        slots = self._slots.numpy()[:t]
        np.add(self._tables[req[:t], p // bs] * bs, p % bs, out=slots)
        if t and token_rows:
            lens = self._lens.numpy()[:t]
            np.add(p, 1, out=lens)
            # At least two columns: a compiled step's table width is a
            # dynamic dimension, which Dynamo would specialise at 1.
            width = max(2, int(-(-lens.max() // bs)))
            if t * width > self._token_tables.numel():
                self._token_tables = torch.zeros(2 * t * width, dtype=torch.long)
            tables = self._token_tables[:t * width].view(t, width)
            np.take(self._tables[:, :width], req[:t], axis=0, out=tables.numpy())
            meta = TokenRowsMetadata(self._to_device(self._slots[:t]), self._to_device(tables),
                                     self._to_device(self._lens[:t]), bs)
            return FilledStep(self._to_device(self._ids[:t]), self._to_device(self._pos[:t]),
                              meta.slot_mapping, meta)
        return FilledStep(self._to_device(self._ids[:t]), self._to_device(self._pos[:t]),
                          self._to_device(self._slots[:t]), None)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def check_integrity(self) -> None:
        rows = list(self._rows.values())
        if len(set(rows)) != len(rows) or set(rows) & set(self._free):
            raise AssertionError("input batch rows are shared or both used and free")
        if len(rows) + len(self._free) != self._tables.shape[0]:
            raise AssertionError("input batch rows leaked")
