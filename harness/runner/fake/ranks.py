"""Which ranks of a layout a fake run traces: one per pipeline stage (rank (stage, dp 0, cp 0, tp 0)), the
last tp rank of an uneven split, and under ZeRO-1 the rank with the largest optimizer partition."""

from __future__ import annotations

from typing import Any

from harness.spec import RunSpec


def rank_of(spec: RunSpec, *, stage: int, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
    """Global rank of mesh coordinates (pp, dp, cp, tp), innermost tp (compose.MESH_DIMS)."""
    p = spec.parallel
    return ((stage * p.dp + dp) * p.cp + cp) * p.tp + tp


def uneven_tp(spec: RunSpec) -> bool:
    """Whether tensor-parallel shards differ in size between tp ranks."""
    m, tp = spec.model, spec.parallel.tp
    return tp > 1 and any(
        x % tp for x in (m.vocab_size, m.hidden_size, m.ffn_hidden_size, m.kv_width, m.q_width)
    )


def traced_ranks(spec: RunSpec) -> list[int]:
    """The ranks traced before any ZeRO-1 partition is known: one per pipeline stage, plus the last
    tensor-parallel rank of each stage when tp shards are uneven."""
    p = spec.parallel
    ranks = [rank_of(spec, stage=s) for s in range(p.pp)]
    if uneven_tp(spec):
        ranks += [rank_of(spec, stage=s, tp=p.tp - 1) for s in range(p.pp)]
    return sorted(ranks)


def _zero1_worst_rank(spec: RunSpec, result: dict[str, Any]) -> int | None:
    """With ZeRO-1: the rank of the same stage holding the largest optimizer partition, when it is not
    the traced one (``result["zero1_partition_numel"]`` lists every dp·cp rank's partition)."""
    sizes = result.get("zero1_partition_numel")
    if not sizes:
        return None
    worst = max(range(len(sizes)), key=lambda i: (sizes[i], -i))
    p = spec.parallel
    coords = result["coords"]
    dp, cp = divmod(worst, p.cp)  # the dp_cp group is the flattened (dp, cp) sub-mesh
    rank = rank_of(spec, stage=coords["pp"], dp=dp, cp=cp, tp=coords["tp"])
    return None if rank == result["rank"] else rank
