"""A paged KV cache: fixed-size blocks of slots in one pool, a block table per sequence, blocks
shared between sequences by reference count and found again by the hash of the prefix they hold.

Notation: ``B`` sequences in a step, ``T`` new tokens per sequence, ``S`` slots attended, ``G``
key/value heads, ``D`` head dim, ``N`` blocks, ``P`` slots per block (``block_size``).

The pool of each layer is ``(N · P, G, D)``: slot ``block · P + i`` holds the ``i``-th token of
that block. A sequence owns no memory of its own, only its block table, the list of its blocks in
order; its token ``j`` sits in slot ``table[j // P] · P + j % P``. Blocks are taken from the free
list as a sequence grows and given back when it ends, so the memory held is what the live tokens
need, rounded up to a block per sequence — the scheme of vLLM's PagedAttention (Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023,
arXiv:2309.06180).

Prefix reuse: a block filled with prompt tokens is never written again, so it can serve every
sequence whose prompt starts with the same tokens. It is keyed by a hash of all the tokens up to
and including its own (:func:`prefix_hashes`); a block whose last user has ended keeps its key and
waits, evictable, in least-recently-used order until the allocator needs it
(:class:`BlockAllocator`).

For attention, :class:`PagedLayerCache` gathers the slots of every row into one contiguous,
left-padded ``(B, G, S, D)`` view, so that the model's ordinary attention (a padding mask over
the keys, each row's own positions) runs the whole batch in one call.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch
from torch import Tensor

from dikkat.generation.protocol import CacheLayout
from dikkat.validate import check_int


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """One key per full block of ``tokens``: block i's key hashes tokens 0 … (i+1)·P − 1, as a
    chain (block i's digest covers block i − 1's), so equal keys mean equal prefixes."""
    keys, previous = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b"".join(int(t).to_bytes(8, "little") for t in block))
        previous = digest.digest()
        keys.append(previous)
    return keys


class BlockAllocator:
    """Blocks ``0 … num_blocks − 1`` with reference counts, and an index of full prefix blocks.

    A block is *used* (count > 0), *free* (count 0, no key) or *evictable* (count 0, still indexed
    by its prefix key, so a later prompt may take it up again); :attr:`free_count` counts free and
    evictable alike, since :meth:`allocate` takes an evictable block (the least recently released)
    when no free one is left. Not thread-safe: its owner holds a lock.
    """

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}

    @property
    def free_count(self) -> int:
        """Blocks :meth:`allocate` can hand out: free ones and evictable cached prefixes."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_count(self) -> int:
        """Blocks indexed by a prefix key (used or evictable)."""
        return len(self._key_of)

    def allocate(self) -> int:
        """A block with count 1: a free one, else the least recently released cached prefix."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_key[self._key_of.pop(block)]
        else:
            raise RuntimeError(f"all {self.num_blocks} blocks are in use")
        self._refs[block] = 1
        return block

    def lookup(self, key: bytes) -> int | None:
        """The block that holds the prefix ``key``, or None."""
        return self._by_key.get(key)

    def share(self, block: int) -> None:
        """One more user of ``block`` (a prefix block found by :meth:`lookup`)."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def register(self, block: int, key: bytes) -> None:
        """Index the full, used ``block`` under its prefix ``key`` (kept: the first block
        registered for a key, or a key already given to this block)."""
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is not in use; only a used block can be indexed")
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key

    def forget(self, block: int) -> None:
        """Take ``block`` out of the prefix index (what it holds is not the prefix its key
        names: the prefill that was to write it failed); evictable, it becomes free."""
        key = self._key_of.pop(block, None)
        if key is None:
            return
        del self._by_key[key]
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)

    def release(self, block: int) -> None:
        """One user fewer; at none, the block becomes evictable (if indexed) or free."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is released more often than it was taken")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)


def slot_table(tables: Sequence[Sequence[int]]) -> Tensor:
    """Block tables (one list per row) → a (B, max blocks) long tensor, short rows padded with
    block 0 (those entries are never read unmasked)."""
    width = max(len(t) for t in tables)
    rows = [list(t) + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.long)


def slots_of(table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Pool slots of token ``positions`` (B, L) of each row, given its block ``table`` (B, n)."""
    return table.gather(1, positions // block_size) * block_size + positions % block_size


def left_padded_slots(
    table: Tensor, lengths: Tensor, block_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's tokens ``0 … lengths[b] − 1`` right-aligned in S = max(lengths) columns.

    Returns (slots (B, S), valid (B, S) False at the padding on the left, positions (B, S)): the
    left padding puts every row's last token in the same column, S − 1, as left-padded prompts
    do in :mod:`dikkat.generation`; pads point at slot 0 and are hidden by ``valid``.
    """
    S = int(lengths.max())
    pad = (S - lengths).unsqueeze(1)  # (B, 1)
    positions = torch.arange(S).unsqueeze(0) - pad  # (B, S), negative on the pads
    valid = positions >= 0
    positions = positions.clamp_min(0)
    return slots_of(table, positions, block_size), valid, positions


class PagedKVPool:
    """The keys and values of every layer: (layers, N · P, G, D) each, zero at the start."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (n_layers, num_blocks * block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def layers(self, write: Tensor, read: Tensor) -> list[PagedLayerCache]:
        """One cache per layer for a forward that writes its T new tokens of each row into the
        slots ``write`` (B, T) and attends the slots ``read`` (B, S) (the new ones last)."""
        device = self.k.device
        write, read = write.to(device), read.to(device)
        return [PagedLayerCache(self.k[i], self.v[i], write, read) for i in range(self.k.shape[0])]


class PagedLayerCache:
    """A :class:`~dikkat.layers.kv_cache.SelfAttentionCache` over one layer's pool.

    ``update(start, k, v)`` scatters the new keys and values (B, G, T, D) into each row's own
    slots and returns the gathered view (B, G, S, D), S = start + T: the view's column j is
    slot ``read[b, j]``, so the attention mask and ``q_offset = start`` address the view as they
    would a :class:`~dikkat.layers.kv_cache.KVCache` filled from slot 0.
    """

    def __init__(self, k_pool: Tensor, v_pool: Tensor, write: Tensor, read: Tensor) -> None:
        self.k_pool, self.v_pool = k_pool, v_pool  # (N · P, G, D)
        self.write, self.read = write, read  # (B, T), (B, S)

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, T = self.write.shape
        S = self.read.shape[1]
        _, G, D = self.k_pool.shape
        if k.shape != (B, G, T, D) or v.shape != k.shape:
            raise ValueError(
                f"this step writes (B, G, T, D) = {(B, G, T, D)}; got k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}"
            )
        if start + T != S:
            raise ValueError(f"start={start} + T={T} must equal the {S} slots this step attends")
        index = self.write.reshape(-1)
        self.k_pool.index_copy_(0, index, k.transpose(1, 2).reshape(B * T, G, D))
        self.v_pool.index_copy_(0, index, v.transpose(1, 2).reshape(B * T, G, D))
        read = self.read.reshape(-1)
        k_all = self.k_pool.index_select(0, read).view(B, S, G, D).transpose(1, 2)
        v_all = self.v_pool.index_select(0, read).view(B, S, G, D).transpose(1, 2)
        return k_all, v_all  # (B, G, S, D)


DEFAULT_CACHE_BYTES = 2**30  # the keys and values of every layer, when num_blocks is not given


def default_num_blocks(layout: CacheLayout, block_size: int, max_batch: int, max_len: int) -> int:
    """Blocks for ``max_batch`` sequences of ``max_len`` tokens, or as many as fit in
    :data:`DEFAULT_CACHE_BYTES` if that is fewer (at least one)."""
    slot_bytes = 2 * layout.n_layers * layout.kv_heads * layout.head_dim * layout.dtype.itemsize
    fits = DEFAULT_CACHE_BYTES // (slot_bytes * block_size)
    return max(1, min(max_batch * -(-max_len // block_size), fits))
