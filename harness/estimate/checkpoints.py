"""What recomputation covers in one model chunk, counted by block position (harness/runner/parallel/
recompute.py's ``checkpoint_groups``): the checkpoints, the blocks they cover, and each kind of block's
share of them where the first blocks are dense (``model.moe_dense_layers``)."""

from __future__ import annotations

from harness.estimate.params import chunk_blocks
from harness.spec import ModelSpec, ParallelSpec, TrainSpec


def checkpointed_layers(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """Checkpoints in one model chunk (L/(pp·v) layers) under full recomputation, each keeping its input;
    0 unless recompute is full. Counted per chunk as the runner and Megatron count, N =
    ``recompute_every``: every N-th block (``every``, torchtitan's layer option), the first N blocks
    (``block``), one per group of N consecutive blocks (``uniform``, the last group shorter where N does
    not divide the chunk)."""
    if t.recompute != "full":
        return 0
    layers, n = m.num_layers // (p.pp * p.virtual_stages), t.recompute_every
    if t.recompute_method == "block":
        return min(n, layers)
    if t.recompute_method == "uniform":
        return -(-layers // n)
    return layers // n


def recomputed_layers(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """Blocks of one model chunk that some checkpoint covers (the others keep everything): all of them
    under ``uniform``, one per checkpoint otherwise; 0 unless recompute is full."""
    if t.recompute == "full" and t.recompute_method == "uniform":
        return m.num_layers // (p.pp * p.virtual_stages)
    return checkpointed_layers(m, p, t)


def covered_blocks(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> list[tuple[ModelSpec, int, int]]:
    """(model as the block reads it, blocks, blocks some checkpoint covers) of each kind of block in one
    model chunk, in model order (:func:`harness.estimate.params.chunk_blocks`: dense first layers, then
    the expert blocks): the covered ones are :func:`recomputed_layers`' blocks, counted by position —
    the N-th, 2N-th, ... block (``every``), the first N (``block``), all (``uniform``); all under op,
    none otherwise."""
    out, start, n = [], 0, t.recompute_every
    for kind, blocks in chunk_blocks(m, p.pp * p.virtual_stages):
        if t.recompute == "op" or (t.recompute == "full" and t.recompute_method == "uniform"):
            covered = blocks
        elif t.recompute != "full":
            covered = 0
        elif t.recompute_method == "block":
            covered = max(0, min(start + blocks, n) - start)
        else:
            covered = (start + blocks) // n - start // n
        out.append((kind, blocks, covered))
        start += blocks
    return out
