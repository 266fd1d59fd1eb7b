"""BlockManager: fixed-size KV blocks with ref counts and prefix sharing by hash. No tensors here.

A block holds `block_size` consecutive tokens of one or more sequences. Full blocks are registered under
a chained hash of (previous block's hash, their tokens), so a later prompt with the same prefix reuses
them (ref count > 1). Freed blocks keep their hash and stay reusable until they are handed out again,
least recently freed first. Blocks are only registered once their K/V are computed (vLLM v1), so a hit
never points at K/V that nobody has written.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from keepwarm_runtime.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while registered in the prefix cache
    tokens: tuple[int, ...] | None = None  # the block's tokens, checked on every hit (no silent collisions)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks}x{block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks)
        )  # front = evict first
        self.cached: dict[int, int] = {}  # hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def reserve(self) -> int:
        """Take a free block out of circulation for good (never given to a sequence, never a prefix
        hit): the padding rows of decode graphs write their keys and values there."""
        if not self.free_queue:
            raise RuntimeError("no free KV block to reserve")
        block_id, _ = self.free_queue.popitem()  # the most recently freed: the last to be handed out
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash, block.tokens = None, None
        block.ref_count = 1
        return block_id

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding this sequence's leading full blocks. At least one token is left to
        compute, so the last prompt position still produces logits."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = seq.hash_salt
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else block_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give `seq` blocks for its first `num_tokens` tokens, starting with `cached_blocks` (prefix hits).
        Returns False, changing nothing, when there are not enough free blocks."""
        if not cached_blocks and num_tokens <= len(seq.block_ids) * self.block_size:
            return True  # its blocks already hold them (most decode steps)
        cached_blocks = list(cached_blocks)
        needed = cdiv(num_tokens, self.block_size) - len(seq.block_ids) - len(cached_blocks)
        reviving = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(needed, 0) + reviving > self.num_free_blocks:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        seq.block_ids.extend(cached_blocks)
        for _ in range(max(needed, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                del self.cached[block.hash]
                block.hash, block.tokens = None, None
            block.ref_count = 1
            seq.block_ids.append(block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that `seq.num_computed_tokens` has just filled and whose tokens are all
        known (a token sampled by a step still running is not yet in ``token_ids``)."""
        bs = self.block_size
        num_full = min(min(seq.num_computed_tokens, len(seq.token_ids)) // bs, len(seq.block_ids))
        if num_full <= len(seq.block_hashes):
            return  # no block filled since the last call (most decode steps)
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_salt
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_ids[i]]
            if self.enable_prefix_caching and h not in self.cached and block.hash is None:
                block.hash, block.tokens = h, tokens
                self.cached[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody uses go to the free queue, last block evicted first."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_ids = []
