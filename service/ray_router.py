"""Cache-aware routing of requests to Baton replicas on Ray Serve.

A Ray Serve custom request router (``ray.serve.request_router``): requests
whose prompts start the same way go to the replica that served that start
before (its prefix cache holds the blocks), unless that replica is busier
than the least loaded one by more than ``imbalance`` requests; otherwise, to
the least loaded replica. Load is what the engines report
(``BatonReplica.record_routing_stats``: running and waiting requests, KV
cache usage), plus Ray Serve's own count of requests in flight to each
replica, which is fresher.

Prompts are compared by a chain of hashes over ``chunk_chars``-character
pieces of the text the ingress extracts (a completion's prompt, a chat's
messages in order): the router never tokenizes, and a shared text prefix
is, but for the last partial piece, a shared token prefix. The index maps
each chained hash to the replica that last received it (least recently used
entries go first, past ``capacity``).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

log = logging.getLogger("baton.router")

ROUTING_KEY = "routing_key"

def prefix_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """Chained hashes of the text's whole ``chunk_chars`` pieces."""
    hashes, parent = [], b""
    data = text.encode("utf-8", "surrogatepass")
    step = chunk_chars
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.blake2b(parent + data[start:start + step], digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixAwareRouter(RequestRouter):
    """``request_router_kwargs``: ``chunk_chars`` (64), ``imbalance``
    (requests a prefix holder may be busier than the least loaded replica
    and still get the request; 8), ``capacity`` (index entries; 100000)."""

    def initialize_state(self, chunk_chars: int = 64, imbalance: int = 8,
                         capacity: int = 100_000, **kwargs: Any) -> None:
        self.chunk_chars = chunk_chars
        self.imbalance = imbalance
        self.capacity = capacity
        self._index: OrderedDict[bytes, str] = OrderedDict()

    # ------------------------------------------------------------- choosing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Every candidate is weighed at once: when none of them can take
            # the request now, Ray Serve should back off before asking again
            # (without it, it asks again at once, never yielding to the
            # queue-length probes it waits for).
            pending_request.routing_context.should_backoff = True
        kwargs = pending_request.kwargs if pending_request is not None else {}
        # Equally loaded replicas (an idle application) take turns at random.
        by_load = sorted(candidate_replicas, key=lambda r: (self.load(r), random.random()))
        holder = self._holder(kwargs.get(ROUTING_KEY), candidate_replicas)
        if holder is not None and self.load(holder) <= self.load(by_load[0]) + self.imbalance:
            return [[holder], [r for r in by_load if r is not holder]]
        return [[by_load[0]], by_load[1:]] if len(by_load) > 1 else [by_load]

    def load(self, replica: RunningReplica) -> float:
        """Requests the engine runs or queues (as it last reported), or Ray
        Serve's own count in flight if that is higher; KV cache usage breaks
        ties."""
        stats = replica.routing_stats or {}
        engine = stats.get("num_running", 0) + stats.get("num_waiting", 0)
        in_flight = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return max(engine, in_flight) + stats.get("kv_usage", 0.0)

    def _holder(self, key: str | None, candidates: list[RunningReplica]
                ) -> RunningReplica | None:
        """The candidate that served the longest prefix of ``key``."""
        if not key:
            return None
        by_id = {r.replica_id.to_full_id_str(): r for r in candidates}
        for digest in reversed(prefix_hashes(key, self.chunk_chars)):
            replica = by_id.get(self._index.get(digest, ""))
            if replica is not None:
                return replica
        return None

    # ------------------------------------------------------------ recording
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        key = pending_request.kwargs.get(ROUTING_KEY) if pending_request else None
        if not key:
            return
        owner = replica_id.to_full_id_str()
        for digest in prefix_hashes(key, self.chunk_chars):
            self._index[digest] = owner
            self._index.move_to_end(digest)
        while len(self._index) > self.capacity:
            self._index.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        gone = replica_id.to_full_id_str()
        for digest in [d for d, owner in self._index.items() if owner == gone]:
            del self._index[digest]


