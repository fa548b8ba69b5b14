"""The reserved level's blocks that are cached and free when the last stage's peak comes at the loss
(issue 32), each a term of :func:`harness.estimate.segments.segment_terms`: the loss's logits in the
compute dtype, FSDP2's outside units, under full recomputation the saved inputs packed into freed
SwiGLU blocks and the last block's SwiGLU working set, and under gradient accumulation the remainders
of the activation blocks the first backward's FP32 gradients split. Each read from a fake trace
replayed through harness/alloc at its allocated peak (docs/gpu-memory.md; scripts/segment_openings.py
prints them)."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from harness.estimate.activations import layer_input_bytes, op_kept_elements, vocab_shards
from harness.estimate.blocks import (
    KMIN_LARGE_ALLOC,
    KSMALL_SIZE,
    block_size,
    layer_tensors,
    request_size,
    segment_size,
)
from harness.estimate.buffers import kept_head
from harness.estimate.checkpoints import checkpointed_layers
from harness.estimate.dtypes import elem_bytes, torch_autocast
from harness.estimate.params import layer_expert_params, layer_params, non_layer_params
from harness.estimate.states import torch_grads_at_peak
from harness.spec import ModelSpec, ParallelSpec, RunSpec, TrainSpec


def loss_logits_segment(spec: RunSpec, stage: int) -> int:
    """The loss's logits blocks cached and free at the last stage's peak, in a compute dtype narrower
    than FP32 (the loss upcasts them; in FP32 the upcast is the logits themselves, whose block the FP32
    gradients reuse: 0 there). Under the chunked loss (``train.loss_chunks``) a slice's logits stay
    alive through its backward: 0 too. C is one block of logits in the compute dtype, e·s·b·v over the
    vocabulary's shards (:func:`~harness.estimate.activations.vocab_shards`).

    - Without a pipeline: the head's logits are freed before the loss's backward, whose peak allocates
      FP32 logit-sized buffers twice their size; their block stays cached and free (C). Traced
      (Llama-3-8B dp 8 ZeRO-3, s 8192, BF16, one rank's step replayed): a free 2,004 MiB segment at
      micro-batch 1 and 4,008 MiB at 2, under both FSDP2 policies.
    - Under a pipeline the schedule keeps the head's output (``activations.logits``). Under tensor
      parallelism the loss's copy of it gathered over tp is freed before the FP32 upcast: C free at
      every micro-batch's peak. Under 1F1B (at least two micro-batches: m >= pp) the last stage runs the next
      micro-batch's forward right after the previous backward, when the loss's blocks are cached and
      free; that forward's last tensors, short of blocks of their own (the first backward's gradients
      took some), carve the smallest free block that holds them, the loss's C blocks, and the next
      loss splits an FP32 block for its C tensor and opens a new FP32 block: 2·C more free at the
      peak under tensor parallelism (half the split block and the carved C block's rest), C without
      it (the new FP32 block holds the C tensor and the carving tensors; the C segment is left free).
      Traced (harness stack, BF16, s 8192, the last stage's rank replayed at its allocated peak,
      python scripts/segment_openings.py): Llama-3-8B tp 4 × pp 2 at micro-batch 4 (C 8,016 MiB),
      22.2 GiB above the allocated peak (2.8·C: a C segment, half a split FP32 block, a C block with
      1.4 GiB of the next forward's activations in it); Llama-3-70B tp 4 × pp 8 × dp 2 at micro-batch
      4 carves both C blocks and an FP32 one and opens two (32.5 GiB, 4.1·C: the second FP32 block
      left to calibration); Llama-3-8B tp 1 × pp 8 at micro-batch 4, 10.6 GiB (1.3·C: the C segment
      and two carved remainders). Interleaved 1F1B (other chunks' work between a micro-batch's
      forward and backward) leaves C only: 2.1 and 2.7 GiB at C 1.96 GiB on Llama-3-8B tp 2 and 4.
      Not traced in FP32 under a pipeline."""
    m, p, t = spec.model, spec.parallel, spec.train
    if stage != p.pp - 1 or elem_bytes(t.precision) >= 4 or t.loss_chunks > 1:
        return 0
    tokens_by_vocab = t.seq_len * t.micro_batch_size * m.vocab_size // vocab_shards(p, engine="torch")
    logits = block_size(elem_bytes(t.precision) * tokens_by_vocab)
    if p.pp == 1:
        return logits
    gathered = logits if p.tp > 1 else 0
    if p.pp_schedule != "1f1b":
        return gathered
    return gathered + (block_size(4 * tokens_by_vocab) if p.tp > 1 else logits)


def swiglu_bytes(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """One SwiGLU tensor of a dense block (gate, up, their activation or product) on one rank, s·b·f/(t·c)
    in the compute dtype: a block of its own."""
    return elem_bytes(t.precision) * t.seq_len * t.micro_batch_size * m.ffn_hidden_size // (p.tp * p.cp)


def recompute_packing_segments(spec: RunSpec, stage: int) -> int:
    """Full recomputation of every block: the bytes lost where the blocks' saved inputs are carved out
    of freed SwiGLU blocks. A checkpointed block's forward saves only its input (A, the residual
    stream: :func:`layer_tensors`) and frees its SwiGLU tensors (T = s·b·f/(t·c) each in the compute
    dtype, one segment each) at its end. The next block's input finds no free block of its size but
    those, and best fit splits one: k = ⌊T/A⌋ inputs fill a T block, whose remainder T − k·A is smaller
    than any later input (the next ones take the next freed T block, and the next block's MLP opens a
    new segment). The stage's first input is allocated before any T block exists, so ⌊(L − 1)/k⌋
    blocks each lose a remainder. Traced (Llama-3-8B dp 8 ZeRO-3, s 8192, BF16, torchtitan's stack,
    full recomputation; the allocated peak of one rank's replayed step): ten free remainders of 128,
    256 and 384 MiB at micro-batch 4, 8 and 12 (A 256-768 MiB in T 896-2,688 MiB, k 3); Llama-2-13B at
    micro-batch 6, eighteen of 336 MiB and one of 86 MiB where the engine says nineteen of 336 (k 2).
    0 without full recomputation of every block, under a pipeline (its stages' freed blocks hold every
    kind of tensor), for a mixture of experts, where T < A (k 0), and under tensor parallelism with
    sequence parallelism: there each block's largest transient is its gathered input (s·b·h/c), whose
    blocks the inputs fill instead (Llama-3-70B tp 8 × dp 8, micro-batch 4: seven 64 MiB inputs in
    each 512 MiB block, with split remainders; not modelled)."""
    m, p, t = spec.model, spec.parallel, spec.train
    if t.recompute != "full" or m.moe or p.pp > 1 or (p.tp > 1 and p.sequence_parallel):
        return 0
    layers = m.num_layers // p.virtual_stages
    if checkpointed_layers(m, p, t) < layers:
        return 0
    (saved,) = layer_tensors(m, p, t, autocast=torch_autocast(p, t))
    block, request, k = _packed_per_block(saved, swiglu_bytes(m, p, t))
    if k == 0:
        return 0
    return (layers - 1) // k * (block - k * request)


def _packed_per_block(kept: int, working: int) -> tuple[int, int, int]:
    """(block, request, k) of kept tensors of ``kept`` bytes carved out of freed SwiGLU blocks of
    ``working`` bytes: the block's segment, a kept tensor's request, and how many of them best fit puts
    in one block. k = 0 where either shares 20 MiB segments (not this mechanism) or a kept tensor is
    larger than the block."""
    if kept < KMIN_LARGE_ALLOC or working < KMIN_LARGE_ALLOC:
        return 0, 0, 0
    block, request = segment_size(working), request_size(kept)
    return block, request, block // request


# Under op recomputation, the last block's freed SwiGLU blocks still whole at the loss: three freed, one
# carved by w2's output and the block's output (recompute_working_set_segments).
OP_FREE_AT_LOSS = 2
# torchtitan's op policy keeps per block, besides w1's output (T), four tensors of the residual stream's
# size (w2's output, the block's output that the next checkpoint keeps as its input, wq's and the
# attention kernel's outputs) and wv's output (activations.op_layer_bytes).
OP_KEPT_RESIDUAL_SIZED = 4


def op_packing_segments(spec: RunSpec, stage: int) -> int:
    """Op-level recomputation (torchtitan's policy), the bytes lost where a block's kept tensors are
    carved out of the previous block's freed SwiGLU blocks: each block frees three of its four SwiGLU
    tensors (T = s·b·f/c, one segment each) and keeps w1's output, and the next block's kept tensors of
    the residual stream's size (A = s·b·h/c, :data:`OP_KEPT_RESIDUAL_SIZED` a block) and its V (wv's
    output, s·b·kv/c) find no free block of their size but those: best fit puts k = ⌊T/A⌋ A-sized
    tensors in a T block, and the V tensors in the remainders T − k·A that hold them. What no V fills
    is lost, and the block's own SwiGLU opens new T segments. Counted over the L − 1 blocks after the
    first (whose tensors come before any T block is free):

        lost = ⌈n·(L − 1)/k⌉ · (T − k·A) − min(L − 1, ⌈n·(L − 1)/k⌉ · ⌊(T − k·A)/V⌋) · V

    with n = 4, and n = 5 where V is as large as A (no grouped-query attention). Traced (torchtitan's
    stack, Llama-3-8B dp 8 ZeRO-3, s 8192, micro-batch 2, the loss's peak): forty T blocks, twenty-five
    holding three A and a free remainder, thirteen three A and two V, two three A and one V: 13·A =
    1,664 MiB lost, the rule 1,696 MiB. In the compute dtype only (not under autocast, whose
    input is FP32), without a pipeline (its stages' freed blocks hold every kind of tensor) or experts.
    Under tensor parallelism with sequence parallelism the kept tensors are of several sizes, and which
    blocks they take depends on their order: :func:`_op_packing_in_order`."""
    m, p, t = spec.model, spec.parallel, spec.train
    if t.recompute != "op" or m.moe or p.pp > 1 or torch_autocast(p, t):
        return 0
    if p.tp > 1:
        return _op_packing_in_order(m, p.tp, p.cp, t) if p.sequence_parallel else 0
    e = elem_bytes(t.precision)
    sb = t.seq_len * t.micro_batch_size // p.cp
    a, v = e * sb * m.hidden_size, e * sb * m.kv_width
    block, request, k = _packed_per_block(a, swiglu_bytes(m, p, t))
    if k == 0:
        return 0
    n = OP_KEPT_RESIDUAL_SIZED + (1 if v >= a else 0)
    blocks = -(-n * (m.num_layers - 1) // k)
    remainder = block - k * request
    vs = 0 if v >= a else min(m.num_layers - 1, blocks * (remainder // request_size(v)))
    return max(0, blocks * remainder - vs * request_size(v))


def op_kept_in_order(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> tuple[int, ...]:
    """The tensors a block keeps under op recomputation (bytes), in the order its forward allocates
    them: the save list's outputs (``activations.op_kept_elements``), then the block's output, which
    the next checkpoint keeps as its input. Those under 10 MiB share 20 MiB segments and are left out."""
    e = elem_bytes(t.precision)
    order = (*(e * n for n in op_kept_elements(m, p, t)), layer_input_bytes(m, p, t))
    return tuple(n for n in order if n >= KMIN_LARGE_ALLOC)


# Blocks of a block's largest transient size freed for the next block's forward: its other three SwiGLU
# tensors (w3's output, the activation, the product) where a SwiGLU tensor is the largest; else its two
# gathered inputs and wo's full-width partial sum (s·b·h/c each).
OP_FREED_LARGEST = 3


@lru_cache(maxsize=4096)
def _op_packing_in_order(m: ModelSpec, tp: int, cp: int, t: TrainSpec) -> int:
    """:func:`op_packing_segments` under tensor and sequence parallelism: the bytes left free where each
    block's kept tensors (:func:`op_kept_in_order`) are carved, in their order, out of the previous
    block's freed blocks of the largest transient size (the larger of T = s·b·f/(t·c) and the gathered
    input G = s·b·h/c: :data:`OP_FREED_LARGEST` a block) and out of the remainders earlier carvings
    left. Best fit takes the smallest remainder that holds a request before a whole block; a request
    that neither holds opens a segment of its own (nothing left over). Replayed block by block over the
    L − 1 blocks after the first: a layer's kept tensors are of up to four sizes, and a rule over their
    counts put them in the wrong blocks (the 70B's 56 MiB T two to a 128 MiB block, where the trace has
    one T and four 16 MiB tensors in each).

    Traced (torchtitan's stack, s 8192, BF16, the loss's peak): Llama-3-8B tp 2 × dp 4 ZeRO-3 at
    micro-batch 2 (T 224 MiB, kept 64 and 128 MiB): thirty-two T blocks holding three 64 MiB tensors
    and twenty-four holding a 64 and a 128, each 32 MiB free, 1.8 GiB (the rule 1.5 GiB, and two
    whole T blocks at the loss: the engine's reserved level 7.8 % → 3.7 % under); Llama-3-70B tp 8 ×
    dp 8 ZeRO-3 (G 128 MiB, T 56 MiB, kept 16 MiB): seventy-three 128 MiB blocks holding a T and
    four 16 MiB tensors, 8 MiB free each, and ten holding seven, about 0.9 GiB (the rule 0.6 GiB; the
    engine's level 5.9 % → 4.5 % under)."""
    p = ParallelSpec(tp=tp, cp=cp, sequence_parallel=True)
    e = elem_bytes(t.precision)
    largest = segment_size(
        max(swiglu_bytes(m, p, t), e * t.seq_len * t.micro_batch_size * m.hidden_size // cp)
    )
    requests = [request_size(n) for n in op_kept_in_order(m, p, t)]
    remainders: dict[int, int] = {}
    for _ in range(m.num_layers - 1):
        whole = OP_FREED_LARGEST
        for size in requests:
            fits = [r for r, n in remainders.items() if n and r >= size]
            if fits:
                block = min(fits)
                remainders[block] -= 1
            elif whole and size <= largest:
                block, whole = largest, whole - 1
            else:
                continue  # a segment of its own
            if block - size > KSMALL_SIZE:
                remainders[block - size] = remainders.get(block - size, 0) + 1
    return sum(r * n for r, n in remainders.items())


# The SwiGLU tensors alive at once in a checkpointed block's forward (gate and up; the gate's activation
# once the gate is freed; their product), each a block of its own. Traced: three free 896, 1,792 or
# 2,688 MiB blocks at the loss of Llama-3-8B dp 8 ZeRO-3 at micro-batch 4, 8 and 12 (below).
SWIGLU_WORKING_SET = 3


def recompute_working_set_segments(spec: RunSpec, stage: int, terms: dict[str, int]) -> int:
    """Full recomputation of every block (or op recomputation, below), the peak at the loss: the last block's
    SwiGLU working set (:data:`SWIGLU_WORKING_SET` blocks of T = s·b·f/(t·c),
    :func:`recompute_packing_segments`) is cached and free, since the loss's vocabulary-sized blocks are
    larger than T. Only the loss's requests that are smaller take from them: torchtitan's kept head unit's
    copy in the compute dtype (:func:`~harness.estimate.buffers.kept_head`) and the chunked loss's FP32
    head gradient, each into the smallest block that holds it. Read at the allocated peak of fake traces
    (torchtitan's stack, Llama-3-8B dp 8 ZeRO-3, s 8192, full recomputation): at micro-batch 4 three free
    896 MiB blocks (the 1,002 MiB copy does not fit), at 8 two of 1,792 MiB and 790 MiB beside the copy,
    at 12 one of 2,688 MiB, 1,686 beside the copy and 684 beside the 2,004 MiB gradient; cp 2 at
    micro-batch 4, three of 448 MiB; this runner's stack (unchunked) at micro-batch 4, three of 896 MiB. 0
    under the conditions of :func:`recompute_packing_segments`, where the peak is not at the loss (no
    ``loss`` term: Llama-2-13B at micro-batch 6 peaks in the last block's MLP, its working set in use),
    and where the loss's logits (per slice, in the compute dtype) fit a T block (the loss takes the
    blocks).

    Under op recomputation (:func:`op_packing_segments`, its conditions) :data:`OP_FREE_AT_LOSS` of the
    last block's three freed T blocks, the third carved by its kept tensors after the MLP (traced,
    Llama-3-8B dp 8 ZeRO-3, micro-batch 2, unchunked: two free 448 MiB blocks at the loss)."""
    m, p, t = spec.model, spec.parallel, spec.train
    full = recompute_packing_segments(spec, stage) > 0
    if not (full or op_packing_segments(spec, stage)) or not terms.get("loss", 0):
        return 0
    e = elem_bytes(t.precision)
    working = segment_size(swiglu_bytes(m, p, t))
    logits = e * t.seq_len * t.micro_batch_size * m.vocab_size // vocab_shards(p, engine="torch")
    if logits // t.loss_chunks <= working:
        return 0
    free = [working] * (SWIGLU_WORKING_SET if full else OP_FREE_AT_LOSS)
    head_grad = 4 * m.vocab_size * m.hidden_size // p.tp if t.loss_chunks > 1 else 0
    for size in (e * kept_head(m, p), head_grad):
        fits = [i for i, room in enumerate(free) if room >= size > 0]
        if fits:
            best = min(fits, key=lambda i: free[i])
            free[best] -= request_size(size)
    return sum(free)


def fsdp_embedding_grad_segment(spec: RunSpec, stage: int) -> int:
    """Stage 0 of a pipeline under FSDP2 (ZeRO-2/3, d·c > 1) with tensor parallelism, its gradients
    accumulated to the last micro-batch (``stage.fsdp_replicated_embedding_grad``): each micro-batch's
    embedding backward makes the whole v·h gradient in the compute dtype (DTensor has no
    vocabulary-sharded rule) before adding it to the accumulated FP32 one. The first micro-batch's block
    of it is freed, then carved by the next micro-batches' activations, so the next one opens a segment
    of its own after the allocated peak. Traced (torchtitan's stack, Llama-3-70B tp 8 × pp 4 × dp 2,
    s 8192, 8 micro-batches, stage 0): a 2,004 MiB segment opened at the second micro-batch's embedding
    backward, its first block holding twenty activations by then. 0 where the gradient is no larger
    than a layer's largest tensor (its blocks hold it), or where the peak comes before the first backward
    (both whole gradients come after it there: not traced under FSDP2)."""
    m, p, t = spec.model, spec.parallel, spec.train
    if stage != 0 or p.pp == 1 or p.tp == 1 or p.zero_stage < 2 or p.dp * p.cp == 1:
        return 0
    if torch_grads_at_peak(p, t, stage=0) != "accumulated":
        return 0
    whole = elem_bytes(t.precision) * m.vocab_size * m.hidden_size
    if whole <= max(layer_tensors(m, p, t, autocast=torch_autocast(p, t))):
        return 0
    return block_size(whole)


def fsdp_root_segments(spec: RunSpec, stage: int) -> int:
    """FSDP2 (ZeRO-3, d·c > 1), the last stage, whose peak is at the loss: the blocks of the units
    outside the layers (embedding, final norm, head) that are cached and free at that peak, and the
    segment their FP32 reduce-scatter input opens after it.

    - ``parallel.fsdp_reshard_after_forward=always``: one root unit, gathered for the forward's first
      and last operations and resharded: its all-gather output (one flat buffer in the compute dtype
      on the all-gather stream, whose blocks the compute stream cannot take) and the vocabulary
      matrices copied out of it (one block each) are free.
    - ``default`` (torchtitan's; no pipeline): the embedding a unit of its own, resharded after forward,
      and the final norm and head a unit kept unsharded to its backward (tied, the embedding is in it):
      both all-gather outputs on the all-gather stream (the head's, a norm larger, does not fit the
      embedding's segment when that is exactly a vocabulary matrix) and the embedding's copied-out
      matrix are free; the head's copy is alive (``buffers.kept_head``).
    - The FP32 reduce-scatter input of the root (``always``) or head (``default``) unit comes at the end
      of backward, when the loss's FP32 logit-sized blocks (4·s·b·v/(t·c)) are cached and free: a
      segment of its own only when it is larger than those.
    - Also cached on the all-gather stream at the loss: the largest of those units' all-gather input (its
      shard, copied into a flat buffer) and the last layer's all-gather output.

    Traced (Llama-3-8B, dp 8, s 8192, BF16, one rank's step replayed): ``always`` at micro-batch 1,
    2,006 MiB on stream 1, 2 × 1,002 MiB free at the loss and 4,010 MiB opened at the end of backward
    (the loss's 4,008 MiB blocks too small); at micro-batch 2 the same without the last (8,016 MiB
    blocks); ``default`` at micro-batch 2, 1,002 and 1,004 MiB on stream 1 and 1,002 MiB on stream 0;
    on stream 1 besides, a layer's 418 MiB all-gather output and the root's 252 MiB (``always``) or the
    head's 126 MiB (``default``) all-gather input, all free at the loss.
    Beside them the loss's own cached block (:func:`loss_logits_segment`)."""
    m, p, t = spec.model, spec.parallel, spec.train
    if p.zero_stage != 3 or p.dp * p.cp == 1 or stage != p.pp - 1:
        return 0
    e = elem_bytes(t.precision)
    vocab = m.vocab_size * m.hidden_size // p.tp
    if p.fsdp_reshard_after_forward == "always":
        root = non_layer_params(m, stage=stage, pp=p.pp, tp=p.tp)
        matrices = (stage == 0) + (not (m.tie_embeddings and p.pp == 1))
        gathered, copies, reduced = [e * root], [e * vocab] * matrices, 4 * root
        units = gathered
    elif p.fsdp_reshard_after_forward == "default" and p.pp == 1:
        head = kept_head(m, p)
        embedding = [] if m.tie_embeddings else [e * vocab]
        gathered = [*embedding, e * head]
        if embedding and block_size(e * head) <= block_size(e * vocab):
            gathered = embedding  # the head's all-gather output fits the embedding's freed block
        copies, reduced, units = embedding, 4 * head, [e * head]
    else:
        return 0
    # on the all-gather stream beside them: the largest unit's all-gather input (its shard, copied into
    # a flat buffer), and the last layer's all-gather output (its experts' too under expert parallelism)
    experts = layer_expert_params(m, ep=p.ep, tp=p.tp) if p.ep > 1 else 0
    layer = [e * (layer_params(m, tp=p.tp, ep=p.ep) - experts)] + ([e * experts] if experts else [])
    stream = [max(units) // (p.dp * p.cp), *layer]
    loss_blocks = 4 * t.seq_len * t.micro_batch_size * m.vocab_size // (p.tp * p.cp) // t.loss_chunks
    after = block_size(reduced) if reduced > loss_blocks else 0
    return sum(block_size(n) for n in gathered + copies + stream) + after


def accumulated_grad_segments(spec: RunSpec, stage: int) -> int:
    """Gradient accumulation (``torch_grads_at_peak``: "accumulated" or "kept_and_accumulated": FSDP2
    under ``train.grad_sync=last``, DDP under ``no_sync``, one data rank, a pipeline's stage past its
    first backward):
    the bytes left free at a later micro-batch's peak where the first backward's FP32 gradients were
    carved out of freed activation blocks. Each layer's FP32 gradient (4·n per matrix, n over t)
    is allocated in the first micro-batch's backward, when the cache holds the blocks of the layers'
    activations at their own sizes (``layer_tensors`` without recomputation: recomputed blocks make
    them again in backward); best fit takes the smallest block at least as large and splits off the
    remainder, which the next gradients may take. The next micro-batches' kept activations
    (``layer_tensors`` of the policy) take the blocks left, and the remainders where no exact block is
    left (best fit prefers the exact block). What no request refills is free at the peak.

    Traced (the paper grids' ``stack=harness``, s 8192, BF16; free bytes at the allocated peak in the
    segments that hold these gradients): Llama-3-70B tp 8 × dp 8 ZeRO-3, full recomputation, micro-batch
    1: 227 of 240 112 MiB gradients in 128 MiB gathered-input blocks and 138 of 160 32 MiB ones in
    56 MiB SwiGLU blocks, 6.04 GiB free (the rule 6.25 GiB); under cp 2 the 32 MiB ones fill 32 and
    64 MiB blocks exactly, 0.56 GiB free (the rule 0). Llama-2-13B dp 8 ZeRO-3 op at micro-batch 2: the
    270 MiB gradients split 432 MiB SwiGLU blocks whose remainders the next micro-batch's 160 MiB
    tensors refill. Over the 165 such layouts of the three grids the engine's reserved level went from
    median −2.2 % (5th percentile −7.4 %, worst −10.3 %) to −1.4 % (−4.2 %, −5.9 %); the largest
    over-prediction is +5.7 % before and after, and the one that moved most is Llama-2-13B dp 8 ZeRO-3
    op at micro-batch 2 (−3.6 % to +3.0 %: op recomputation's packing, :func:`op_packing_segments`,
    counts some of the same SwiGLU blocks). Under a pipeline (``replicate`` or no wrapper, one model
    chunk per stage) the first backward frees one micro-batch's activations of the stage's L/pp
    blocks, which its gradients split the same way, and 1F1B's next forwards refill: traced at 8
    blocks, Llama-2-13B tp 2 × pp 2, stage 0, 730 MiB free beside them, the rule 480 MiB; over the
    paper grids the engine's own reserved level went from median −1.8 % (p95 4.3 %, worst 6.1 %) to
    −1.5 % (3.8 %, 5.9 %) on the H100 grid. Tests: tests/runner/test_grad_accumulation_segments.py.
    0 under FSDP2 with a pipeline and under interleaving (not traced), for a mixture of experts, and
    where the gradients are reduced after every micro-batch."""
    m, p, t = spec.model, spec.parallel, spec.train
    grads = torch_grads_at_peak(p, t, stage=stage)
    if m.moe or grads not in ("accumulated", "kept_and_accumulated"):
        return 0
    if p.pp > 1 and (p.virtual_stages > 1 or (p.dp * p.cp > 1 and p.zero_stage >= 2)):
        return 0
    return _accumulated_grad_remainders(m, p.tp, p.cp, p.sequence_parallel, torch_autocast(p, t), t, p.pp)


@lru_cache(maxsize=4096)
def _accumulated_grad_remainders(
    m: ModelSpec, tp: int, cp: int, sp: bool, autocast: bool, t: TrainSpec, pp: int = 1
) -> int:
    """:func:`accumulated_grad_segments` over counts (``plan`` asks it of every candidate): written by
    hand rather than replaying harness/alloc, like :func:`_packed_per_block`."""
    p = ParallelSpec(tp=tp, cp=cp, sequence_parallel=sp)
    full = layer_tensors(m, p, dataclasses.replace(t, recompute="none"), autocast=autocast)
    kept = full if t.recompute == "none" else layer_tensors(m, p, t, autocast=autocast)
    h, layers = m.hidden_size, m.num_layers // pp
    matrices = (h * m.q_width, h * m.q_width, h * m.kv_width, h * m.kv_width, *(3 * (h * m.ffn_hidden_size,)))
    free = _by_size((segment_size(n) for n in full if n >= KMIN_LARGE_ALLOC), layers)
    remainders: dict[int, int] = {}
    grads = _by_size((request_size(4 * n // tp) for n in matrices if 4 * n // tp >= KMIN_LARGE_ALLOC), layers)
    activations = _by_size((request_size(n) for n in kept if n >= KMIN_LARGE_ALLOC), layers)
    # the gradients' remainders are tracked wherever they come from; an activation's only where it
    # refills a remainder (an activation block's own remainder is not this mechanism)
    for requests, from_activation_blocks in ((grads, True), (activations, False)):
        for size, count in sorted(requests.items(), reverse=True):
            while count:
                fits = [(b, 0) for b, n in free.items() if n and b >= size]
                fits += [(b, 1) for b, n in remainders.items() if n and b >= size]
                if not fits:
                    break  # a segment of its own: nothing left over
                block, is_remainder = min(fits)  # the exact (activation) block before a remainder
                pool = remainders if is_remainder else free
                # a block holds k requests in a row: its remainder is then the smallest that fits
                k = block // size
                used = min(pool[block], -(-count // k))
                pool[block] -= used
                served = min(count, used * k)
                count -= served
                if is_remainder or from_activation_blocks:
                    last = served - (used - 1) * k  # the last block may hold fewer
                    for left, n in ((block - k * size, used - 1), (block - last * size, 1)):
                        if left > KSMALL_SIZE and n:
                            remainders[left] = remainders.get(left, 0) + n
    return sum(b * n for b, n in remainders.items())


def _by_size(sizes, layers: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for size in sizes:
        out[size] = out.get(size, 0) + layers
    return out
