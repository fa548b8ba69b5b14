"""`harness run run.mode=fake`: a layout's memory traced without its devices — each distinct rank in a
process of its own, under PyTorch's fake process group and ``FakeTensorMode``, running the same model,
parallelisms and composer as a real run (``parallelize``, ``train_step``), a warm-up step
(:func:`warm_up`) and one measured step, MemTracker counting what the rank holds.

Which ranks are traced (``traced_ranks``): ranks that differ only in their data-parallel,
context-parallel or tensor-parallel coordinate hold the same tensors (same shapes, different values),
so one rank per pipeline stage stands for all: (stage, dp 0, cp 0, tp 0). Two exceptions add ranks:
ZeroRedundancyOptimizer (ZeRO-1) gives each data-parallel rank a different greedy partition of the
parameters, so the first trace reports every rank's partition and the rank with the largest one is
traced as well; and an uneven tensor-parallel split (vocabulary or widths not divisible by tp) adds the
last tp rank. FSDP2 pads every shard to the same size, so its dp ranks do not differ (the optimizer
state of the last rank's short shard is smaller: rank 0 is the worst).

What differs from the real run, and how it is handled:
- DDP (ZeRO 0/1 without pipelining) cannot run on fake tensors: its C++ reducer reads bucket data
  pointers. It is replaced by ``BucketedReplica``, which accounts for the reducer's memory explicitly:
  the same flat gradient buckets (``gradient_as_bucket_view``: the gradients are views of them), kept
  across steps, and rebuilt at the second step's first forward, the first set released, as the
  reducer does (``Reducer::rebuild_buckets``: the first bucket cut at 1 MiB, the others at 25 MiB).
  Collectives move no memory under the fake group.
- Functional collectives (DTensor's, context parallelism's, the experts' all-to-all): under a fake
  mode ``funcol`` waits each output at once, as for a compiler's trace; an eager run waits it at its
  first use and the collective's Work holds the input until then. On ``device=cpu`` the fake run does
  as the eager one (``modes._collectives_waited_at_first_use``: the tracker holds the inputs gloo's
  Work holds, all-gather's and all-to-all's); GPU presets keep the immediate wait (why: there).
- The targets are a tensor of their own, as on a real rank.
- FSDP2 on a 2-D (dp × tp) mesh builds a concatenated DeviceMesh from real index tensors, which fails
  inside FakeTensorMode; the mesh construction runs with fake mode suspended (``_real_meshes``).
- gloo's reduce-scatter clones its input for the call (FSDP2's and DTensor's), and its all-gather
  allocates two output-sized temporaries (``device=cpu`` runs); the fake group allocates nothing, so
  on ``device=cpu`` the trace makes them (``modes._gloo_reduce_scatter_copy``,
  ``modes._gloo_functional_reduce_scatter_copies``, ``modes._gloo_all_gather_temporaries``; the
  functional one counted in the peak but left out of the trace, which a real run's tracker never
  sees it in: ``measure.tracker.untraced``); NCCL makes
  none, and GPU presets trace without them. gloo's point-to-point works also hold their tensors while
  the pipeline schedule keeps them (``modes._gloo_works_hold_tensors``, CPU only).
- On a GPU preset the CPU's kernels are replaced by what CUDA's save and allocate
  (:mod:`harness.runner.fake.kernels`); on ``device=cpu`` the CPU kernels are the truth.
- Not seen at all: the CUDA context, NCCL's buffers, cuBLAS/cuDNN workspaces chosen at run time. The
  caching allocator's rounding and fragmentation are modelled: MemTracker's record of the storages
  made and freed in the measured step is replayed through harness/alloc (``sim_*`` fields, as a real
  CPU run has), each block on the CUDA stream it would be made on: FSDP2's all-gather outputs on its
  copy-in stream, its reduce-scatter outputs on its reduce-scatter stream, the rest on the default one
  (FSDP2 enters its streams through ``torch.cpu`` here, and the tracker reads the current one:
  harness/runner/measure, the stream constants), so each stream's blocks stay in pools of their own.

Out of memory is judged against the device preset's capacity: status ``oom`` with ``oom_source=fake``
when the traced peak exceeds it (the trace completes either way and its peak is kept).

Cost: the distinct ranks are traced side by side, as many at a time as the CPUs and host memory allow
(``trace_jobs``); each is a fork of a parent that has already imported what a trace needs
(``_preload``), so no rank pays for the imports again. Neither changes what a rank traces: every
child starts from the same parent state, and the record lists the same ranks in the same order as
one-at-a-time tracing would (a ZeRO-1 rank is started when the first result names it).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from harness.runner.fake.pool import _preload, _trace_ranks, trace_jobs
from harness.runner.fake.ranks import traced_ranks
from harness.runner.fake.trace import gpu_kernels
from harness.runner.record import finish_record, invalid_record
from harness.spec import InvalidSpec, RunSpec, canonical

log = logging.getLogger(__name__)

OOM_SOURCE = "fake"
TIMING_FIELDS = (
    "step_time_s",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
    "mfu_reference_tflops",
    "loss",
    "losses",
)


MODES = ("real", "fake")


def run_configured(
    spec: RunSpec, run: dict[str, Any], *, task=None, artifacts: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """One point as the ``run`` section of the config asks (``run.mode``, ``run.timeout_s``,
    ``run.fake_cache``): the real supervisor, or :func:`run_fake`. ``harness run`` and every sweep job
    go through here.
    ``artifacts``: files each real rank writes beside the record (``run.trace``, ``run.memory_snapshot``)."""
    from harness.runner.supervisor import run_point

    mode = str(run.get("mode", "real"))
    if mode not in MODES:
        raise ValueError(f"run.mode={mode!r} must be one of {', '.join(MODES)}")
    timeout_s = float(run["timeout_s"])
    if mode == "fake":
        if task is not None and task.index > 0:
            return None  # one process traces the point; the other tasks of a Slurm job have nothing to do
        trace_dir = (artifacts or {}).get("trace_dir") if (artifacts or {}).get("write_trace") else None
        return run_fake(spec, timeout_s=timeout_s, cache=run.get("fake_cache"), trace_dir=trace_dir)
    share = run.get("share_gpus", False)
    if not isinstance(share, bool):
        raise ValueError(f"run.share_gpus={share!r} must be true or false")
    return run_point(spec, timeout_s=timeout_s, task=task, artifacts=artifacts, share_gpus=share)


def fake_problems(spec: RunSpec) -> list[str]:
    """What the fake mode cannot trace, beyond what the real runner cannot run."""
    from harness.runner.supervisor import runner_problems

    # (runner_problems asks nothing of the devices: a GPU preset is what the fake mode is for.)
    return runner_problems(spec)


def run_fake(
    spec: RunSpec,
    *,
    timeout_s: float = 600.0,
    kernels: str | None = None,
    jobs: int | None = None,
    cache: str | os.PathLike | None = None,
    trace_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Trace every distinct rank of ``spec`` (one process each, up to ``jobs`` at a time; default
    :func:`trace_jobs`) and return the record. ``kernels``: "cuda" or "cpu" (default: cuda on a GPU
    preset, cpu on device=cpu). ``cache``: a directory of completed rank traces
    (:mod:`harness.runner.fake.cache`): a rank found there is not traced again, one traced is kept.
    ``trace_dir`` (``run.trace``): each traced rank's allocation trace is written there, as a real
    rank's is (``<config_id>.rank<r>.trace.json``)."""
    try:
        spec = canonical(spec)
    except InvalidSpec as exc:
        return invalid_record(spec, str(exc))
    problems = fake_problems(spec)
    if problems:
        return invalid_record(spec, "; ".join(problems))
    _preload()
    start = time.monotonic()
    base = traced_ranks(spec)
    store = None
    if cache is not None:
        from harness.runner.fake.cache import TraceCache

        store = TraceCache(cache)
    results = _trace_ranks(
        spec,
        base,
        deadline=start + timeout_s,
        kernels=kernels or ("cuda" if gpu_kernels(spec) else "cpu"),
        jobs=jobs or trace_jobs(len(base)),
        cache=store,
        trace_dir=Path(trace_dir) if trace_dir is not None else None,
    )
    return fake_record(spec, results, wall_s=time.monotonic() - start, timeout_s=timeout_s)


def fake_record(
    spec: RunSpec, ranks: list[dict[str, Any]], *, wall_s: float, timeout_s: float
) -> dict[str, Any]:
    """The point's record from the traced ranks: a normal row, memory_method fake, no timing fields."""
    failed = [r for r in ranks if "peak_allocated_bytes" not in r]
    device = f"fake ({spec.device.name})"
    common = {"wall_s": wall_s, "device_name": device}
    if failed:
        r = failed[0]
        if r.get("timed_out"):
            row = finish_record(
                spec,
                ranks,
                status="timeout",
                error=f"fake trace of rank {r['rank']} not finished within {timeout_s:g} s",
                error_rank=r["rank"],
                exit_code=None,
                **common,
            )
        else:
            # An untraceable layout is a statement about the fake mode, not a crash of the layout.
            row = finish_record(
                spec,
                [],
                status="invalid",
                error=f"fake mode cannot trace rank {r['rank']}: {r.get('error', 'no result')}",
                error_rank=r["rank"],
                exit_code=r.get("exit_code"),
                **common,
            )
    else:
        done = [{**r, "step_time_s": float("nan"), "losses": []} for r in ranks]
        row = finish_record(spec, done, status="ok", error=None, error_rank=None, exit_code=0, **common)
        worst, capacity = row["peak_allocated_bytes"], spec.device.memory_bytes
        if worst > capacity:
            row.update(
                status="oom",
                oom_source=OOM_SOURCE,
                error=f"fake: peak {worst} B on rank {row['worst_rank']} > capacity {capacity} B "
                f"({spec.device.memory_gib} GiB)",
            )
        else:
            row["oom_source"] = None
    for key in TIMING_FIELDS:
        row.pop(key, None)
    row["fake_traced_ranks"] = sorted(r["rank"] for r in ranks)
    row["fake_cached_ranks"] = sorted(r["rank"] for r in ranks if r.get("cached"))  # (run.fake_cache)
    row["fake_kernels"] = ranks[0].get("kernels") if ranks else None
    row["fake_trace_s"] = [r.get("trace_s") for r in sorted(ranks, key=lambda r: r["rank"])]
    row["fake_trace_cpu_s"] = [r.get("trace_cpu_s") for r in sorted(ranks, key=lambda r: r["rank"])]
    row["fake_host_rss_bytes"] = max((r.get("host_rss_bytes") or 0 for r in ranks), default=None)
    return row
