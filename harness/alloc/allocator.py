"""A model of PyTorch's CUDA caching allocator: replay an allocation trace to the allocated and reserved
peaks a GPU would show, without a GPU.

Read from ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.6-2.13; the rules below did not change in that
range) — each rule cites the function it comes from:

- ``round_size``: a request is rounded up to a multiple of 512 B (``kMinBlockSize``), at least 512 B.
- ``get_pool``: requests of at most 1 MiB (``kSmallSize``) go to the small pool, larger ones to the
  large pool; blocks are cached per (stream, pool) and never shared across streams.
- ``get_allocation_size``: a new segment (``cudaMalloc``) is 2 MiB (``kSmallBuffer``) for the small
  pool, 20 MiB (``kLargeBuffer``) for requests below 10 MiB (``kMinLargeAlloc``), else the request
  rounded up to 2 MiB (``kRoundLarge``).
- ``get_free_block``: best fit, the smallest cached free block of the same stream and pool that is large
  enough (ties: lowest address, ``BlockComparatorSize``); with ``max_split_size`` set, a request below it
  never takes a block at or above it, and a request at or above it only takes a block less than 20 MiB
  larger.
- ``should_split`` / ``alloc_found_block``: the block is split when the remainder is at least 512 B
  (small pool, or any pool with expandable segments) or more than 1 MiB (large pool, and only for
  requests below ``max_split_size``); an unsplit remainder stays part of the allocated block and counts
  in ``allocated_bytes`` (what ``torch.cuda.max_memory_allocated`` reports).
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours inside its segment
  only (segments are separate ``cudaMalloc`` ranges).
- ``malloc``: no cached block fits → open a segment; if that exceeds the capacity, release cached
  oversize blocks (``release_available_cached_blocks``, only with ``max_split_size``) and retry, then
  release every cached segment that holds no live block (``release_cached_blocks``) and retry — that
  last retry counts in ``num_alloc_retries`` whether or not anything was released; if it still fails,
  ``num_ooms`` counts an out-of-memory. Zero-byte requests never reach ``malloc`` (``allocate``).
- Ties among equal-size free blocks: the lowest address (``BlockComparatorSize``; newer versions the
  oldest segment first) — this model hands out addresses in segment-creation order, so both agree.
- expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): one growing segment per
  (stream, pool) that maps pages (2 MiB small pool, 20 MiB large pool) at its end as needed; a request
  that fits no free block extends the segment's trailing free block; releasing unmaps the trailing free
  pages. The growth of the virtual range is modelled; unmapping of pages inside the segment is not (an
  approximation that only matters after an out-of-memory retry).

A trace is a list of events as in ``torch.cuda.memory._snapshot()["device_traces"][i]`` (``action``,
``addr``, ``size``, ``stream``): ``alloc`` and ``free_completed`` are replayed, other actions ignored.
Written by hand: no library models this allocator (the xMem paper, arXiv 2510.21048, does the same in
its own code); the free blocks of each (stream, pool) are a sorted list so that a million events replay
in seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

KMIN_BLOCK_SIZE = 512
KSMALL_SIZE = 1 << 20
KSMALL_BUFFER = 2 << 20
KMIN_LARGE_ALLOC = 10 << 20
KLARGE_BUFFER = 20 << 20
KROUND_LARGE = 2 << 20


class OutOfMemory(Exception):
    """The modelled allocator could not serve a request within the capacity."""


def round_size(size: int) -> int:
    """``round_size``: multiples of 512 B, at least 512 B (no ``roundup_power2_divisions``)."""
    if size < KMIN_BLOCK_SIZE:
        return KMIN_BLOCK_SIZE
    return KMIN_BLOCK_SIZE * ((size + KMIN_BLOCK_SIZE - 1) // KMIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the size of the segment opened for a rounded request."""
    if size <= KSMALL_SIZE:
        return KSMALL_BUFFER
    if size < KMIN_LARGE_ALLOC:
        return KLARGE_BUFFER
    return KROUND_LARGE * ((size + KROUND_LARGE - 1) // KROUND_LARGE)


@dataclass(eq=False)
class Block:
    addr: int
    size: int
    segment: Segment
    allocated: bool = False
    requested: int = 0
    prev: Block | None = None
    next: Block | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)


@dataclass(eq=False)
class Segment:
    addr: int
    size: int
    stream: int
    small: bool
    expandable: bool = False
    first: Block | None = None

    def blocks(self) -> Iterator[Block]:
        b = self.first
        while b is not None:
            yield b
            b = b.next


@dataclass
class ReplayResult:
    """What a replay measured; the names of ``torch.cuda.memory_stats`` where one exists."""

    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    allocated_at_reserved_peak_bytes: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_events: int = 0
    num_segments_opened: int = 0
    oom_event: int | None = None
    reserved_peak_event: int | None = None
    segments_at_reserved_peak: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved minus allocated at the reserved peak: what the caching cost at its worst moment."""
        return self.peak_reserved_bytes - self.allocated_at_reserved_peak_bytes

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "segments_at_reserved_peak"}
        out["fragmentation_bytes"] = self.fragmentation_bytes
        return out


class CachingAllocator:
    """The allocator's state: segments, blocks and the free blocks of each (stream, pool)."""

    def __init__(
        self,
        *,
        capacity_bytes: int | None = None,
        max_split_size_mb: float | None = None,
        expandable_segments: bool = False,
    ):
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be > 0 (or None: unlimited)")
        if max_split_size_mb is not None and max_split_size_mb * (1 << 20) < KLARGE_BUFFER:
            # The allocator's config parser refuses values below kLargeBuffer (min_allowed_split_size_mb).
            raise ValueError(f"max_split_size_mb={max_split_size_mb} must be >= 20 (the allocator's minimum)")
        self.capacity = capacity_bytes
        self.max_split = int(max_split_size_mb * (1 << 20)) if max_split_size_mb is not None else None
        self.expandable = expandable_segments
        self.free: dict[tuple[int, bool], SortedList] = {}  # (stream, small) -> free blocks by (size, addr)
        self.by_addr: dict[int, Block] = {}  # free blocks by address (for release)
        self.segments: dict[int, Segment] = {}
        self.expandable_of: dict[tuple[int, bool], Segment] = {}
        self.allocated = 0
        self.reserved = 0
        self.retries = 0
        self.ooms = 0
        self.opened = 0
        self._next_addr = 1 << 40  # virtual addresses of our own: segments never touch

    # --- a state read from a real allocator ------------------------------------------------------
    def seed_segment(
        self,
        *,
        addr: int,
        stream: int,
        small: bool,
        blocks: list[tuple[int, int, bool, int]],
        expandable: bool = False,
    ) -> list[Block]:
        """Put a segment the real allocator holds into the model as it is (a snapshot's ``segments``
        entry), so that a replay starts from the real state instead of an empty cache. ``blocks``: the
        segment's blocks in address order as (address, size, allocated, requested bytes). Counts in
        ``reserved`` and ``allocated`` but not in ``opened``. Returns the allocated blocks, in order."""
        size = sum(b[1] for b in blocks)
        seg = Segment(addr=addr, size=size, stream=stream, small=small, expandable=expandable)
        prev: Block | None = None
        held = []
        for b_addr, b_size, allocated, requested in blocks:
            block = Block(addr=b_addr, size=b_size, segment=seg, allocated=allocated, prev=prev)
            if prev is None:
                seg.first = block
            else:
                prev.next = block
            prev = block
            if allocated:
                block.requested = requested
                self.allocated += b_size
                held.append(block)
            else:
                self._cache(block)
        self.segments[addr] = seg
        self.reserved += size
        if expandable:
            self.expandable_of.setdefault((stream, small), seg)
        # The model's own segments go above every real one (and an expandable one's room to grow).
        self._next_addr = max(self._next_addr, addr + size + (1 << 48))
        return held

    # --- the pool of free blocks -----------------------------------------------------------------
    def _pool(self, stream: int, small: bool) -> SortedList:
        pool = self.free.get((stream, small))
        if pool is None:
            pool = self.free[(stream, small)] = SortedList()
        return pool

    def _cache(self, b: Block) -> None:
        self._pool(b.segment.stream, b.segment.small).add(b.key)
        self.by_addr[b.addr] = b

    def _uncache(self, b: Block) -> None:
        self.free[(b.segment.stream, b.segment.small)].remove(b.key)
        del self.by_addr[b.addr]

    def _best_fit(self, size: int, stream: int, small: bool) -> Block | None:
        """``get_free_block``: the smallest free block of this stream and pool that holds ``size``."""
        pool = self.free.get((stream, small))
        if not pool:
            return None
        i = pool.bisect_left((size, -1))
        if i == len(pool):
            return None
        found_size, addr = pool[i]
        if self.max_split is not None:
            if size < self.max_split and found_size >= self.max_split:
                return None  # an oversize block is never split for a small request
            if size >= self.max_split and found_size >= size + KLARGE_BUFFER:
                return None  # nor used for an oversize request it exceeds by 20 MiB or more
        return self.by_addr[addr]

    # --- segments ----------------------------------------------------------------------------------
    def _fits_capacity(self, extra: int) -> bool:
        return self.capacity is None or self.reserved + extra <= self.capacity

    def _open_segment(self, size: int, stream: int, small: bool) -> Block | None:
        """``alloc_block``: a new segment for a request of ``size`` (None when over capacity)."""
        seg_size = allocation_size(size)
        if not self._fits_capacity(seg_size):
            return None
        addr = self._next_addr
        self._next_addr += seg_size + KLARGE_BUFFER
        seg = Segment(addr=addr, size=seg_size, stream=stream, small=small)
        seg.first = Block(addr=addr, size=seg_size, segment=seg)
        self.segments[addr] = seg
        self.reserved += seg_size
        self.opened += 1
        return seg.first

    def _grow_expandable(self, size: int, stream: int, small: bool) -> Block | None:
        """Expandable segments: map pages at the end of this (stream, pool)'s segment until its trailing
        free block holds ``size``."""
        page = KSMALL_BUFFER if small else KLARGE_BUFFER
        seg = self.expandable_of.get((stream, small))
        if seg is None:
            seg = Segment(addr=self._next_addr, size=0, stream=stream, small=small, expandable=True)
            self._next_addr += 1 << 48  # room to grow
            self.segments[seg.addr] = seg
            self.expandable_of[(stream, small)] = seg
        last = None
        for last in seg.blocks():  # noqa: B007 - the trailing block
            pass
        tail_free = last.size if (last is not None and not last.allocated) else 0
        need = -(-(size - tail_free) // page) * page
        if not self._fits_capacity(need):
            return None
        self.reserved += need
        self.opened += 1
        if tail_free:
            self._uncache(last)
            last.size += need
            seg.size += need
            return last
        block = Block(addr=seg.addr + seg.size, size=need, segment=seg, prev=last)
        if last is None:
            seg.first = block
        else:
            last.next = block
        seg.size += need
        return block

    def _release_segment(self, seg: Segment) -> None:
        self._uncache(seg.first)
        del self.segments[seg.addr]
        self.reserved -= seg.size

    def _release_cached(self) -> None:
        """``release_cached_blocks``: free every segment that holds no live block (and unmap the
        trailing free pages of expandable segments)."""
        for seg in list(self.segments.values()):
            if seg.expandable:
                self._unmap_tail(seg)
            elif seg.first.next is None and not seg.first.allocated:
                self._release_segment(seg)

    def _unmap_tail(self, seg: Segment) -> bool:
        page = KSMALL_BUFFER if seg.small else KLARGE_BUFFER
        last = None
        for last in seg.blocks():  # noqa: B007
            pass
        if last is None or last.allocated:
            return False
        start = -(-(last.addr - seg.addr) // page) * page + seg.addr
        cut = seg.addr + seg.size - start
        if cut <= 0:
            return False
        self._uncache(last)
        last.size -= cut
        seg.size -= cut
        self.reserved -= cut
        if last.size == 0:
            if last.prev is None:
                seg.first = None
            else:
                last.prev.next = None
        else:
            self._cache(last)
        return True

    def _release_oversize(self, size: int, stream: int, small: bool) -> bool:
        """``release_available_cached_blocks`` (only with ``max_split_size``): free the smallest cached
        oversize segment that holds ``size``, else the largest ones until as much was freed."""
        if self.max_split is None:
            return False
        key = max(size, self.max_split)
        pool = self.free.get((stream, small))
        if not pool:
            return False

        def whole(b: Block) -> bool:
            return b.prev is None and b.next is None and not b.segment.expandable

        i = pool.bisect_left((key, -1))
        candidates = [self.by_addr[a] for _, a in pool.islice(i)]
        for b in candidates:
            if whole(b):
                self._release_segment(b.segment)
                return True
        released = 0
        for s, a in list(pool.islice(0, i, reverse=True)):
            if released >= key or s < self.max_split:
                break
            b = self.by_addr[a]
            if whole(b):
                released += b.size
                self._release_segment(b.segment)
        return released >= key

    # --- malloc / free -----------------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0) -> Block:
        """``malloc``: the block serving a request of ``size`` bytes on ``stream``; raises OutOfMemory."""
        rounded = round_size(size)
        small = rounded <= KSMALL_SIZE
        block = self._best_fit(rounded, stream, small)
        if block is not None:
            self._uncache(block)
        else:
            if self.expandable:
                block = self._grow_expandable(rounded, stream, small)
            else:
                block = self._open_segment(rounded, stream, small)
            if block is None and self._release_oversize(rounded, stream, small):
                block = self._retry_open(rounded, stream, small)
            if block is None:
                # release_cached_blocks always returns true, so the third attempt is always made and
                # counted (alloc_block(..., isRetry=true) counts before its capacity check).
                self._release_cached()
                self.retries += 1
                block = self._retry_open(rounded, stream, small)
            if block is None:
                self.ooms += 1
                raise OutOfMemory(
                    f"{size} B requested, {self.reserved} B reserved of {self.capacity} B capacity"
                )
        self._split(block, rounded)
        block.allocated = True
        block.requested = size
        self.allocated += block.size
        return block

    def _retry_open(self, size: int, stream: int, small: bool) -> Block | None:
        if self.expandable:
            return self._grow_expandable(size, stream, small)
        return self._open_segment(size, stream, small)

    def _split(self, block: Block, size: int) -> None:
        """``should_split``: cut the remainder off as a free block of its own, if it is large enough."""
        remaining = block.size - size
        if block.segment.small or self.expandable:
            split = remaining >= KMIN_BLOCK_SIZE
        else:
            split = (self.max_split is None or size < self.max_split) and remaining > KSMALL_SIZE
        if not split:
            return
        rest = Block(
            addr=block.addr + size, size=remaining, segment=block.segment, prev=block, next=block.next
        )
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        self._cache(rest)

    def free_block(self, block: Block) -> None:
        """``free_block``: return the block to its pool, merged with free neighbours in its segment."""
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._uncache(other)
                if other is block.prev:
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        self._cache(block)

    def segments_table(self) -> list[dict[str, Any]]:
        """Every segment with its blocks, for a printed summary."""
        out = []
        for seg in sorted(self.segments.values(), key=lambda s: s.addr):
            blocks = list(seg.blocks())
            out.append(
                {
                    "pool": "small" if seg.small else "large",
                    "stream": seg.stream,
                    "size": seg.size,
                    "allocated": sum(b.size for b in blocks if b.allocated),
                    "requested": sum(b.requested for b in blocks if b.allocated),
                    "blocks": len(blocks),
                    "expandable": seg.expandable,
                }
            )
        return out
