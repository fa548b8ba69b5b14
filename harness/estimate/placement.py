"""Best fit over counts: the caching allocator's placement of requests into free blocks, and the
blocks and requests the reserved level's mechanism terms place (harness/estimate/segments.py,
harness/estimate/backward_cache.py): one layer's saved tensors as blocks, the parameter tensors a rank
steps. Written by hand over (size, how many) pairs rather than replaying :mod:`harness.alloc` tensor
by tensor: ``plan`` asks these of every candidate and stage."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from harness.estimate.blocks import (
    KMIN_LARGE_ALLOC,
    KSMALL_SIZE,
    block_size,
    layer_tensors,
    request_size,
    segment_size,
)
from harness.estimate.params import chunk_blocks, mlp_shards
from harness.spec import ModelSpec, ParallelSpec, TrainSpec

Counts = tuple[tuple[int, int], ...]  # (size in bytes, how many), sizes ascending


def counts(sizes: dict[int, int]) -> Counts:
    return tuple(sorted((s, n) for s, n in sizes.items() if n > 0))


@lru_cache(maxsize=4096)
def layer_blocks(
    m: ModelSpec, tp: int, cp: int, sp: bool, autocast: bool, t: TrainSpec
) -> tuple[Counts, int, int]:
    """One layer's saved tensors (:func:`layer_tensors`) as (segments, how many), the bytes of those
    that share 20 MiB segments, and the layer's bytes."""
    sizes = layer_tensors(m, ParallelSpec(tp=tp, cp=cp, sequence_parallel=sp), t, autocast=autocast)
    blocks: Counter[int] = Counter(segment_size(s) for s in sizes if s >= KMIN_LARGE_ALLOC)
    return counts(blocks), sum(s for s in sizes if KSMALL_SIZE < s < KMIN_LARGE_ALLOC), sum(sizes)


@lru_cache(maxsize=4096)
def parameter_tensors(
    m: ModelSpec, tp: int, pp: int, stage: int, shards: int, zero: int, ep: int = 1
) -> Counts:
    """The parameter tensors (numel, how many) one rank of ``stage`` steps: the embedding, per layer
    Q, K, V, O, gate, up and down, the head; sharded by dim 0 over the ZeRO-2/3 ``shards``; under
    ZeRO-1 whole tensors, one shard's share of them (``ZeroRedundancyOptimizer`` partitions whole
    parameters). Norm weights (small-pool requests) are left out. With expert parallelism the rank's
    E/ep experts, sharded over the dp·cp/ep ranks that hold them."""
    h = m.hidden_size
    layers = m.num_layers // pp
    out: Counter[int] = Counter({h * m.q_width // tp: 2 * layers})
    out[h * m.kv_width // tp] += 2 * layers
    experts = 0  # the expert matrices of the stage, sharded apart
    for kind, n_layers in chunk_blocks(m, pp):  # dense first layers, then the expert blocks
        # three SwiGLU matrices, or a router (replicated over tp), experts, shared experts
        matrices = mlp_shards(kind, tp=tp, ep=ep)
        routed = 3 * (kind.num_experts // ep) if ep > 1 and kind.moe else 0
        for _, local in matrices[:1] + matrices[1 + routed :] if routed else matrices:
            out[local] += n_layers
        experts += routed * n_layers
    out[m.vocab_size * h // tp] += (stage == 0) + (stage == pp - 1 and not (m.tie_embeddings and pp == 1))
    if shards > 1 and zero >= 2:
        sharded = Counter({-(-n // shards): c for n, c in out.items()})
        if experts:
            sharded[-(-h * m.moe_ffn_hidden_size // tp // (shards // ep))] += experts
        return counts(sharded)
    if experts:
        out[h * m.moe_ffn_hidden_size // tp] += experts
    if shards > 1 and zero == 1:
        return counts({n: -(-c // shards) for n, c in out.items()})
    return counts(out)


@lru_cache(maxsize=4096)
def fp32(tensors: Counts) -> Counts:
    return tuple((4 * n, c) for n, c in tensors)


@lru_cache(maxsize=65536)
def place(blocks: Counts, requests: Counts) -> int:
    """Bytes of the segments opened for ``requests`` over the free ``blocks`` by the allocator's rules:
    best fit (``get_free_block``: the smallest free block at least as large), a remainder over 1 MiB
    split off and cached (``should_split``), no fit → a new segment (``get_allocation_size``) whose
    remainder is cached. Requests are placed largest first, by size class (``foreach`` allocates them
    in parameter order; the order changes only which blocks are split, and lets the placement work on
    a few size classes instead of every tensor)."""
    free = dict(blocks)
    opened = 0
    for size, count in sorted(requests, reverse=True):
        if size <= KSMALL_SIZE:
            continue
        size = request_size(size)
        while count:
            fits = [b for b in free if b >= size and free[b]]
            if fits:
                block = min(fits)
                n = min(count, free[block])
                free[block] -= n
            else:
                block = block_size(size)  # (size > 1 MiB: small requests were skipped)
                n = 1 if block - size >= size else count  # a 20 MiB segment's remainder takes the next
                opened += block * n
            count -= n
            if block - size > KSMALL_SIZE:
                free[block - size] = free.get(block - size, 0) + n
    return opened
