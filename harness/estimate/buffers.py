"""Temporary buffers: named terms with analytic sizes, the part of the peak that calibration fits.

ESTIMATOR.md §4. Each function returns the bytes of one kind of buffer alive at the rank's peak, so that
a fit reads "coefficient × named term". Sizes are per rank; see each docstring for what is counted.
"""

from __future__ import annotations

from harness.estimate import activations as act
from harness.estimate.dtypes import elem_bytes, torch_autocast
from harness.estimate.params import layer_params, non_layer_params, stage_params
from harness.spec import ModelSpec, ParallelSpec, TrainSpec


def fsdp_allgather(
    m: ModelSpec, *, stage: int, pp: int, tp: int, zero_stage: int, precision: str, engine: str, ep: int = 1
) -> int:
    """ZeRO-3 all-gather outputs alive at the peak, in the compute dtype.

    Without pipelining the peak is at the loss, when FSDP2 has resharded every layer and the root
    (embedding, final norm, head) after forward and backward has not yet gathered any of them: 0. The
    head's backward re-gathers the root only after the loss's buffers are freed
    (:func:`fsdp_root_regather`, added by :mod:`harness.estimate.core` where it is the larger). The
    last pipeline stage's peak is at the loss too: 0. An earlier stage's peak comes in a forward that
    follows other micro-batches' backward: its root and one layer unsharded, twice (the all-gather
    output and the parameters copied out of it; measured on stage 0 of small, pp 4, cp 2: 10.77 MiB
    of each). megatron (ZeRO-3 in general, prefetching the next layer and keeping the root): the
    current and the prefetched layer and the root, always."""
    if zero_stage < 3 or (engine == "torch" and stage == pp - 1):
        return 0
    e = elem_bytes(precision)
    root = non_layer_params(m, stage=stage, pp=pp, tp=tp)
    if engine == "torch":
        return 2 * e * (layer_params(m, tp=tp, ep=ep) + root)
    return e * (2 * layer_params(m, tp=tp, ep=ep) + root)


def kept_head(m: ModelSpec, p: ParallelSpec) -> int:
    """torch, ZeRO-3 with ``parallel.fsdp_reshard_after_forward=default`` (torchtitan's policy, no
    pipeline, canonical "default"): the final norm and the head are an FSDP2 unit of their own that is
    not resharded after forward (``torchtitan/distributed/fsdp.py``; tied, the embedding is in it), so
    their unsharded parameters stay from the head's forward to its backward: these parameters (one
    vocabulary matrix over its tp shards and the norm), in the compute dtype. 0 otherwise."""
    if p.zero_stage != 3 or p.fsdp_reshard_after_forward != "default":
        return 0
    return m.vocab_size * m.hidden_size // p.tp + m.hidden_size


def fsdp_root_regather(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, stage: int, gloo: bool = True) -> int:
    """torch, ZeRO-3: what the last stage holds beyond its activations when the head's backward
    re-gathers the root (FSDP2 resharded it after forward): the all-gather output and the unsharded
    parameters copied out of it (2 × the root in the compute dtype), beside the gradient of the head's
    output (s·b·v over its vocabulary shards). :mod:`harness.estimate.core` counts what this adds over
    the loss's own peak (logits + loss), which it exceeds when the local s·b is small against h —
    measured: +16.8 MiB on ``small`` with cp 2 (local s·b 256, h 256), the estimate +16.0.

    With the head a unit of its own (:func:`kept_head`, torchtitan's policy) the moment is the head
    unit's reduce-scatter, right after the head's backward. Traced (``run.mode=fake``, CUDA's kernels,
    Llama-3-8B cut to 2 layers, dp 8, sequence 2048, BF16; 7,480 MiB at the peak): the embedding
    regathered at backward's start (e·v·h/t), the head's unsharded gradient (e·v·h/t), the unit's
    reduce-scatter input (its FP32 gradients, padded) and output (the shard), and the next block's
    all-gather prefetched (e·layer); the head's own parameters are already resharded and the logits'
    gradient freed. Over gloo (``device=cpu``) the head's gradient measured otherwise (docs/stacks.md,
    "Known gaps"): the head kept and the logits' gradient, as before."""
    e = elem_bytes(t.precision)
    root = non_layer_params(m, stage=stage, pp=p.pp, tp=p.tp)
    grad_out = e * t.seq_len * t.micro_batch_size * m.vocab_size // act.vocab_shards(p, engine="torch")
    head = kept_head(m, p)
    if head and gloo:
        return e * head + grad_out
    if head:
        shards = p.dp * p.cp
        padded = -(-head // shards) * shards
        embedding = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size // p.tp
        return e * (embedding + head + layer_params(m, tp=p.tp, ep=p.ep)) + 4 * padded + 4 * padded // shards
    return 2 * e * root + grad_out


def fsdp_backward_end(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, stage: int, gloo: bool) -> int:
    """torch, ZeRO-3: what the last stage's rank holds beyond parameters and optimizer state at the end
    of backward, when FSDP2 reduces the root's gradients: every layer's sharded FP32 gradients, the
    root's reduce-scatter input — its unsharded gradients in the FP32 reduce dtype whatever the training
    precision, padded to d·c equal shards (``foreach_reduce`` writes the gradients straight into it) —
    and the root's unsharded gradients in the compute dtype, which it is copied from.

    Over NCCL the peak is the input's allocation: traced (``run.mode=fake``, CUDA's kernels, Llama-3-8B
    cut to 2 layers, dp 8, sequence 2048, BF16; 8,351 MiB): the layers' shards (not yet the root's),
    the input (4 B per root parameter) and both vocabulary matrices' BF16 gradients (the head's, made at
    backward's start and held for the root's reduction, and the embedding's). Counted before as every
    shard, the root's among them, and one vocabulary gradient: 6 % under there.

    Over gloo (``device=cpu``) the reduce-scatter also holds a whole copy of its input while it runs
    (``ProcessGroupGloo::_reduce_scatter_base`` clones it, then all-reduces the copy), and the peak is
    that copy's: every shard (4n/(d·c)), the input and its copy, and one vocabulary matrix's dense
    gradient, e·v·h/t. Found on ``medium`` (v 16,384, h 384, FP32) with full recomputation at dp 2 and
    dp 4 (issue 15: -14 % and -9.5 %): the measured peak less the states is 4n/d + 133.8 MiB at both; the
    input and gloo's copy, 2 × 4·root = 96 MiB, and e·v·h = 24 MiB account for 120, the rest being the
    rotary tables (1.5 MiB) and 12.4 MiB the tracker does not see, neither modelled. ``small``, BF16,
    ZeRO-3 on the CPU: 112.8 MiB measured, the engine 112.3. With the head a unit of its own
    (:func:`kept_head`) the root reduced last is the embedding alone."""
    e = elem_bytes(t.precision)
    n = stage_params(m, stage=stage, pp=p.pp, tp=p.tp)
    shards = p.dp * p.cp
    root = non_layer_params(m, stage=stage, pp=p.pp, tp=p.tp)
    if not gloo:
        if kept_head(m, p) and not m.tie_embeddings:  # the head unit was reduced after its backward
            root -= kept_head(m, p)
        padded = -(-root // shards) * shards
        return -(-4 * (n - root) // shards) + 4 * padded + e * root
    head_grad = 0
    if kept_head(m, p) and not m.tie_embeddings:
        # The head unit's reduce-scatter is not the root's; traced (small, FP32, dp 2): its unsharded FP32
        # gradient stays to the end of backward (FSDP2 reduces that unit in its final callback).
        root -= kept_head(m, p)
        head_grad = 4 * kept_head(m, p)
    padded = -(-root // shards) * shards
    dense = e * m.vocab_size * m.hidden_size // p.tp
    return -(-4 * n // shards) + 4 * padded * 2 + head_grad + dense


def grad_reduce(m: ModelSpec, *, tp: int, zero_stage: int, shards: int, engine: str) -> int:
    """ZeRO-2/3 reduce-scatter input: one layer's unsharded gradients in the FP32 reduce dtype.

    Megatron overlaps the reduce-scatter with backward. The runner's FSDP2 reduces only in the last
    micro-batch's backward, layer by layer as that layer's activations are freed, so its buffer is
    never alive at the peak (at the loss): 0 for torch."""
    if zero_stage < 2 or shards == 1 or engine == "torch":
        return 0
    return 4 * layer_params(m, tp=tp)


def optimizer_step(n: int, *, zero_stage: int, shards: int, engine: str, partition: int = 0) -> int:
    """A ``foreach`` AdamW step's intermediates: ``torch._foreach_sqrt(exp_avg_sq)`` allocates one FP32
    tensor per parameter of the (local) group; the other updates are in place. Megatron's fused Adam
    (apex/TE multi-tensor apply) allocates none. This happens after backward, when activations are gone,
    so :mod:`harness.estimate.core` takes it as a max against the forward/backward terms, not a sum."""
    if engine != "torch":
        return 0
    local = -(-n // shards) if zero_stage >= 1 else n
    if zero_stage == 1 and partition:  # ZeroRedundancyOptimizer's whole-tensor partition
        local = partition
    return 4 * local


def tp_allgather(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, autocast: bool = False) -> int:
    """Sequence parallelism's full-sequence buffer at a layer boundary (s·b·h/c in the compute dtype):
    the re-gathered input in Megatron's backward, and the gradient of the gathered input before its
    reduce-scatter in the runner's — FP32 under ``autocast``, whose residual stream is FP32
    (:func:`activations.layer_activation_bytes`; traced: an FP32 (t, s/t, h) all-gather in the 70B
    tp 8 × pp 8 backward). Zero without tp > 1 and SP."""
    if p.tp == 1 or not p.sequence_parallel:
        return 0
    e = 4 if autocast else elem_bytes(t.precision)
    return e * t.seq_len * t.micro_batch_size * m.hidden_size // p.cp


def cp_kv_allgather(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, engine: str = "megatron") -> int:
    """Context parallelism's gathered K and V of one layer (2·s·b·h·k/a/t in the compute dtype): the
    forward's all-gather output in Megatron, their gradients before the reduce-scatter in the runner's
    (whose forward copies are saved activations), with its boolean causal mask. Zero when cp = 1."""
    if p.cp == 1:
        return 0
    kv = elem_bytes(t.precision) * 2 * t.seq_len * t.micro_batch_size * m.kv_width // p.tp
    # torch: the boolean causal mask (s/c)·s, built once for the step (1 B per element).
    mask = (t.seq_len // p.cp) * t.seq_len if engine == "torch" else 0
    return kv + mask


def loss(m: ModelSpec, p: ParallelSpec, t: TrainSpec, *, stage: int, engine: str = "megatron") -> int:
    """The cross-entropy's FP32 logits (upcast or softmax) and their FP32 gradient on the last stage:
    2 × 4·s·b·v/(t·c) — often the single largest temporary (torch's loss_parallel under tp: 3 ×).
    torch under pipelining: the schedule computes each micro-batch's loss in its forward, so every
    in-flight micro-batch keeps its FP32 softmax (GPipe: all m) plus one gradient, over the gathered
    vocabulary."""
    if stage != p.pp - 1:
        return 0
    sbv4 = 4 * t.seq_len * t.micro_batch_size * m.vocab_size
    if engine == "torch" and p.pp > 1:
        return sbv4 * act.held_outputs(p, t, engine=engine) // act.vocab_shards(p, engine=engine)
    if engine == "torch" and p.tp > 1:
        # loss_parallel decomposes the vocabulary-sharded log-softmax into DTensor ops whose backward
        # holds three shards at once (measured: 3 × 8 MiB at the peak of a small tp 2 run, 2 × 8 MiB
        # in the fused single-rank loss).
        return 3 * sbv4 // (p.tp * p.cp)
    return 2 * sbv4 // (p.tp * p.cp)


def chunked_loss(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> tuple[int, int]:
    """(logits, loss) under ``train.loss_chunks`` = N > 1 (torchtitan's ``ChunkedLossWrapper``,
    ``runner/parallel/loss.py``) in place of :func:`harness.estimate.activations.logits` and
    :func:`loss`: the head and the loss run on 1/N of the rank's tokens at a time, each slice's
    backward at once, so the loss's chain exists for one slice of one micro-batch:

    - ``logits``: the slice's logits in the compute dtype, which the loop's variable keeps through
      the slice's backward (torchtitan's as this runner's), and the FP32 gradient of their upcast;
    - ``loss``: the slice's FP32 log-softmax and its gradient (8 B per logit; 12 under loss
      parallelism), and :func:`chunked_loss_hidden_grad`.

    Logits are vocabulary-sharded t·c ways (torchtitan's loss parallelism; this runner does not run
    the chunked loss under tp). What the head's gradient adds: :func:`chunked_loss_head`. Traced:
    ``python scripts/loss_chunks_traces.py`` (docs/stacks.md)."""
    n, e = t.loss_chunks, elem_bytes(t.precision)
    sbv = t.seq_len * t.micro_batch_size * m.vocab_size // (p.tp * p.cp)
    slice_logits = (4 + e) * sbv // n
    slice_loss = (12 if (p.tp > 1 and p.pp == 1) else 8) * sbv // n
    return slice_logits, slice_loss + chunked_loss_hidden_grad(m, p, t)


def chunked_loss_hidden_grad(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> int:
    """The chunked loss's gradient of the micro-batch's hidden states, which the slices fill: FP32,
    4·(s·b/c)·h (torchtitan's ``GradAccumulator``: whole on the tensor-parallel ranks). Under GPipe
    each other micro-batch's, kept for its backward: FP32 under autocast (the hidden states are: the
    residual stream and the norm's output), in the compute dtype under FSDP2's or replicate's BF16
    parameters (its hidden states are ``output_activations``)."""
    tokens_h = t.seq_len * t.micro_batch_size // p.cp * m.hidden_size
    others = t.num_microbatches - 1 if (p.pp > 1 and p.pp_schedule == "gpipe") else 0
    e = 4 if torch_autocast(p, t) else elem_bytes(t.precision)
    return 4 * tokens_h + others * e * tokens_h


def chunked_loss_head(m: ModelSpec, p: ParallelSpec, t: TrainSpec, grads: str, chain: int) -> int:
    """What the chunked loss holds beyond its slice's chain (``chain``: :func:`chunked_loss`'s logits
    and loss less the hidden states' gradient), counted in ``loss``: the head's gradient, which the
    slices make before the blocks' backward, and its reduction at the last slice. Traced
    (``run.mode=fake``, Llama-3-8B cut to 2 layers, s 8192, BF16, 8 slices; each peak read from the
    trace's allocations tagged with their module and operator):

    - the head's FP32 gradient v·h/t where nothing counts it yet (``grads`` none: one micro-batch,
      or kept shards under ``every_microbatch``): the slices' gradients accumulate in one unsharded
      FP32 copy;
    - under ZeRO-3 whose head is resharded after forward, its parameters gathered for the loop;
    - under FSDP2 (ZeRO-2/3, d·c > 1), the head unit's reduce-scatter at the last slice: its FP32
      input (padded), its output shard and the last slice's logits, still alive; where the engine
      counts the stage's gradients unsharded (``grads`` accumulated), also the shard earlier
      micro-batches' last slices made (the loss reduce-scatters the head every micro-batch, as
      torchtitan's does); under a pipeline from the third micro-batch on, the previous
      micro-batch's reduce-scatter input, which FSDP2 keeps until its next reduce-scatter (traced at
      4 micro-batches, freed at once after the first);
    - under ``replicate`` (a pipeline's ZeRO-0/1 over d·c > 1) with BF16 parameters, the slices'
      BF16 gradient, kept beside the FP32 copy until the stage's backward ends;
    - under autocast (no FSDP2 or replicate), the moment a slice's weight gradient is added to the
      head's: its BF16 gradient, its FP32 upcast, and the last slice's logits.
    """
    vocab = m.vocab_size * m.hidden_size // p.tp
    shards = p.dp * p.cp
    fsdp = p.zero_stage >= 2 and shards > 1
    acc = 4 * vocab if grads == "none" or (fsdp and grads == "kept") else 0
    e = elem_bytes(t.precision)
    logits = e * t.seq_len * t.micro_batch_size * m.vocab_size // (p.tp * p.cp) // t.loss_chunks
    if not fsdp:
        if grads == "kept_and_accumulated":
            # DDP leaves the head to be reduced by hand (runner/parallel/data.ddp_ignored): no bucket
            # beside its accumulated gradient (traced: dp 4 ZeRO-0, 2 micro-batches, 5.1 % over with one)
            acc = -4 * vocab
        if p.pp > 1 and shards > 1 and t.precision == "bf16":  # replicate
            return acc + 2 * vocab
        if torch_autocast(p, t):
            # the head's FP32 weight cast to BF16: a slice's BF16 weight gradient and its FP32 upcast
            # beside the gradient it is added to (traced: GPipe, pp 2, the peak at that upcast)
            return acc + max(chain, 4 * vocab + 2 * vocab + logits) - chain
        return acc
    padded = -(-vocab // shards) * shards
    # ZeRO-3 whose head is resharded after forward ("always", or any policy under a pipeline): the loop
    # gathers it and keeps it (traced: pp 2 × dp 4, 9.8 % under without it); ZeRO-2 and torchtitan's
    # "default" hold it already (param_copies, kept_head)
    if p.zero_stage == 3 and not kept_head(m, p):
        acc += e * vocab
    earlier = 4 * padded // shards if grads == "accumulated" and t.num_microbatches > 1 else 0
    held = 4 * padded if p.pp > 1 and t.num_microbatches >= 3 else 0
    reduce = 4 * padded + 4 * padded // shards + logits
    return acc + earlier + max(chain + held, reduce) - chain


def forward_end_loss_chain(m: ModelSpec, p: ParallelSpec, t: TrainSpec) -> tuple[int, int]:
    """(logits, loss) the last stage holds at the end of its forward without a pipeline — the loss
    computed, its backward not begun — where :func:`harness.estimate.activations.logits` and :func:`loss`
    count its backward's larger chain: the head's output in the compute dtype, the fused loss's FP32
    upcast and the FP32 log-softmax it saves (2 × 4 B per logit), vocabulary-sharded over c. Traced
    (``run.mode=fake``, Llama-3-8B, one rank per 8 on an H100, ZeRO-1, tp 1, s 2048, op): the forward
    end held 2 + 8 B per logit beside every weight's cast (the engine, with them, equal to the trace
    to 0.01 %). Only asked without tensor parallelism (``stage.forward_end``)."""
    sbv = t.seq_len * t.micro_batch_size * m.vocab_size // (p.tp * p.cp)
    return elem_bytes(t.precision) * sbv, 8 * sbv
