"""Model states per rank — weights, gradients, optimizer state — for the `megatron` and `torch` engines.

ESTIMATOR.md §2. ``n`` is the number of parameters on the rank after tensor and pipeline sharding
(:func:`harness.estimate.params.stage_params`); ``shards`` is the ZeRO sharding degree d·c: ZeRO and
FSDP shard over the data-parallel group *including* context parallelism (Megatron's distributed
optimizer does, and the runner's FSDP2 mesh is the flattened dp×cp mesh). Shards round up, as FSDP2
pads the first dimension to a multiple of the group size.
"""

from __future__ import annotations

from harness.estimate.activations import inflight_chunks
from harness.estimate.dtypes import elem_bytes
from harness.spec import ParallelSpec, TrainSpec


def _shard(n_bytes: int, shards: int) -> int:
    return -(-n_bytes // shards)


def megatron_states(
    n: int, *, zero_stage: int, shards: int, precision: str, sharded: int | None = None
) -> dict[str, int]:
    """Megatron-LM mixed precision: BF16 weights (2 B), FP32 main gradients (4 B), Adam with FP32 master
    weights and two FP32 moments (12 B) = 18 B per parameter; FP32 training keeps 4 + 4 + 8 = 16 B.

    ZeRO stage z shards, over d·c ranks, the optimizer state (z ≥ 1, Megatron's distributed optimizer:
    6 + 12/(d·c)), the gradients (z ≥ 2) and the weights (z = 3), as in Rajbhandari et al. 2019
    (arXiv 1910.02054, Fig. 1) with Megatron's byte counts. Megatron's own
    ``theoretical_memory_usage.py`` divides by d only, which overestimates when c > 1.

    With expert parallelism the rank holds 1/ep of the experts (``n``), and the distributed optimizer
    shards their states over the expert-data-parallel group, the d·c/ep ranks that hold the same
    experts (Megatron-Core ``parallel_state``: expert data parallel = world / (pp · ep · etp), with the
    expert tensor parallelism equal to tp): the rank's shard is the whole stage's count (``sharded``)
    / d·c, as for the ``torch`` engine. Taking ``n`` there read the experts' sharded states ep times
    too small.
    """
    w, g, o = (2, 4, 12) if precision == "bf16" else (4, 4, 8)
    s = n if sharded is None else sharded
    return {
        "params": _shard(w * s, shards) if zero_stage >= 3 else w * n,
        "grads": _shard(g * s, shards) if zero_stage >= 2 else g * n,
        "optimizer": _shard(o * s, shards) if zero_stage >= 1 else o * n,
    }


def torch_states(
    n: int, *, zero_stage: int, shards: int, precision: str, partition: int = 0, sharded: int | None = None
) -> dict[str, int]:
    """What the runner's PyTorch code keeps, for any precision: FP32 parameters (AdamW updates them in
    place), FP32 gradients, AdamW's two FP32 moments ``exp_avg`` and ``exp_avg_sq`` (8 B).

    - ZeRO-0: DDP, everything replicated (4 + 4 + 8 = 16 B per parameter); BF16 runs under autocast,
      whose cast copies are the ``param_copies`` term, not a state.
    - ZeRO-1: DDP + ``ZeroRedundancyOptimizer``: the 8 B of AdamW state sharded by whole parameter
      tensors, greedily, largest first; ``partition`` is the most-loaded rank's elements
      (:func:`params.zero1_partitions`; measured: an 8-way split of ``tiny`` left one rank the
      embedding, 2.3 times its even share).
    - ZeRO-2: FSDP2 ``fully_shard(reshard_after_forward=False)``: sharded FP32 parameters, FP32 sharded
      gradients (``reduce_dtype=float32``), sharded optimizer state; the unsharded compute copy lives
      from forward to backward (``param_copies``).
    - ZeRO-3: FSDP2 ``fully_shard(reshard_after_forward=True)``: as ZeRO-2 but only the current and the
      prefetched layer are unsharded at once (``fsdp_allgather``, a temporary).
    - One data-parallel rank (d·c = 1): the runner wraps nothing, whatever the ZeRO stage
      (:mod:`harness.estimate.core` passes stage 0).

    These are the gradients at the optimizer step; which of them exist at the forward/backward peak is
    :func:`torch_grads_at_peak`'s question.
    """
    del precision  # FP32 master parameters and states in both modes; the compute dtype is elsewhere
    fsdp = zero_stage >= 2
    # With expert parallelism the rank holds 1/ep of the experts (``n``) and shards them over the
    # dp·cp/ep ranks that hold the same ones: its shard is the whole stage's count (``sharded``) / dp·cp.
    s = n if sharded is None else sharded
    return {
        "params": _shard(4 * s, shards) if fsdp else 4 * n,
        "grads": _shard(4 * s, shards) if fsdp else 4 * n,
        "optimizer": 8 * (partition if zero_stage == 1 and partition else _shard(s, shards))
        if zero_stage >= 1
        else 8 * n,
    }


def param_copies(
    n: int, *, zero_stage: int, precision: str, engine: str, replicate: bool = False, uncast: int = 0
) -> int:
    """Compute-dtype copies of the whole stage's parameters that live through forward and backward.

    torch engine: under BF16 autocast (ZeRO-0/1) every weight's BF16 cast is saved for backward by its
    matmul, so at the start of backward all of them are alive (2 B per parameter); under FSDP2 without
    resharding after forward (ZeRO-2), and under ``replicate`` (the runner's data parallelism for
    pipeline stages: FSDP2's machinery over a group that shards nothing), the unsharded parameters in
    the compute dtype stay until backward (measured: a pipeline stage with dp 2 held its FP32 weights
    twice). Megatron keeps BF16 weights as the state itself and has no such copies.

    ``uncast``: parameters autocast never casts — the embedding (``embedding`` is on neither
    autocast list; it runs on the FP32 weight), unless the head shares it. Traced (``run.mode=fake``,
    Llama-3-70B, tp 8 × pp 8, stage 0): the BF16 copies alive are the layers' weights only; on a
    real CPU run (tiny, tp 2 × pp 2, BF16) doubling the vocabulary raised rank 0's peak by 7.0 MiB,
    with no BF16 copy of the embedding in it.
    """
    if engine != "torch":
        return 0
    if zero_stage == 2 or (replicate and zero_stage <= 1):
        return elem_bytes(precision) * n
    if zero_stage <= 1 and precision == "bf16":
        return 2 * (n - uncast)
    return 0


def torch_grads_at_peak(p: ParallelSpec, t: TrainSpec, *, stage: int) -> str:
    """Whether the runner's gradients exist at the forward/backward peak of ``stage``'s rank.

    The runner ends every step with ``zero_grad(set_to_none=True)``, so gradients exist from their
    first backward to the optimizer step:

    - ``"kept"``: DDP (d·c > 1, ZeRO 0/1, no pipeline) keeps its gradient buckets for good (the
      gradients are views of them).
    - ``"kept_and_accumulated"``: the same with gradient accumulation (m > 1): under ``no_sync`` DDP's
      reducer does not touch the gradients, so autograd accumulates them in tensors of their own
      (the step began with them set to None) beside the buckets, until the last micro-batch's
      backward copies them in: a second FP32 copy at the last micro-batch's peak (issue 15: ZeRO-0/1
      at dp 2 and 4 with 3 micro-batches were 6-13 % under, by 4 B per parameter).
    - ``"accumulated"``: the peak micro-batch follows a backward on this rank, which made them:
      gradient accumulation (m > 1), and pipeline stages whose in-flight micro-batches are fewer than
      their micro-batches (1F1B's last stage from its second micro-batch on; never GPipe, whose
      forwards all come first). FSDP2 accumulates them unsharded, in FP32 (its reduce dtype).
    - ``"kept"`` also under ``train.grad_sync=every_microbatch`` with accumulation (no pipeline).
    - ``"none"``: the peak (at the loss of the only micro-batch, or at the end of a pipeline's warm-up)
      comes before any backward; the gradients are a term of the optimizer step only. Measured on the
      CPU study: a single rank's and FSDP's peak hold no gradients.
    """
    shards = p.dp * p.cp
    if shards > 1 and p.pp == 1 and t.num_microbatches > 1 and t.grad_sync == "every_microbatch":
        # Reduced after each micro-batch: DDP's buckets (the gradients are views of them) take every
        # micro-batch's all-reduce and nothing accumulates beside them; FSDP2 reduce-scatters each
        # micro-batch's gradients and accumulates the FP32 shard. Either way a later micro-batch's
        # peak holds the states' own gradients and no unsharded copy.
        return "kept"
    if shards > 1 and p.zero_stage <= 1 and p.pp == 1:
        return "kept_and_accumulated" if t.num_microbatches > 1 else "kept"
    if p.pp == 1:
        return "accumulated" if t.num_microbatches > 1 else "none"
    if p.pp_schedule == "gpipe":
        return "none"
    chunks = t.num_microbatches * p.virtual_stages
    return "accumulated" if chunks > inflight_chunks(p, t, stage=stage) else "none"


def rotary_tables(layers: int, *, seq_len: int, cp: int, head_dim: int) -> int:
    """The runner's rotary tables, kept for the whole step (torch engine; counted with ``params``):
    every attention module registers its own FP32 cos and sin rows (harness/runner/model.py
    ``Attention``: (s/c) × head_dim each, its context-parallel rows), 8·(s/c)·head_dim bytes per layer
    on the rank. torchtitan keeps one ``freqs_cis`` for the model instead (docs/stacks.md).

    Found on real CPU runs: the study peaks held four 96 KiB tables on a two-layer stage (``small3``,
    s 768, BF16, pp 3) that no term counted; with them the worst rank's median error fell from 0.35 to
    0.13 % on the second (FP32) study and from 0.78 to 0.17 % on the BF16 study. Llama-3-70B at s 8192
    without a pipeline: 80 × 8 MiB."""
    return layers * 2 * 4 * (seq_len // cp) * head_dim
