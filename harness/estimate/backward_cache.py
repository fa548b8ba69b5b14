"""The reserved level's mechanism terms of a pipeline stage's backwards (issue 32): gradients made after
the forward/backward cache was built, placed by the allocator's rules into the blocks freed by then.

Found by replaying fake traces of the paper's grids (docs/gpu-memory.md), one term each:

- ``first_backward``: a stage whose peak comes before any backward (``states.torch_grads_at_peak``
  "none": 1F1B's warm-up, GPipe's forwards) makes its FP32 gradients in the first backward, when the
  only blocks freed are one micro-batch's activations at their own sizes. A gradient larger than those
  opens a segment, and the freed blocks it could not take stay cached.
- ``embedding_grad``: stage 0 without a data-parallel wrapper makes the whole embedding gradient in
  every backward (DTensor has no vocabulary-sharded ``embedding_dense_backward``); the accumulated one
  and each later backward's open a segment each where no cached block is as large.
"""

from __future__ import annotations

from harness.estimate.blocks import KLARGE_BUFFER, block_size, layer_tensors
from harness.estimate.dtypes import elem_bytes, torch_autocast
from harness.estimate.placement import counts, fp32, layer_blocks, parameter_tensors, place
from harness.estimate.states import torch_grads_at_peak
from harness.spec import RunSpec

# Temporary buffers of the forward/backward peak (the terms of harness.estimate.stage), each taken as
# one cached block by the step's placement (``segments.cached_blocks``; ``pp_p2p`` is in truth several).
CACHED_BUFFERS = (
    "token_ids",
    "output_activations",
    "logits",
    "loss",
    "fsdp_allgather",
    "tp_allgather",
    "pp_p2p",
    "cp_kv_allgather",
)

# Buffers that are one block each (``pp_p2p`` is every in-flight micro-batch's, several blocks).
ONE_BLOCK_BUFFERS = ("logits", "loss", "fsdp_allgather", "tp_allgather", "cp_kv_allgather")


def whole_embedding_grad(spec: RunSpec, stage: int) -> int:
    """Bytes of the whole embedding gradient each backward of stage 0 makes and frees after adding it
    to the accumulated one, where nothing wraps the stage (d·c = 1, pipelined, m > 1); else 0."""
    m, p, t = spec.model, spec.parallel, spec.train
    if stage != 0 or p.pp == 1 or p.dp * p.cp > 1 or t.num_microbatches < 2:
        return 0
    return (4 if torch_autocast(p, t) else elem_bytes(t.precision)) * m.vocab_size * m.hidden_size


def embedding_grad_segments(spec: RunSpec, stage: int, terms: dict[str, int]) -> int:
    """Stage 0 of a pipeline with one data-parallel rank and gradient accumulation: the segments of the
    whole embedding gradients (``peaks.replicated_embedding_grad``: v·h on every tp rank, in the
    parameters' dtype). The first backward's becomes ``.grad`` and stays to the step; each later
    backward makes a new one, adds it and frees it, and its block serves the next. Both come after the
    forward/backward cache was built, whose blocks are a layer's tensors and the buffers (``pp_p2p``
    is several blocks, each smaller): where the gradient is larger than every one, each opens a
    segment of its own (two; one where the peak holds the accumulated one, ``grads``). The free one
    takes step temporaries (``segments.cached_blocks``). Traced (``run.mode=fake``, stage 0, 8
    micro-batches): Llama-3-70B tp 8 × pp 8, two 4,008 MiB segments, the replayed reserved level
    92.73 → 100.55 GiB; Llama-2-13B tp 4 × pp 2 interleaved (v 2), three 625 MiB segments (the term
    one beyond the accumulated one its peak holds). Where a later forward or backward carves
    the free block (1F1B's steady state, gradients larger than the freed activations), the next
    backward opens a third or more: not counted. Nor what the second backward's candidate already
    holds (``grad_reduce``)."""
    made = whole_embedding_grad(spec, stage)
    if not made:
        return 0
    m, p, t = spec.model, spec.parallel, spec.train
    largest = max(layer_tensors(m, p, t, autocast=torch_autocast(p, t)))
    if made <= max(largest, *(terms.get(k, 0) for k in ONE_BLOCK_BUFFERS)):
        return 0
    opened = 1 + (torch_grads_at_peak(p, t, stage=stage) == "none")
    return max(0, opened * block_size(made) - terms.get("grad_reduce", 0))


def first_backward_segments(spec: RunSpec, stage: int, terms: dict[str, int]) -> int:
    """A pipeline stage whose peak comes before any backward (``torch_grads_at_peak`` "none"), without
    recomputation, under ``replicate`` or no wrapper: the segments its first backward's gradients open.
    That backward makes every FP32 gradient of the stage (one per parameter tensor; at stage 0 under
    ``replicate`` the whole embedding gradient in FP32, and in BF16 the compute-dtype one each backward
    makes, ``peaks.replicated_embedding_grad``) while the only blocks freed are one micro-batch's saved
    tensors (``layer_tensors`` of the stage's layers). A gradient no freed block holds (best fit,
    remainders split off) opens a segment, and the level the warm-up's cache reached stays: the
    reserved level rises by what opens, less what the first backward's candidate already adds to the
    allocated peak (``grad_reduce``). Traced (``run.mode=fake``, the H100 grid, stage 0, 8 micro-batches):
    Llama-2-70B tp 4 × pp 8 × dp 2 (``replicate``): thirty 224 MiB FP32 SwiGLU gradients open a segment
    each beside 128 and 112 MiB freed blocks, and the whole embedding gradients 1,000 and 500 MiB: the
    replayed reserved level 92.85 → 104.43 GiB through that backward, the allocated 92.04 → 96.49. Not
    counted: what the backward's own working set takes of the freed blocks, interleaved schedules (a
    backward makes one chunk's gradients), recomputation (the freed blocks are recomputed ones),
    FSDP2 (it reduce-scatters on its own stream) and a mixture of experts."""
    m, p, t = spec.model, spec.parallel, spec.train
    fsdp = p.zero_stage >= 2 and p.dp * p.cp > 1
    if p.pp == 1 or fsdp or m.moe or p.virtual_stages > 1 or t.recompute != "none":
        return 0
    if torch_grads_at_peak(p, t, stage=stage) != "none":
        return 0
    autocast = torch_autocast(p, t)
    per_layer, shared, _ = layer_blocks(m, p.tp, p.cp, p.sequence_parallel, autocast, t)
    layers = m.num_layers // p.pp
    freed = {size: n * layers for size, n in per_layer}
    if shared:
        freed[KLARGE_BUFFER] = freed.get(KLARGE_BUFFER, 0) + -(-shared * layers // KLARGE_BUFFER)
    grads = dict(fp32(parameter_tensors(m, p.tp, p.pp, stage, 1, 0, p.ep)))
    if stage == 0:  # the embedding's: whole (replicate), or ``embedding_grad``'s (no wrapper)
        shard = 4 * (m.vocab_size * m.hidden_size // p.tp)
        grads[shard] -= 1
        if p.dp * p.cp > 1:
            whole = m.vocab_size * m.hidden_size
            grads[4 * whole] = grads.get(4 * whole, 0) + 1
            if t.precision == "bf16":
                grads[2 * whole] = grads.get(2 * whole, 0) + 1
    opened = place(counts(freed), counts(grads))
    return max(0, opened - terms.get("grad_reduce", 0))
