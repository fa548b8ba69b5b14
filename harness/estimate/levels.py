"""The reserved and device levels above the allocated peak: what a GPU's caching allocator and the
process around it add to the tensors every engine counts.

Three levels (ARCHITECTURE.md, issue 13): *allocated* (the tensors alive at the peak: ``total_bytes``,
what ``torch.cuda.max_memory_allocated`` and the CPU instrument measure), *reserved* (the caching
allocator's segments: allocated plus the rounding of its segments, the segments of the
gradient-reduction stream, those the optimizer step opens beyond the forward/backward cache, and the
cuBLAS workspaces; the fragmentation left beyond those is fitted by calibration from replayed or
measured reserved peaks), and
*device* (reserved plus what lives outside the allocator: the CUDA context and NCCL's buffers). A run
runs out of memory when the device level reaches the capacity. Every constant is a device preset's field
(sweeps/device/*.yaml), cited there; the CPU has none of them (all zero).
"""

from __future__ import annotations

from harness.estimate.segments import segment_terms, segment_terms_bound
from harness.estimate.terms import peak_bytes
from harness.spec import RunSpec

MIB = 1 << 20
RESERVED_TERMS = (
    "segment_rounding",
    "reduce_stream",
    "fsdp_root",
    "loss_logits",
    "recompute_packing",
    "recompute_working_set",
    "grad_accumulation",
    "embedding_grad",
    "first_backward",
    "optimizer_step_segments",
    "cublas_workspace",
)
OUTSIDE_TERMS = ("cuda_context", "nccl")
# Temporary buffers that are one tensor each, allocated and freed once per use: the caching allocator
# opens a segment of their own for them when no cached block is large enough.
SINGLE_BUFFERS = ("logits", "loss", "fsdp_allgather", "tp_allgather", "cp_kv_allgather", "optimizer_step")
KROUND_LARGE = 2 * MIB  # c10/cuda/CUDACachingAllocator.cpp: segments of >= 10 MiB round up to 2 MiB
KMIN_LARGE_ALLOC = 10 * MIB


def segment_rounding(terms: dict[str, int]) -> int:
    """What the segments of the single large buffers reserve beyond them: a buffer of at least 10 MiB
    gets a segment rounded up to 2 MiB (``get_allocation_size``), the tail unusable by anything larger.
    Smaller buffers share 20 MiB segments whose split-off remainders serve later requests, so they add
    nothing here. A lower bound: how freed blocks interleave with live ones (the main source of
    fragmentation) depends on the order of allocations, which the replay of a trace sees and
    calibration fits (``sim_fragmentation_bytes``)."""
    out = 0
    for name in SINGLE_BUFFERS:
        b = terms.get(name, 0)
        if b >= KMIN_LARGE_ALLOC:
            out += -(-b // KROUND_LARGE) * KROUND_LARGE - b
    return out


def communicators(spec: RunSpec) -> int:
    """NCCL communicators a rank holds: one per process group it runs collectives on, created lazily at
    the first one (torch's ProcessGroupNCCL): the world group (the runner's loss all-reduce, barriers)
    and each parallel axis of degree > 1 — data parallel, tensor parallel, context parallel, pipeline
    (send/recv between neighbours) — plus FSDP's flattened dp×cp group when both are > 1."""
    p = spec.parallel
    if p.world == 1:
        return 0
    axes = sum(d > 1 for d in (p.dp, p.tp, p.pp, p.cp))
    return 1 + axes + (p.dp > 1 and p.cp > 1)


def reserved_terms(
    spec: RunSpec, terms: dict[str, int], *, stage: int = 0, engine: str = "torch"
) -> dict[str, int]:
    """The reserved level's own terms for one stage (bytes): the rounding of the single buffers'
    segments, and for the ``torch`` engine (the runner's data-parallel wrappers and ``foreach`` AdamW)
    the segments of the gradient-reduction stream and those the optimizer step opens beyond the
    forward/backward cache (:mod:`harness.estimate.segments`), and the cuBLAS workspaces. All 0 on the
    CPU, which has no caching allocator."""
    d = spec.device
    out = dict.fromkeys(RESERVED_TERMS, 0)
    out["cublas_workspace"] = round(d.cublas_workspace_mib * MIB)
    if d.name == "cpu":
        return out
    out["segment_rounding"] = segment_rounding(terms)
    if engine == "torch":
        out.update(segment_terms(spec, stage, terms))
    return out


def reserved_upper_bound(
    spec: RunSpec, terms: dict[str, int], *, stage: int = 0, engine: str = "torch"
) -> int:
    """At least the stage's reserved level (allocated peak plus :func:`reserved_terms`), cheaply: the
    mechanism terms bounded by the reduce stream's segments plus a segment for every temporary of the
    optimizer step (:func:`~harness.estimate.segments.segment_terms_bound`)."""
    d = spec.device
    out = peak_bytes(terms) + round(d.cublas_workspace_mib * MIB)
    if d.name == "cpu":
        return out
    out += segment_rounding(terms)
    return out + (segment_terms_bound(spec, stage, terms) if engine == "torch" else 0)


def worst_by_bound(stages, bound, exact):
    """(stage, value) of the stage whose ``exact`` value is highest (the lowest stage on ties), asking
    ``exact`` only of stages whose cheap upper ``bound`` can still reach the best found: with a
    pipeline most stages are never computed (``plan`` asks it of tens of thousands of candidates)."""
    if len(stages) == 1:
        return stages[0], exact(stages[0])
    best = None
    for limit, s in sorted(((bound(s), s) for s in stages), key=lambda b: (-b[0], b[1].stage)):
        if best is not None and limit < best[1]:
            break
        value = exact(s)
        if best is None or value > best[1] or (value == best[1] and s.stage < best[0].stage):
            best = (s, value)
    return best


def mechanism_bytes(est, stage=None) -> int:
    """The reserved level's derived terms of ``stage`` of an :class:`~harness.estimate.core.Estimate`
    (default: its allocated worst): every reserved term but the cuBLAS workspace. What a calibration
    profile's fitted fragmentation comes on top of (``fragmentation.over_mechanism``)."""
    terms = est.reserved_terms(est.worst if stage is None else stage)
    return sum(v for k, v in terms.items() if k != "cublas_workspace")


# NCCL's buffers per channel and connection besides NCCL_BUFFSIZE's SIMPLE buffer: the LL and LL128
# protocols' (0.5 + 4.69 MiB), all of it mapped in 2 MiB cuMem granules (NVIDIA/nccl#1685 logs
# 10,485,760 B a channel at the default 4 MiB: 4 + 0.5 + 4.69 rounded up to 10 MiB).
NCCL_DEFAULT_BUFFSIZE_MIB = 4.0
NCCL_OTHER_PROTOCOLS_MIB = 0.5 + 4.69
NCCL_GRANULE_MIB = 2.0


def _nccl_channel_mib(buffsize_mib: float) -> float:
    per = buffsize_mib + NCCL_OTHER_PROTOCOLS_MIB
    return -(-per // NCCL_GRANULE_MIB) * NCCL_GRANULE_MIB


def nccl_bytes(device) -> int:
    """NCCL's buffers per communicator: the preset's figure, which holds at NCCL's default buffer size,
    changed by ``nccl_channels`` x the change of each channel's granule-rounded buffers when
    ``nccl_buffsize_mib`` (NCCL_BUFFSIZE) is set: 8 MiB on 24 channels adds 24 x (14 - 10) = 96 MiB."""
    mib = device.nccl_mib_per_communicator
    if device.nccl_buffsize_mib is not None and device.nccl_channels:
        mib += device.nccl_channels * (
            _nccl_channel_mib(device.nccl_buffsize_mib) - _nccl_channel_mib(NCCL_DEFAULT_BUFFSIZE_MIB)
        )
    return round(max(0.0, mib) * MIB)


def outside_terms(spec: RunSpec) -> dict[str, int]:
    """The device level's terms (bytes): memory the process uses outside the caching allocator."""
    d = spec.device
    return {
        "cuda_context": round(d.cuda_context_mib * MIB),
        "nccl": nccl_bytes(d) * communicators(spec),
    }


def allocator_capacity_bytes(est) -> int:
    """What the caching allocator may reserve on the card of an
    :class:`~harness.estimate.core.Estimate`: the device's memory less what lives outside the
    allocator (CUDA context, NCCL's buffers; 0 on the CPU). A trace replayed against it is judged as
    the card would judge it (harness.alloc.capacity_verdict)."""
    return max(1, est.capacity_bytes - est.outside_allocator_bytes)


def verdict_floor(est, allocated: int | None = None) -> int:
    """A lower bound of :func:`verdict_bytes` without the reserved terms: the allocated level (the
    profile's, ``allocated``, where one applies) and the memory outside the allocator. The reserved
    level is never below the allocated one: its terms and a profile's fragmentation are all >= 0
    (profiles are refused otherwise, harness/analysis/profile.py)."""
    return (est.total_bytes if allocated is None else allocated) + est.outside_allocator_bytes


def verdict_bytes(est, calibration=None, *, allocated: int | None = None) -> int:
    """The device level a verdict is judged on, for an :class:`~harness.estimate.core.Estimate`:
    uncalibrated, the estimate's own; with a calibration profile, its allocated peak, its fitted
    fragmentation where it has one (else the estimate's reserved terms), and the memory outside the
    allocator. ``allocated``: the profile's allocated peak of ``est`` where the caller has it."""
    if calibration is None:
        return est.device_total_bytes
    if allocated is None:
        allocated = calibration.total_bytes(est)
    reserved = getattr(calibration, "reserved_bytes", lambda _: None)(est)
    if reserved is None:
        reserved = allocated + est.reserved_total_bytes - est.total_bytes
    return reserved + est.outside_allocator_bytes
