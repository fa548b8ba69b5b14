"""A step-time model with named terms, for ranking layouts by speed: each term is seconds of one kind of
work on one device, and a calibration profile fits one non-negative coefficient per term (issue 17).

ESTIMATOR.md §7–§8. Every term is a count of work over the rate the device preset gives for it:

- ``compute``: the worst pipeline stage's model FLOPs on one rank over the peak (Megatron's count, §7);
- ``recompute``: the FLOPs recomputation adds (a layer's forward again, or the attention core's);
- ``bubble``: the pipeline's idle time, (p − 1)/(m·v) of the stage's compute (Narayanan et al. 2021);
- ``memory``: the bytes elementwise work moves over memory bandwidth (each layer's saved activations
  written forward and read backward, the logits three times), in the compute dtype;
- ``overhead``: a fixed cost per layer pass (operator launches, Python), counted in milliseconds.
  With ``memory`` it is how efficiency depends on the GEMM shapes per rank: per FLOP, both grow as
  the shapes shrink (h/tp narrower: more activation bytes per FLOP; fewer tokens per micro-batch: more
  passes per FLOP), so a fit reads "compute x 1.3 + overhead x 0.04" rather than one efficiency.
  The peak is the preset's dense BF16 one; an FP32 study fits its own compute coefficient;
- ``optimizer``: AdamW's update over the rank's (sharded) parameters, 7 fp32 tensors of traffic;
- ``tp``/``tp_sp`` (without/with sequence parallelism: all-reduces vs all-gather + reduce-scatter
  pairs), ``cp``, ``pp``: each axis's bytes per device over its link (intra- or inter-node by whether
  the group spans nodes), on the critical path (Megatron's tensor-parallel collectives are);
- ``dp_replicated`` (ZeRO 0/1: DDP's bucketed all-reduce, overlapped with backward) and
  ``dp_sharded`` (ZeRO 2/3: FSDP's prefetched all-gathers and reduce-scatters): kept apart so that the
  fit learns how much of each family's traffic stays exposed (a coefficient below the others: hidden);
- ``ep``: expert parallelism's all-to-alls (each expert block's routed rows to their experts' ranks and
  back, forward and backward: ``comm.cost``'s ``ep_bytes``) over the ep group's link;
- ``tp_latency``, ``cp_latency``, ``pp_latency``, ``dp_latency``, ``ep_latency``: ring steps (n − 1 per
  collective over n ranks, 2(n − 1) per all-reduce, n − 1 per all-to-all, 1 per point-to-point send)
  times the link's latency per step (``link_latency_us`` inside a node, ``inter_node_latency_us`` for a
  group that spans nodes).

Where a preset lacks a figure (the CPU preset has none) the term is in that figure's unit (1 TFLOP/s,
1 GB/s, 1 µs) and the fitted coefficient carries the device's rate. A device may host several ranks
(:func:`sharing`: on the CPU every rank shares the machine's cores), and then its terms add up the
work of every rank on it. No fitted numbers here: :class:`StepTimeModel` holds a profile's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.estimate.activations import layer_activation_bytes
from harness.estimate.checkpoints import recomputed_layers
from harness.estimate.comm import bubble_fraction, cost, reduce_groups, tp_collectives
from harness.estimate.dtypes import elem_bytes
from harness.estimate.flops import mlp_flops_per_token, model_flops_per_step
from harness.estimate.params import chunk_blocks, expert_layers, stage_params
from harness.spec import DeviceSpec, RunSpec, busiest_stage_view

TERMS = (
    "compute",
    "recompute",
    "bubble",
    "memory",
    "overhead",
    "optimizer",
    "tp",
    "tp_sp",
    "cp",
    "pp",
    "dp_replicated",
    "dp_sharded",
    "ep",
    "tp_latency",
    "cp_latency",
    "pp_latency",
    "dp_latency",
    "ep_latency",
)
# Terms added after profiles were first committed: a stored profile without them loads with them unfitted.
ADDED_TERMS = ("ep", "ep_latency")
# The rate each term divides by, as the profile prints it; a preset without the figure uses the unit.
_FLOPS, _MEMORY = "peak TFLOP/s; CPU: 1 TFLOP/s a core", "memory GB/s; CPU: 1 GB/s a core"
_LINK, _LATENCY = "link GB/s; CPU: 1 GB/s", "µs per ring step; CPU: 1 µs"
UNITS = {
    "compute": _FLOPS,
    "recompute": _FLOPS,
    "bubble": _FLOPS,
    "memory": _MEMORY,
    "overhead": "1 ms per layer pass",
    "optimizer": _MEMORY,
    **{k: _LINK for k in ("tp", "tp_sp", "cp", "pp", "dp_replicated", "dp_sharded", "ep")},
    **{k: _LATENCY for k in ("tp_latency", "cp_latency", "pp_latency", "dp_latency", "ep_latency")},
}
OPTIMIZER_BYTES_PER_PARAM = 28  # AdamW in fp32: read param, grad, m, v; write param, m, v
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb
LOGIT_PASSES = 3  # logits written, read by the loss (softmax), their gradient written


def sharing(spec: RunSpec, *, cpu_cores: int | None = None) -> float:
    """How many devices' worth of work one device does for its ranks: 1 on a GPU (a rank per device).

    On the CPU every rank of the world runs on one machine of ``cpu_cores`` cores (the runner gives
    each rank cores // ranks threads, at least one), so the machine does the work of all of them:
    world / cores, and each term is in seconds of one core (a term's coefficient, the core's rate).
    Checked on the CPU study against treating a lone rank's Python overhead as unshared by its two
    threads (max(1, world / cores) for serial work): that held out worse (median APE over every timed
    run, held out by world size: 15.6 % vs 13.4 %; Spearman median 0.78 vs 0.87).
    Without ``cpu_cores`` the world is taken as one rank per core."""
    if spec.device.name != "cpu":
        return 1.0
    return spec.parallel.world / (cpu_cores or spec.parallel.world)


def device_rates(dev: DeviceSpec) -> dict[str, float]:
    """The preset's figures in base units (FLOP/s, B/s, s), each 1 of its unit where the preset has none."""
    return {
        "flops": (dev.peak_tflops or 1.0) * 1e12,
        "memory": (dev.memory_gbps or 1.0) * 1e9,
        "intra": (dev.intra_node_gbps or 1.0) * 1e9,
        "inter": (dev.inter_node_gbps or 1.0) * 1e9,
        "latency": (dev.link_latency_us or 1.0) * 1e-6,
        "inter_latency": (dev.inter_node_latency_us or dev.link_latency_us or 1.0) * 1e-6,
    }


def stage_flops(spec: RunSpec) -> tuple[float, float]:
    """(model FLOPs, FLOPs recomputation adds) of one step on one rank of the last pipeline stage (the
    one that also runs the LM head, so the slowest; with uneven ``pp_layers``, with the most blocks of any
    stage), from Megatron's count split by layer and head."""
    spec = busiest_stage_view(spec)
    m, p, t = spec.model, spec.parallel, spec.train
    tokens = t.num_microbatches * t.micro_batch_size * t.seq_len // p.cp  # this rank's, per step
    # per token: the attention's matrices and core, and each block's MLP (a mixture of experts' active
    # parameters: harness/estimate/flops.mlp_flops_per_token; dense first layers a SwiGLU's)
    attention = 12 * m.hidden_size * (m.q_width + m.kv_width) + 12 * t.seq_len * m.hidden_size
    blocks = [(attention + mlp_flops_per_token(kind)) / p.tp * n for kind, n in chunk_blocks(m, p.pp)]
    layers = m.num_layers // p.pp
    per_layer = sum(blocks) / layers
    head = 6 * m.hidden_size * m.vocab_size / p.tp
    model = tokens * (sum(blocks) + head)
    extra = 0.0
    if t.recompute == "full":  # the forward again, of the blocks some checkpoint covers
        covered = recomputed_layers(m, p, t) * p.virtual_stages
        extra = tokens * covered * per_layer / 3
    elif t.recompute == "op":
        extra = tokens * layers * per_layer / 3  # every block's forward again, less what the policy saved
    elif t.recompute == "selective":
        extra = tokens * layers * 4 * t.seq_len * m.hidden_size / p.tp  # the attention core's forward
    return model, extra


def _dp_collectives(spec: RunSpec) -> tuple[float, float, int]:
    """Data-parallel (over dp·cp ranks) bytes per device per step for ZeRO 0/1 and for ZeRO 2/3 (one of
    them 0), and the number of collectives. DDP all-reduces fp32 gradients once per step in buckets;
    FSDP all-gathers each layer's parameters per micro-batch (twice under ZeRO-3: forward and
    backward) and reduce-scatters its fp32 gradients once per step (gradient sync on the last one)."""
    p, t, m = spec.parallel, spec.train, spec.model
    n = p.dp * p.cp
    if n == 1:
        return 0.0, 0.0, 0
    groups = reduce_groups(m, p, stage=p.pp - 1)  # (with expert parallelism, the experts apart)
    params = sum(count for count, _ in groups)
    moved = sum((g - 1) / g * count for count, g in groups if g > 1)  # each group's (g − 1)/g of its share
    if p.zero_stage <= 1:
        buckets = max(1, math.ceil(params * 4 / DDP_BUCKET_BYTES))
        return 2 * moved * 4, 0.0, buckets
    gathers = (1 if p.zero_stage == 2 else 2) * t.num_microbatches
    # a unit per block and the root, and with expert parallelism each block's experts (parallel/data.py)
    units = m.num_layers // p.pp + (expert_layers(m, p.pp) if p.ep > 1 else 0) + 1
    bytes_ = moved * (gathers * elem_bytes(t.precision) + 4)
    return 0.0, bytes_, units * (gathers + 1)


def terms_of(spec: RunSpec, *, cpu_cores: int | None = None) -> dict[str, float]:
    """The step-time terms of a canonical spec in seconds (at the preset's figures, or per unit);
    ``cpu_cores``: the machine's cores, for a CPU run (see :func:`sharing`)."""
    spec = busiest_stage_view(spec)  # the slowest stage sets the pace (the spec itself when even)
    m, p, t = spec.model, spec.parallel, spec.train
    rate = device_rates(spec.device)
    share = sharing(spec, cpu_cores=cpu_cores)
    mb, layers = t.num_microbatches, m.num_layers // p.pp
    passes = 1.5 if t.recompute in ("full", "op") else 1.0  # recomputed forwards repeat collectives

    model_flops, extra_flops = stage_flops(spec)
    compute = model_flops * share / rate["flops"]
    recompute = extra_flops * share / rate["flops"]
    # Idle while the pipeline fills and drains (on the shared CPU the fit finds it ~0: ranks that
    # outnumber the cores fill each other's idle time).
    bubble = bubble_fraction(spec) * (compute + recompute)

    acts = layer_activation_bytes(m, p, t, engine="torch", recompute="none") * layers * mb * 2
    logits = LOGIT_PASSES * mb * t.micro_batch_size * t.seq_len // p.cp * m.vocab_size // p.tp * 4
    memory = (acts + logits) * share / rate["memory"]
    layer_passes = layers * mb * (3 + (1 if t.recompute in ("full", "op") else 0))
    overhead = layer_passes * share * 1e-3

    shards = p.dp * p.cp if p.zero_stage >= 1 else 1
    owned = stage_params(m, stage=p.pp - 1, pp=p.pp, tp=p.tp) / shards
    optimizer = owned * OPTIMIZER_BYTES_PER_PARAM * share / rate["memory"]

    def link(span: int) -> tuple[float, float]:
        """(bandwidth B/s, latency s) of a group spanning ``span`` consecutive ranks (tp innermost)."""
        inter = span > spec.device.gpus_per_node and spec.device.name != "cpu"
        return rate["inter" if inter else "intra"], rate["inter_latency" if inter else "latency"]

    c = cost(spec)
    dp_rep, dp_shard, dp_count = _dp_collectives(spec)
    bw_tp, lat_tp = link(p.tp)
    bw_cp, lat_cp = link(p.tp * p.cp)
    bw_pp, lat_pp = link(p.world // p.dp)
    bw_dp, lat_dp = link(p.world)
    bw_ep, lat_ep = link(p.tp * p.ep)  # an ep group: consecutive dp·cp ranks, tp innermost
    latency = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0, "ep": 0.0}  # ring steps x the link's latency
    if p.tp > 1:  # all-reduce-sized collectives per block and micro-batch (comm.tp_collectives)
        units = sum(n * tp_collectives(kind) for kind, n in chunk_blocks(m, p.pp))
        latency["tp"] = units * mb * passes * 2 * (p.tp - 1) * lat_tp
    if p.cp > 1:  # all-gather K and V forward, reduce-scatter their gradients backward
        latency["cp"] = 4 * layers * mb * passes * (p.cp - 1) * lat_cp
    if p.pp > 1:  # an activation forward, its gradient backward, per micro-batch and model chunk
        latency["pp"] = 2 * mb * p.virtual_stages * lat_pp
    if p.ep > 1 and m.moe:  # each expert block's dispatch and combine, forward and backward: ep − 1 steps
        latency["ep"] = 4 * expert_layers(m, p.pp) * mb * passes * (p.ep - 1) * lat_ep
    if dp_count:
        n = p.dp * p.cp
        latency["dp"] = dp_count * (2 if p.zero_stage <= 1 else 1) * (n - 1) * lat_dp
    sp = p.sequence_parallel and p.tp > 1
    return {
        "compute": compute,
        "recompute": recompute,
        "bubble": bubble,
        "memory": memory,
        "overhead": overhead,
        "optimizer": optimizer,
        "tp": 0.0 if sp else c.tp_bytes * share / bw_tp,
        "tp_sp": c.tp_bytes * share / bw_tp if sp else 0.0,
        "cp": c.cp_bytes * share / bw_cp,
        "pp": c.pp_bytes * share / bw_pp,
        "dp_replicated": dp_rep * share / bw_dp,
        "dp_sharded": dp_shard * share / bw_dp,
        "ep": c.ep_bytes * share / bw_ep,
        **{f"{axis}_latency": seconds * share for axis, seconds in latency.items()},
    }


@dataclass(frozen=True)
class StepTimeModel:
    """A fitted step-time model: ``step_time_s = sum_k coef_k * term_k + constant_s`` on ``device``
    (the preset whose figures the terms were computed with: a profile fitted on one device says nothing
    of another's efficiency, so ``plan`` uses it on that device only)."""

    coefficients: dict[str, float]
    constant_s: float
    device: str
    cpu_cores: int | None = None  # the fitting machine's cores, for a CPU profile (see sharing())
    unfitted: tuple[str, ...] = ()  # terms no fitted run exercised (coefficient 0: unknown, not free)
    precisions: tuple[str, ...] = ()  # train.precision of the fitted runs

    def applies_to(self, spec: RunSpec) -> bool:
        return spec.device.name == self.device

    def terms(self, spec: RunSpec) -> dict[str, float]:
        """Each term's fitted seconds (coefficient × term)."""
        raw = terms_of(spec, cpu_cores=self.cpu_cores)
        return {k: self.coefficients.get(k, 0.0) * raw[k] for k in TERMS}

    def step_time_s(self, spec: RunSpec) -> float:
        return sum(self.terms(spec).values()) + self.constant_s

    def tflops_per_device(self, spec: RunSpec, step_time_s: float | None = None) -> float:
        """Predicted model TFLOP/s per device (Megatron's count, as the records' ``tflops_per_device``),
        from ``step_time_s`` when the caller has it."""
        step = self.step_time_s(spec) if step_time_s is None else step_time_s
        return model_flops_per_step(spec) / (step * spec.parallel.world) / 1e12

    def describe(self) -> list[str]:
        """One line per term, as the profile stores it: ``compute x 2.310 (peak TFLOP/s)``."""
        lines = [
            f"{k} x {self.coefficients.get(k, 0.0):.4g} ({UNITS[k]})"
            + (" unfitted: no run had it" if k in self.unfitted else "")
            for k in TERMS
        ]
        return [*lines, f"constant {self.constant_s:.4g} s"]


__all__ = ["ADDED_TERMS", "TERMS", "UNITS", "StepTimeModel", "sharing", "stage_flops", "terms_of"]
