"""Paged KV-cache accounting (pure Python): blocks, reference counts, prefix caching.

Block 0 is reserved as the *null block*: padded tokens write their K/V there and padded block
table entries point at it, so it is never handed to a request.

A block whose reference count drops to zero goes to the back of the free queue but keeps its
hash, so a later request with the same prefix can take it back (a prefix-cache hit). Blocks
are handed out from the front of the queue, which evicts the least recently freed first.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

NULL_BLOCK = 0


def hash_block(parent: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """Hash of a full block, chained on its parent's hash so equal hashes mean equal prefixes."""
    digest = hashlib.sha256(parent or b"root")
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.digest()


@dataclass
class Block:
    """One page of the cache: who holds it and, when full and computed, its prefix hash."""

    block_id: int
    ref_count: int = 0
    block_hash: Optional[bytes] = None


class KVCacheManager:
    """Allocates paged KV blocks to requests, shares full blocks between equal prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is the eviction order; values are unused.
        self._free: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: Dict[bytes, int] = {}
        self._req_blocks: Dict[str, List[int]] = {}
        self._req_hashes: Dict[str, List[bytes]] = {}
        # Each request's blocks as a tuple (a step's inputs), rebuilt only when they change.
        self._req_tables: Dict[str, Tuple[int, ...]] = {}
        # Prefix-cache figures, in tokens, counted when a request is admitted.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def block_ids(self, request_id: str) -> List[int]:
        return self._req_blocks.get(request_id, [])

    def block_table(self, request_id: str) -> Tuple[int, ...]:
        """The request's blocks in order, as the tuple a step's work carries (the same object
        while they do not change: most decode steps allocate nothing)."""
        table = self._req_tables.get(request_id)
        if table is None:
            table = self._req_tables[request_id] = tuple(self._req_blocks.get(request_id, ()))
        return table

    def table_if_room(self, request_id: str, num_tokens: int) -> Optional[Tuple[int, ...]]:
        """The request's block table if its blocks already hold ``num_tokens`` tokens (the
        common decode step, in one call), else None: ``allocate`` first."""
        table = self._req_tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return table
        return None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: Sequence[int], root: Optional[bytes] = None) -> Tuple[List[int], int]:
        """Longest run of cached full blocks that prefixes ``token_ids`` (``root``: what the
        first block's hash chains on, e.g. the request's LoRA adapter; None: the base model).

        At least one token is always left to compute, so the step produces logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hits: List[int] = []
        parent = root
        max_blocks = (len(token_ids) - 1) // self.block_size
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Make the request hold enough blocks for ``num_tokens`` tokens in total.

        ``cached`` are prefix-cache hits to take first (only for a request holding no blocks).
        Returns False, changing nothing, when the free blocks do not suffice.
        """
        held = self._req_blocks.get(request_id, [])
        if not cached and len(held) * self.block_size >= num_tokens:
            return True  # the common decode step: the last block still has room
        if cached and held:
            raise ValueError(f"request {request_id} already holds blocks; cached blocks only on admission")
        reused_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        new_needed = max(0, self.blocks_needed(num_tokens) - len(held) - len(cached))
        if new_needed + reused_free > self.num_free_blocks:
            return False
        table = self._req_blocks.setdefault(request_id, [])
        self._req_tables.pop(request_id, None)
        for block_id in cached:
            self._take(block_id)
            table.append(block_id)
        if not held:  # an admission: its tokens were looked up in the prefix cache
            self.prefix_query_tokens += num_tokens
            self.prefix_hit_tokens += len(cached) * self.block_size
        for _ in range(new_needed):
            table.append(self._take_fresh())
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evict: the block's contents are about to be overwritten.
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def has_blocks_to_cache(self, request_id: str, num_computed: int) -> bool:
        """Whether ``num_computed`` tokens fill a block of the request not yet registered
        (a cheap test before ``cache_computed_blocks``; most decode steps fill none)."""
        if not self.enable_prefix_caching:
            return False
        hashes = self._req_hashes.get(request_id)
        return num_computed >= (len(hashes) + 1 if hashes else 1) * self.block_size

    def cache_computed_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                              root: Optional[bytes] = None) -> None:
        """Register hashes of the request's blocks fully covered by ``num_computed`` tokens
        (``root`` as ``find_cached_prefix`` takes it)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._req_hashes.setdefault(request_id, [])
        table = self._req_blocks.get(request_id, [])
        num_full = min(num_computed // self.block_size, len(table))
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else root
            block_hash = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(block_hash)
            block = self.blocks[table[i]]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past those ``num_tokens`` tokens need (blocks that
        only rejected draft tokens reached: never full, so never in the prefix cache)."""
        table = self._req_blocks.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return
        self._req_tables.pop(request_id, None)
        while len(table) > keep:
            block = self.blocks[table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def free(self, request_id: str) -> None:
        """Drop the request's references; its blocks become free (still cached) at zero."""
        table = self._req_blocks.pop(request_id, [])
        self._req_hashes.pop(request_id, None)
        self._req_tables.pop(request_id, None)
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (used by tests)."""
        expected = [0] * len(self.blocks)
        for request_id, table in self._req_blocks.items():
            assert len(set(table)) == len(table), "a request holds the same block twice"
            assert self._req_tables.get(request_id, tuple(table)) == tuple(table), "stale block table"
            for block_id in table:
                expected[block_id] += 1
        assert expected[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free, "null block handed out"
        for block in self.blocks[1:]:
            assert block.ref_count == expected[block.block_id], f"block {block.block_id} ref count"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"block {block.block_id} free state"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, "cache map points at a re-used block"
