"""Communication volume, pipeline bubble and a step-time proxy, for ranking layouts that fit.

ESTIMATOR.md §8. Ring collectives move 2(n − 1)/n of the buffer for an all-reduce and (n − 1)/n for an
all-gather or reduce-scatter over n ranks. Axes are laid out innermost first: tp, cp, pp, dp; a group
whose ranks fit in one node uses the intra-node link, otherwise the inter-node one.

The step time here is a *ranking proxy*, not a prediction: compute at the device's peak, the bubble
added in full, and every collective serialised with compute (no overlap). It orders layouts by what
they cost; the measured TFLOP/s of a sweep are the real figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.estimate.dtypes import elem_bytes
from harness.estimate.flops import hardware_flops_per_step, model_flops_per_step
from harness.estimate.params import chunk_blocks, expert_layers, expert_params, stage_params
from harness.spec import ModelSpec, ParallelSpec, RunSpec, busiest_stage_view


@dataclass(frozen=True)
class Cost:
    """Per-device, per-step communication bytes by axis, the bubble fraction and the time proxy."""

    tp_bytes: float
    cp_bytes: float
    dp_bytes: float
    pp_bytes: float
    bubble: float
    compute_factor: float  # hardware over model FLOPs (recomputation) × (1 + bubble)
    step_time_s: float  # NaN when the device has no peak or link bandwidths
    ep_bytes: float = 0.0  # expert parallelism's all-to-alls (a mixture of experts)

    @property
    def comm_bytes(self) -> float:
        return self.tp_bytes + self.cp_bytes + self.dp_bytes + self.pp_bytes + self.ep_bytes


def bubble_fraction(spec: RunSpec) -> float:
    """Idle fraction of the pipeline relative to useful time: (p − 1)/m, divided by v when interleaved
    (Narayanan et al. 2021, §2.2)."""
    p = spec.parallel
    if p.pp == 1:
        return 0.0
    return (p.pp - 1) / (spec.train.num_microbatches * p.virtual_stages)


def tp_collectives(m: ModelSpec) -> int:
    """All-reduce-sized tensor-parallel collectives of one block per micro-batch, forward and backward, in
    units of the block's hidden states (s·b·h/c): 4 for a dense block; an expert block's attention 2,
    its experts 2·k (every tp rank runs every routed row), its shared experts 2."""
    if not m.moe:
        return 4
    return 2 + 2 * m.experts_per_token + (2 if m.num_shared_experts else 0)


def reduce_groups(m: ModelSpec, p: ParallelSpec, *, stage: int) -> list[tuple[int, int]]:
    """(parameters, ranks that reduce them) of one rank of ``stage``: with expert parallelism the rank's
    experts (1/ep of them) over the dp·cp/ep ranks that hold the same ones, the rest over dp·cp."""
    shards = p.dp * p.cp
    experts = expert_params(m, stage=stage, pp=p.pp, ep=p.ep, tp=p.tp)
    groups = [(stage_params(m, stage=stage, pp=p.pp, tp=p.tp, ep=p.ep) - experts, shards)]
    if experts:
        groups.append((experts, shards // p.ep))
    return groups


def cost(spec: RunSpec) -> Cost:
    """Communication and bubble of a canonical spec, and its step-time proxy on ``spec.device`` (of its
    busiest pipeline stage where ``parallel.pp_layers`` makes them uneven)."""
    spec = busiest_stage_view(spec)
    m, p, t, dev = spec.model, spec.parallel, spec.train, spec.device
    e = elem_bytes(t.precision)
    mb = t.num_microbatches
    layers = m.num_layers // p.pp
    sbh = t.seq_len // p.cp * t.micro_batch_size * m.hidden_size
    passes = 1.5 if t.recompute == "full" else 1.0  # recomputed forwards repeat their collectives
    # Tensor parallel: two all-reduce-sized collectives forward and two backward per layer; in an expert
    # block (harness/runner/parallel/tensor.py moe_plan) the MLP's two are each expert's output and its
    # input gradient over the k·T routed rows, and the shared experts' (a dense MLP's).
    units = sum(n * tp_collectives(kind) for kind, n in chunk_blocks(m, p.pp))
    tp_bytes = units * sbh * e * 2 * (p.tp - 1) / p.tp * mb * passes
    # Context parallel: all-gather K and V forward, reduce-scatter their gradients backward.
    kv = 2 * (t.seq_len // p.cp * t.micro_batch_size * m.kv_width) / p.tp * e
    cp_bytes = layers * kv * (p.cp - 1) * 2 * mb * passes
    # Data parallel over d·c ranks: gradient all-reduce (ZeRO 0/1), or FSDP's all-gathers and
    # reduce-scatter (ZeRO-2: one all-gather; ZeRO-3: forward and backward all-gathers).
    groups = reduce_groups(m, p, stage=0)
    gathers = 0 if p.zero_stage <= 1 else (1 if p.zero_stage == 2 else 2)
    dp_bytes = sum(
        (n_ - 1) / n_ * n * (2 * 4 if p.zero_stage <= 1 else gathers * e + 4) for n, n_ in groups if n_ > 1
    )
    # Expert parallelism: each MoE layer's routed rows (T·k of h) leave for their experts' ranks and come
    # back, forward and backward; (ep − 1)/ep of them cross the link with a balanced routing.
    ep_bytes = 0.0
    if m.num_experts and p.ep > 1:
        rows = t.seq_len // p.cp * t.micro_batch_size * m.experts_per_token
        moe_layers = expert_layers(m, p.pp)  # (dense first layers send nothing)
        ep_bytes = moe_layers * 4 * rows * m.hidden_size * e * (p.ep - 1) / p.ep * mb * passes
    # Pipeline: one activation forward and one gradient backward per micro-batch and boundary.
    sp = p.sequence_parallel and p.tp > 1
    pp_bytes = 0.0 if p.pp == 1 else 2 * mb * p.virtual_stages * sbh * e / (p.tp if sp else 1)
    bubble = bubble_fraction(spec)
    hardware = hardware_flops_per_step(spec)
    compute_factor = hardware / model_flops_per_step(spec) * (1 + bubble)

    step = math.nan
    if dev.peak_tflops and dev.intra_node_gbps and dev.inter_node_gbps:

        def link(group_span: int) -> float:
            gbps = dev.intra_node_gbps if group_span <= dev.gpus_per_node else dev.inter_node_gbps
            return gbps * 1e9

        compute = hardware / p.world / (dev.peak_tflops * 1e12) * (1 + bubble)
        step = (
            compute
            + tp_bytes / link(p.tp)
            + cp_bytes / link(p.tp * p.cp)
            + pp_bytes / link(p.tp * p.cp * p.pp)
            + dp_bytes / link(p.world)
            + ep_bytes / link(p.tp * p.ep)  # (an ep group: consecutive dp·cp ranks, tp innermost)
        )
    return Cost(tp_bytes, cp_bytes, dp_bytes, pp_bytes, bubble, compute_factor, step, ep_bytes)
