"""Which engine replica takes a request: the one that holds its prompt's prefix (or its
session, or its LoRA adapter), else the one with the least outstanding work.

``PrefixAffinity`` is the routing state, plain Python: it hashes a prompt's full KV blocks the
way the engine's prefix cache does (a chain of block hashes, so a hash names a whole prefix)
and remembers, within a bound, which replica was sent each prefix, each session and each
adapter. A replica that was sent a prefix most likely still caches it, so a request sharing a
long system prompt or the earlier turns of a conversation reads it from that replica's cache
instead of recomputing it on another. Prefixes under an adapter hash apart from the base
model's (their KV differs, as in the engine's cache); a request with no known prefix goes
where its adapter went last, which holds it read and most likely in a slot, instead of
loading it on one more replica.

``PrefixAwareRouter`` is that state behind Ray Serve's request-router interface: it ranks the
replica holding the longest prefix (or the session's, or the adapter's replica) first, unless that replica has
``imbalance_limit`` more requests in flight than the least busy one; Serve then picks, within
a rank, the replica with the fewest requests in flight.
"""
from __future__ import annotations

import collections
import importlib
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# How many routing decisions of each kind this process made (read by the server's metrics).
DECISIONS: "collections.Counter[str]" = collections.Counter()


def count_decision(reason: str) -> None:
    """Count one decision in this module as this process imported it: Serve may rebuild the
    router class by value, with a copy of this module's globals, where a count would be lost."""
    importlib.import_module(__name__).DECISIONS[reason] += 1


def block_hashes(token_ids: Sequence[int], block_size: int, adapter: Optional[int] = None) -> List[int]:
    """One hash per full block of ``token_ids``, each covering the whole prefix up to it (and
    the LoRA adapter, by id, it runs under)."""
    hashes, previous = [], 0 if adapter is None else hash(("lora", adapter))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        hashes.append(previous)
    return hashes


class PrefixAffinity:
    """Which replicas were sent each prefix (by block hash; the latest last) and which replica
    each session's and each adapter's (by ``lora_int_id``) last request went to, the
    ``capacity`` most recent of each kept."""

    def __init__(self, block_size: int, capacity: int = 100_000):
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be positive, got {block_size}, {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self._prefixes: "collections.OrderedDict[int, Dict[Hashable, None]]" = collections.OrderedDict()
        self._sessions: "collections.OrderedDict[str, Hashable]" = collections.OrderedDict()
        self._adapters: "collections.OrderedDict[int, Hashable]" = collections.OrderedDict()

    def preferred(self, token_ids: Sequence[int], session: Optional[str], replicas: Sequence[Hashable],
                  adapter: Optional[int] = None) -> "Preference":
        """The replica (among ``replicas``) a request should go to and why: its session's,
        else the one sent the longest prefix of it most recently, else its adapter's, else none."""
        alive = set(replicas)
        if session is not None and self._sessions.get(session) in alive:
            return Preference(self._sessions[session], "session")
        for block_hash in reversed(block_hashes(token_ids, self.block_size, adapter)):
            holders = [r for r in self._prefixes.get(block_hash, ()) if r in alive]
            if holders:
                return Preference(holders[-1], "prefix")
        if adapter is not None and self._adapters.get(adapter) in alive:
            return Preference(self._adapters[adapter], "adapter")
        return Preference(None, "least_loaded")

    def record(self, token_ids: Sequence[int], session: Optional[str], replica: Hashable,
               adapter: Optional[int] = None) -> None:
        """``replica`` was sent this request: it now holds the prompt's prefix (and session,
        and adapter)."""
        for block_hash in block_hashes(token_ids, self.block_size, adapter):
            holders = self._prefixes.pop(block_hash, {})
            holders.pop(replica, None)
            holders[replica] = None
            _remember(self._prefixes, block_hash, holders, self.capacity)
        if session is not None:
            _remember(self._sessions, session, replica, self.capacity)
        if adapter is not None:
            _remember(self._adapters, adapter, replica, self.capacity)

    def forget(self, replica: Hashable) -> None:
        """A replica is gone: nothing is routed to it for what it held."""
        for block_hash in list(self._prefixes):
            self._prefixes[block_hash].pop(replica, None)
            if not self._prefixes[block_hash]:
                del self._prefixes[block_hash]
        for table in (self._sessions, self._adapters):
            for key in [k for k, holder in table.items() if holder == replica]:
                del table[key]


def _remember(table: collections.OrderedDict, key, value, capacity: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > capacity:
        table.popitem(last=False)


@dataclass(frozen=True)
class Preference:
    """A routing decision before load is considered: the replica to try first (None: any)."""

    replica: Optional[Hashable]
    reason: str


def routing_key(pending: PendingRequest):
    """The ``ReplicaRequest`` a generation call carries (None for any other call)."""
    for arg in pending.args:
        if hasattr(arg, "token_ids") and hasattr(arg, "session"):
            return arg
    return None


def adapter_id(request) -> Optional[int]:
    """The ``lora_int_id`` of a ``ReplicaRequest``'s adapter (None: the base model)."""
    lora = getattr(request, "lora_request", None)
    return None if lora is None else lora.lora_int_id


class PrefixAwareRouter(RequestRouter):
    """Ray Serve request router: session, prefix or adapter affinity, bounded by load (see the
    module's docstring). ``request_router_kwargs``: ``block_size`` (the engine's KV block),
    ``imbalance_limit`` (requests in flight), ``affinity`` (False: always the least busy)."""

    def initialize_state(self, block_size: int = 16, imbalance_limit: int = 8, capacity: int = 100_000,
                         affinity: bool = True):
        self.affinity = PrefixAffinity(block_size, capacity)
        self.imbalance_limit = imbalance_limit
        self.uses_affinity = affinity

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        request = routing_key(pending_request) if pending_request is not None else None
        if request is None or not candidate_replicas or not self.uses_affinity:
            if request is not None:
                count_decision("least_loaded")
            return [candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        choice = self.affinity.preferred(request.token_ids, request.session, list(by_id), adapter_id(request))
        if choice.replica is not None and self._not_overloaded(choice.replica, list(by_id)):
            count_decision(choice.reason)
            others = [r for r in candidate_replicas if r.replica_id != choice.replica]
            return [[by_id[choice.replica]], others] if others else [[by_id[choice.replica]]]
        count_decision("least_loaded")
        return [candidate_replicas]

    def _not_overloaded(self, replica: ReplicaID, replicas: List[ReplicaID]) -> bool:
        """Whether ``replica`` has at most ``imbalance_limit`` more requests in flight than the
        least busy replica (by the queue lengths Serve last saw; unknown counts as 0)."""
        cache = self.replica_queue_len_cache
        lengths: Dict[ReplicaID, int] = {r: cache.get(r) or 0 for r in replicas}
        return lengths[replica] - min(lengths.values()) <= self.imbalance_limit

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request = routing_key(pending_request)
        if request is not None:
            self.affinity.record(request.token_ids, request.session, replica_id, adapter_id(request))

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
