"""The reserved level's mechanism terms (issue 32): the caching allocator's rules applied to the tensors
the engine already counts, for what the rules open beyond the allocated peak.

Found by replaying fake traces of the paper's grids and reading which segments the replay opened
(docs/gpu-memory.md); the blocks cached and free at the loss's peak are terms of their own
(:mod:`harness.estimate.loss_cache`: the loss's logits, FSDP2's outside units, full recomputation's
packing and working set); here the two that come after it, one term each:

- ``reduce_stream``: blocks are cached per stream (``get_pool``). The FP32 gradient blocks that
  ``replicate`` and FSDP2 allocate on their reduce stream (one per unit, alive until the optimizer step
  is done) can use none of the compute stream's cache: each opens a segment. On Llama-2-13B tp 2 × pp 2
  × dp 2 that is 11.8 GiB of the 14.9 GiB the replay reserved above the allocated peak.
- ``optimizer_step_segments``: the allocator never gives segments back during a step, so when the
  optimizer step starts every block that held an activation or a buffer is cached and free. A
  ``foreach`` AdamW step allocates one FP32 temporary per parameter tensor (``_foreach_sqrt``, all
  alive together), and a request fits only a free block at least as large (``get_free_block``): a
  SwiGLU weight's temporary is h·f/t·4 B, the largest activation s·b·f/(t·c)·e B. Where the gradients
  were freed before the step (replicate, DDP under no_sync) their blocks hold the temporaries. On
  Llama-2-13B tp 2 × pp 4 with one data-parallel rank, 20 of the 30 FFN temporaries open a segment.

The cache is modelled as the blocks of the tensors alive at the forward/backward peak (every activation
tensor of every layer and in-flight micro-batch at its own size, each temporary buffer, parameter
copies); a block of at least 10 MiB is a segment of its own rounded up to 2 MiB, smaller ones share
20 MiB segments (``get_allocation_size``). The temporaries are placed by best fit, a remainder over
1 MiB split off as a free block (``should_split``, large pool). Written by hand over counts, not by
replaying :mod:`harness.alloc` (a layer below this one): ``plan`` asks it of every candidate and stage.
Not modelled (named in docs/gpu-memory.md): fragmentation inside forward and backward, which
calibration fits.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import lru_cache

from harness.estimate.backward_cache import (
    CACHED_BUFFERS,
    embedding_grad_segments,
    first_backward_segments,
    whole_embedding_grad,
)
from harness.estimate.blocks import KLARGE_BUFFER, KMIN_LARGE_ALLOC, KSMALL_SIZE, block_size, segment_size
from harness.estimate.buffers import kept_head
from harness.estimate.checkpoints import recomputed_layers
from harness.estimate.dtypes import torch_autocast
from harness.estimate.loss_cache import (
    SWIGLU_WORKING_SET,
    accumulated_grad_segments,
    fsdp_embedding_grad_segment,
    fsdp_root_segments,
    loss_logits_segment,
    op_packing_segments,
    recompute_packing_segments,
    recompute_working_set_segments,
    swiglu_bytes,
)
from harness.estimate.params import (
    chunk_blocks,
    layer_expert_params,
    layer_params,
    non_layer_params,
)
from harness.estimate.placement import Counts, counts, fp32, layer_blocks, parameter_tensors, place
from harness.estimate.states import torch_grads_at_peak
from harness.spec import ModelSpec, ParallelSpec, RunSpec, TrainSpec


def replicated(p: ParallelSpec) -> bool:
    """The runner's ZeRO-0/1 under pipelining: composable ``replicate`` (FSDP2's machinery), whose
    gradients are reduced in FP32 buffers on its own stream (harness/runner/parallel/data.py)."""
    return _replicated(p.pp, p.dp * p.cp, p.zero_stage)


def _replicated(pp: int, shards: int, zero: int) -> bool:
    return pp > 1 and shards > 1 and zero <= 1


def grads_freed_before_step(p: ParallelSpec, t: TrainSpec, stage: int) -> bool:
    """Whether a rank's per-parameter FP32 gradients are freed before the optimizer step, their blocks
    cached for its temporaries: ``replicate`` copies them into its reduce buffers, and DDP's gradients
    accumulated under ``no_sync`` (``states.torch_grads_at_peak``: "kept_and_accumulated") are copied
    into its buckets by the last micro-batch's backward. Traced (Llama-2-13B cp 4 × dp 2, ZeRO-1,
    8 micro-batches): the step's 135 MiB temporaries open no segment. FSDP2 (ZeRO-2/3) accumulating
    unsharded FP32 gradients over micro-batches (``train.grad_sync=last``: "accumulated")
    reduce-scatters each unit's in the last backward and frees them: every one's block is cached and
    free when the step starts (Llama-3-70B tp 8 × dp 4, ZeRO-3, full recomputation, 8 micro-batches:
    the engine's reserved level read 5.2 % over the replay while the step's sharded temporaries opened
    4.65 GiB of segments beside them)."""
    grads = torch_grads_at_peak(p, t, stage=stage)
    fsdp = p.zero_stage >= 2 and p.dp * p.cp > 1 and grads == "accumulated"
    return replicated(p) or grads == "kept_and_accumulated" or fsdp


@lru_cache(maxsize=4096)
def _reduce_units(
    m: ModelSpec, tp: int, pp: int, stage: int, shards: int, zero: int, head: int, ep: int = 1
) -> Counts:
    """The FP32 gradient blocks (bytes, how many) a rank of ``stage`` keeps on the gradient-reduction
    stream until the optimizer step is done, one per unit (every layer, and the root: embedding, final
    norm and head; torchtitan's kept head, ``head`` parameters, a unit of its own): ``replicate``
    all-reduces each unit's gradients in an FP32 buffer allocated there, FSDP2 (ZeRO-2/3)
    reduce-scatters them into FP32 shards allocated there, and the gradients the optimizer reads are
    views of those blocks. None for DDP (its buckets are allocated once, at wrapping) or without
    data-parallel ranks. With expert parallelism a block's experts are a unit of their own, sharded
    over the dp·cp/ep ranks that hold them (harness/runner/parallel/data.py)."""
    replicate = _replicated(pp, shards, zero)
    if shards == 1 or not (replicate or zero >= 2):
        return ()
    per = 1 if replicate else shards
    root = non_layer_params(m, stage=stage, pp=pp, tp=tp) - head
    units: Counter[int] = Counter()
    for kind, layers in chunk_blocks(m, pp):  # dense first layers, then the expert blocks
        experts = layer_expert_params(kind, ep=ep, tp=tp) if ep > 1 else 0
        units[4 * -(-(layer_params(kind, tp=tp, ep=ep) - experts) // per)] += layers
        if experts:
            units[4 * -(-experts // (1 if replicate else shards // ep))] += layers
    for n in (root, head):
        if n:
            units[4 * -(-n // per)] += 1
    return counts(units)


def reduce_stream_segments(spec: RunSpec, stage: int) -> int:
    """What the blocks of :func:`_reduce_units` reserve: blocks are cached per stream
    (``get_pool``), so the compute stream's cache cannot serve them and each opens a segment of its
    own. Traced: Llama-2-13B tp 2 × pp 2 × dp 2 (``replicate``), twenty 605 MiB segments and one of
    314 MiB on stream 2, 11.8 GiB of the 14.9 GiB the replay reserved above the allocated peak;
    Llama-3-8B dp 8 ZeRO-3 (torchtitan's defaults), 32 segments of 106 MiB and two of 252 MiB."""
    m, p = spec.model, spec.parallel
    head = kept_head(m, p) if stage == p.pp - 1 else 0
    units = _reduce_units(m, p.tp, p.pp, stage, p.dp * p.cp, p.zero_stage, head, p.ep)
    return sum(c * block_size(n) for n, c in units)


def cached_blocks(spec: RunSpec, stage: int, terms: dict[str, int], *, working_set: bool = False) -> Counts:
    """The free blocks of the large pool when the optimizer step starts: the stage's activations as
    whole model chunks of :func:`layer_tensors` (as many as its ``activations`` term holds; under full
    recomputation of every N-th block the others keep every tensor: traced, Llama-2-13B tp 4 × pp 2,
    every 2nd block, a hundred 80 MiB and seventy-nine 54 MiB blocks at the peak, and the step's sixty
    68 MiB temporaries opened none of the 3.5 GiB the checkpointed inputs' sizes alone gave), each temporary
    buffer of the forward/backward peak, the compute-dtype parameter copies (``param_copies``: one
    block per parameter tensor), the recomputed blocks' SwiGLU working set where ``working_set``
    (:func:`~harness.estimate.loss_cache.recompute_working_set_segments` counts it free) and, where
    :func:`grads_freed_before_step`, the FP32 gradients (one block per parameter tensor)."""
    m, p, t = spec.model, spec.parallel, spec.train
    autocast = torch_autocast(p, t)
    layer = layer_blocks(m, p.tp, p.cp, p.sequence_parallel, autocast, t)
    covered, chunk = recomputed_layers(m, p, t), m.num_layers // (p.pp * p.virtual_stages)
    if t.recompute == "full" and 0 < covered < chunk:  # every N-th block: the others keep everything
        full = layer_blocks(
            m, p.tp, p.cp, p.sequence_parallel, autocast, dataclasses.replace(t, recompute="none")
        )
        layer = _chunk_of(layer, covered, full, chunk - covered)
    copies = round(terms.get("activations", 0) / max(1, layer[2]))
    whole = parameter_tensors(m, p.tp, p.pp, stage, 1, 0, p.ep)
    sets = 0  # compute-dtype copies: one per parameter tensor, as many sets as the term holds
    if terms.get("param_copies", 0):
        sets = max(1, round(terms["param_copies"] / max(1, 2 * sum(n * c for n, c in whole))))
    buffers = tuple(terms.get(k, 0) for k in CACHED_BUFFERS)
    if working_set:
        buffers += (swiglu_bytes(m, p, t),) * SWIGLU_WORKING_SET
    cache = _blocks(layer, copies, buffers, whole, grads_freed_before_step(p, t, stage), sets)
    # stage 0's whole embedding gradient each backward makes, where no cached block held it: its
    # segment is free at the step (``embedding_grad_segments``)
    made = whole_embedding_grad(spec, stage)
    if made and (not cache or made > cache[-1][0]):
        cache = counts({**dict(cache), block_size(made): dict(cache).get(block_size(made), 0) + 1})
    return cache


@lru_cache(maxsize=4096)
def _chunk_of(
    covered: tuple[Counts, int, int], n_covered: int, kept: tuple[Counts, int, int], n_kept: int
) -> tuple[Counts, int, int]:
    """One model chunk's blocks (as :func:`~harness.estimate.placement.layer_blocks` gives a layer's):
    ``n_covered`` blocks keeping their checkpointed input, ``n_kept`` keeping every tensor."""
    sizes: dict[int, int] = {}
    for (blocks, _, _), n in ((covered, n_covered), (kept, n_kept)):
        for size, c in blocks:
            sizes[size] = sizes.get(size, 0) + c * n
    shared = covered[1] * n_covered + kept[1] * n_kept
    return counts(sizes), shared, covered[2] * n_covered + kept[2] * n_kept


@lru_cache(maxsize=65536)
def _blocks(
    layer: tuple[Counts, int, int],
    copies: int,
    buffers: tuple[int, ...],
    whole: Counts,
    grads: bool,
    sets: int,
) -> Counts:
    layer_blocks, layer_shared, _ = layer
    blocks = {size: n * copies for size, n in layer_blocks}
    shared = layer_shared * copies
    if grads:
        blocks_of(whole, 4, 1, blocks)
    if sets:
        blocks_of(whole, 2, sets, blocks)
    for size in buffers:
        if size >= KMIN_LARGE_ALLOC:
            seg = segment_size(size)
            blocks[seg] = blocks.get(seg, 0) + 1
        elif size > KSMALL_SIZE:
            shared += size
    if shared:
        blocks[KLARGE_BUFFER] = blocks.get(KLARGE_BUFFER, 0) + -(-shared // KLARGE_BUFFER)
    return counts(blocks)


def blocks_of(tensors: Counts, elem: int, sets: int, blocks: dict[int, int]) -> None:
    """Add the blocks of ``sets`` copies of ``tensors`` (numel, how many) at ``elem`` bytes each."""
    for n, c in tensors:
        size = elem * n
        if size >= KMIN_LARGE_ALLOC:
            seg = segment_size(size)
            blocks[seg] = blocks.get(seg, 0) + c * sets
        elif size > KSMALL_SIZE:  # (one 20 MiB segment each: a bound, such parameters are rare)
            blocks[KLARGE_BUFFER] = blocks.get(KLARGE_BUFFER, 0) + c * sets


def step_temporaries(spec: RunSpec, stage: int) -> Counts:
    """The optimizer step's FP32 temporaries on one rank of ``stage``: one per parameter tensor it
    steps (:func:`parameter_tensors`), all alive together (``foreach`` returns them as one list)."""
    p = spec.parallel
    return fp32(parameter_tensors(spec.model, p.tp, p.pp, stage, p.dp * p.cp, p.zero_stage, p.ep))


FB_TERMS = ("activations", *CACHED_BUFFERS, "param_copies", "grad_reduce")


def mechanism_terms(spec: RunSpec, stage: int, terms: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """The mechanism terms fixed before the optimizer step, (name, bytes) in the order
    :func:`segment_terms` adds them: the gradient-reduction stream's segments
    (:func:`reduce_stream_segments`), FSDP2's root unit and embedding gradient
    (:func:`fsdp_root_segments`), the loss's cached logits (:func:`loss_logits_segment`),
    recomputation's packing and working set, the accumulated gradients' remainders, stage 0's whole
    embedding gradients and a pipeline's first backward (:mod:`harness.estimate.backward_cache`)."""
    return (
        ("reduce_stream", reduce_stream_segments(spec, stage)),
        ("fsdp_root", fsdp_root_segments(spec, stage) + fsdp_embedding_grad_segment(spec, stage)),
        ("loss_logits", loss_logits_segment(spec, stage)),
        ("recompute_packing", recompute_packing_segments(spec, stage) + op_packing_segments(spec, stage)),
        ("recompute_working_set", recompute_working_set_segments(spec, stage, terms)),
        ("grad_accumulation", accumulated_grad_segments(spec, stage)),
        ("embedding_grad", embedding_grad_segments(spec, stage, terms)),
        ("first_backward", first_backward_segments(spec, stage, terms)),
    )


def segment_terms(spec: RunSpec, stage: int, terms: dict[str, int]) -> dict[str, int]:
    """The reserved level's mechanism terms for one stage of the ``torch`` engine on a GPU (bytes). The
    reserved level they make is

        max(allocated peak, states + forward/backward terms + :func:`mechanism_terms`
            + step's new segments)

    the cache the forward/backward peak leaves on the compute stream, the terms fixed before the step,
    and the segments the optimizer step's temporaries open beyond that cache (:func:`cached_blocks`,
    :func:`step_temporaries`); added to the allocated peak in :func:`mechanism_terms`' order, the rest
    as ``optimizer_step_segments``, so that they sum to the difference."""
    fb = sum(terms.get(k, 0) for k in FB_TERMS)
    step = terms.get("optimizer_step", 0) + terms.get("step_grads", 0)
    in_order = mechanism_terms(spec, stage, terms)
    opened = 0
    if terms.get("optimizer_step", 0):  # 0 for megatron's fused Adam, which allocates none
        working = dict(in_order)["recompute_working_set"]
        cache = cached_blocks(spec, stage, terms, working_set=working > 0)
        opened = place(cache, step_temporaries(spec, stage))
    extra = max(0, fb + sum(v for _, v in in_order) + opened - max(fb, step))
    out = {}
    for name, value in in_order:
        out[name] = min(value, extra)
        extra -= out[name]
    return {**out, "optimizer_step_segments": extra}


def segment_terms_bound(spec: RunSpec, stage: int, terms: dict[str, int]) -> int:
    """An upper bound of the sum of :func:`segment_terms`: :func:`mechanism_terms` plus a segment of its
    own for every temporary of the optimizer step (at most 20 MiB above it)."""
    fixed = sum(v for _, v in mechanism_terms(spec, stage, terms))
    if not terms.get("optimizer_step", 0):
        return fixed
    # (from the temporaries, not the optimizer_step term: ZeRO-1 rounds its share up by whole tensors)
    return fixed + _segments_bound(step_temporaries(spec, stage))


@lru_cache(maxsize=4096)
def _segments_bound(requests: Counts) -> int:
    """At most what ``requests`` open: a segment each, at most 20 MiB above the request."""
    return sum(c * (n + KLARGE_BUFFER) for n, c in requests)
