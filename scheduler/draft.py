"""Proposals from a draft model: a smaller model, or a quantized copy of the
target, that shares the target's tokenizer and runs on a backend of its own.

The draft's KV cache is a pool of its own with as many blocks, of the same
size, as the target's, read through the target's block tables: a request's
draft KV lives in the draft pool's copies of the request's blocks, so the
draft needs no allocator, and every block the target frees frees the
draft's copy too. Before proposing, the target's table is grown to hold the
proposals (the verification step needs those slots anyway).

Each proposal round feeds the draft what it has not computed of a request
(the whole prompt the first time, then the tokens accepted since, never past
what the target kept: KV of rejected proposals is recomputed) with its
newest token, samples one proposal, then feeds each proposal back for the
next, k draft steps in all, batched across requests. The draft picks
greedily: a proposal is accepted when it equals the target's own sample
(backends/speculative.py), which a greedy target makes of the draft's most
likely token.
"""

from __future__ import annotations

from backends.interface import SamplingParams, ScheduledRequest, SchedulerOutput

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
# Tokens the draft catches up on in one step, beyond the first request's.
CATCH_UP_TOKENS = 256


class DraftProposer:
    """``backend``: the draft model's (built like the target's, with the
    target's num_kv_blocks and block size)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        # Positions whose draft KV is in place, by request id.
        self._computed: dict[str, int] = {}
        self._round_times: list[float] = []

    def take_round_times(self) -> list[float]:
        """The forward seconds of the proposal rounds since the last call
        (the Speculator weighs a draft's cost with them)."""
        times, self._round_times = self._round_times, []
        return times

    def propose_for(self, wanted, kv_cache) -> dict[str, list[int]]:
        rows: list[ScheduledRequest] = []
        counts: dict[str, int] = {}
        catch_up = 0
        for request, k in wanted:
            rid, n = request.request_id, request.num_tokens
            start = min(self._computed.get(rid, 0), request.num_computed_tokens)
            # The draft prefills what it has not seen (a new request's whole
            # prompt) in its first round: at most CATCH_UP_TOKENS of that a
            # step, past the first request, so that the batch's prompts are
            # not all prefilled by the draft in one stalled step.
            if rows and catch_up + n - start > CATCH_UP_TOKENS:
                continue  # proposes in a later step
            if not kv_cache.allocate_slots(rid, n + k):
                continue  # no blocks to spare: this request decodes plainly
            catch_up += n - start
            tokens = request.token_slice(start, n)
            rows.append(ScheduledRequest(rid, tokens, start, kv_cache.block_table(rid), True,
                                         _GREEDY, 0, prompt_token_ids=[]))
            counts[rid] = k
        proposals: dict[str, list[int]] = {rid: [] for rid in counts}
        while rows:
            result = self.backend.execute(SchedulerOutput(rows))
            # A round of a token or two of one row is what the draft's cost
            # is (ProposalBudget sets it against a target step of one row;
            # one that catches up on a prompt is a prefill's cost, once).
            if len(rows) == 1 and len(rows[0].token_ids) <= 2:
                self._round_times.append(result.timings.forward)
            ends = {row.request_id: row.start_pos + len(row.token_ids) for row in rows}
            tables = {row.request_id: row.block_table for row in rows}
            rows = []
            for rid, token in zip(result.request_ids, result.token_ids):
                proposals[rid].append(token)
                self._computed[rid] = ends[rid]
                if len(proposals[rid]) < counts[rid]:
                    rows.append(ScheduledRequest(rid, [token], ends[rid], tables[rid], True,
                                                 _GREEDY, 0))
        return proposals

    def release(self, request_ids) -> None:
        """Forget these requests, here and in the draft backend."""
        ids = [rid for rid in request_ids if rid in self._computed]
        for rid in ids:
            del self._computed[rid]
        if ids:
            self.backend.execute(SchedulerOutput([], finished_request_ids=ids))

    @property
    def request_ids(self) -> set[str]:
        return set(self._computed)
