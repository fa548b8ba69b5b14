"""The run record: one flat dict per point, whatever happened, with a schema version. No torch here.

Column names are the public contract of ARCHITECTURE.md: every spec field by its dotted name with ``_``
(``parallel_tp``), ``config_id``, ``status``, measured fields, the estimator's terms as
``est_<term>_bytes``, environment fields and ``schema_version``.

Fields added by issue 33 (CUDA runs; None or absent elsewhere):
- ``num_alloc_retries``, ``num_ooms``: now over the timed window only (deltas of the allocator's
  cumulative counters), the largest of the ranks.
- ``allocator_backend`` (native|cudaMallocAsync), ``allocator_settings`` (the settings string in
  effect: the snapshot's, else the environment's), ``allocator_settings_source`` (snapshot or the
  variable it came from), ``env_pytorch_alloc_conf``, ``env_pytorch_cuda_alloc_conf`` (both variables
  as set), from the first rank that reports them.
- ``sim_expandable_segments``, ``sim_max_split_size_mb``: the settings the replay ran with.
- ``sim_skipped_reason``: why ``sim_*`` are empty (settings the model lacks, the async backend, no
  history, a trace the model refuses), from the first rank that has one.
- ``segment_allocs_measured``: the ``segment_alloc``/``segment_map`` events of the CUDA trace in the
  timed window; ``sim_segments_opened``: the segments the replay of that window opened — both from
  the rank with the highest simulated reserved peak (or the first rank with a count).
- ``sim_capacity_bytes``, ``sim_capacity_verdict``, ``sim_num_alloc_retries`` (issue 32): each rank's
  replayed trace judged against what the allocator may reserve on the card (the device's memory less
  the estimated CUDA context and NCCL buffers): fits, fits_after_flush (the allocator released its
  cache and retried, ``sim_num_alloc_retries`` times), oom_fragmentation (the tensors fit, the reserve
  does not), oom_allocated; the worst rank's verdict, the most retries. CPU and fake runs.
- ``sim_trace`` (issue 30): which trace ``sim_*`` replay — ``operator_storages`` (CPU and fake runs:
  the storages the step's operators make and free, as MemTracker sees them; runner/measure/peak.py
  ``REPLAYED_TRACE`` says why not the CPU allocator's own) or ``cuda_allocator``. CPU rows without it
  replayed the CPU allocator's own trace. ``per_rank_sim_reserved_bytes``: each rank's replayed
  reserved peak, in the order of ``per_rank_peak_bytes`` (None where a rank has none).
- ``env_cuda_version`` (torch's build), ``env_driver_version`` (the kernel module's, read from
  /proc/driver/nvidia/version or nvidia-smi), ``env_cudnn_version``, ``env_nccl_version`` (as a rank
  loaded them): none of them initialises CUDA in the supervisor.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import re
import socket
import statistics
import subprocess
from pathlib import Path
from typing import Any

from harness import __version__
from harness.estimate import TERMS, estimate
from harness.estimate.flops import model_flops_per_step, peak_tflops_for
from harness.estimate.terms import FLOPS_CONVENTION
from harness.spec import RunSpec, canonical, config_id, flat, raw_id

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "timeout", "crash", "invalid", "skipped_predicted_oom")


@functools.lru_cache(maxsize=1)
def git_revision() -> str | None:
    """The source tree's commit, when it is a git checkout (None otherwise)."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device_name: str | None = None) -> dict[str, Any]:
    import importlib.metadata as md

    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        torch_version = None
    return {
        "env_torch_version": torch_version,
        "env_python_version": platform.python_version(),
        "env_harness_version": __version__,
        "env_host": socket.gethostname(),
        "env_git_revision": git_revision(),
        "env_device_name": device_name,
        "env_cpu_count": os.cpu_count(),
        "env_slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "env_slurm_nodelist": os.environ.get("SLURM_JOB_NODELIST"),
        "env_cuda_version": torch_cuda_version(),
        "env_cudnn_version": None,  # a rank's (cudnn.version() initialises CUDA: finish_record)
        "env_nccl_version": None,  # likewise
        "env_driver_version": driver_version(),
    }


@functools.lru_cache(maxsize=1)
def torch_cuda_version() -> str | None:
    """``torch.version.cuda`` without importing torch here (this module has no torch): the imported
    module's when there is one, else read from the installed torch/version.py."""
    import importlib.util
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "version"):
        return getattr(torch.version, "cuda", None)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = path.read_text()
    except OSError:
        return None
    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


@functools.lru_cache(maxsize=1)
def driver_version() -> str | None:
    """The NVIDIA driver's version from /proc/driver/nvidia/version, else ``nvidia-smi`` (NVML in a
    process of its own): never a CUDA call in this process. None without a driver."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def estimate_fields(spec: RunSpec) -> dict[str, Any]:
    """The torch engine's terms for the same spec (worst stage), for calibration."""
    est = estimate(spec, engine="torch")
    out = {f"est_{k}_bytes": est.worst.terms[k] for k in TERMS}
    out["est_total_bytes"] = est.total_bytes
    out["est_reserved_total_bytes"] = est.reserved_total_bytes
    out["est_device_total_bytes"] = est.device_total_bytes
    out["est_worst_stage"] = est.worst.stage
    out["est_utilisation"] = est.utilisation
    return out


def base_record(spec: RunSpec) -> dict[str, Any]:
    """Spec columns, config_id and the estimate (the estimate only for a valid spec)."""
    try:
        spec = canonical(spec)
        cid, valid = config_id(spec), True
    except ValueError:
        cid, valid = raw_id(spec), False
    row: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "config_id": cid, **flat(spec)}
    if valid:
        row.update(estimate_fields(spec))
    return row


def invalid_record(spec: RunSpec, reason: str) -> dict[str, Any]:
    return {**base_record(spec), **environment(), "status": "invalid", "error": reason}


def step_timing(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The step's timing fields from the ranks that finished.

    - ``step_time_s``: the slowest rank's median step (the others wait for it in the step's collectives,
      so its median is the job's step time).
    - ``step_times_s``: that rank's timed steps, in order, in seconds.
    - ``step_time_rank``: which rank that is.
    - ``step_time_spread``: the relative range of those steps, (max - min) / median, NaN with fewer than
      two timed steps. The range rather than a standard deviation: a study times 3-5 steps, too few for
      a standard deviation to mean much, and the range is what a comparison must beat: two layouts whose
      median step times differ by less than their spread are not told apart by the measurement.
    """
    slowest = max(ranks, key=lambda r: r["step_time_s"])
    times = [float(t) for t in slowest.get("step_times_s", [])]
    spread = (max(times) - min(times)) / statistics.median(times) if len(times) >= 2 else math.nan
    return {
        "step_time_s": slowest["step_time_s"],
        "step_times_s": times,
        "step_time_rank": slowest["rank"],
        "step_time_spread": spread,
    }


# Rank-result fields of the CUDA measurement (harness/runner/measure/peak.py) taken from the first rank
# that reports them: the same on every rank of a point.
_FIRST_RANK_FIELDS = (
    "allocator_backend",
    "allocator_settings",
    "allocator_settings_source",
    "env_pytorch_alloc_conf",
    "env_pytorch_cuda_alloc_conf",
    "sim_expandable_segments",
    "sim_max_split_size_mb",
    "sim_skipped_reason",
    "sim_trace",
    "env_cuda_version",
    "env_cudnn_version",
    "env_nccl_version",
)


def _cuda_fields(done: list[dict[str, Any]], simulated: list[dict[str, Any]]) -> dict[str, Any]:
    """The allocator settings, the replay's segment comparison and the versions the ranks report."""
    out: dict[str, Any] = {}
    ordered = sorted(done, key=lambda r: r["rank"])
    for key in _FIRST_RANK_FIELDS:
        value = next((r[key] for r in ordered if r.get(key) is not None), None)
        if value is not None or not key.startswith("env_"):  # a rank's version over the supervisor's
            out[key] = value
    counted = [r for r in ordered if r.get("segment_allocs_measured") is not None]
    if simulated:
        counted = [max(simulated, key=lambda r: r["sim_peak_reserved_bytes"]), *counted]
    out["segment_allocs_measured"] = counted[0].get("segment_allocs_measured") if counted else None
    out["sim_segments_opened"] = counted[0].get("sim_segments_opened") if counted else None
    return out


def _capacity_fields(simulated: list[dict[str, Any]]) -> dict[str, Any]:
    """The replays against the card's capacity (issue 32): the worst rank's verdict (in the order of
    harness.alloc.CAPACITY_VERDICTS), the most cache flushes of any rank, and the capacity."""
    from harness.alloc import CAPACITY_VERDICTS

    judged = [r for r in simulated if r.get("sim_capacity_verdict") in CAPACITY_VERDICTS]
    if not judged:
        return {}
    worst = max(judged, key=lambda r: CAPACITY_VERDICTS.index(r["sim_capacity_verdict"]))
    return {
        "sim_capacity_bytes": worst["sim_capacity_bytes"],
        "sim_capacity_verdict": worst["sim_capacity_verdict"],
        "sim_num_alloc_retries": max(r["sim_num_alloc_retries"] for r in judged),
    }


def finish_record(
    spec: RunSpec,
    ranks: list[dict[str, Any]],
    *,
    status: str,
    error: str | None,
    error_rank: int | None,
    exit_code: int | None,
    wall_s: float,
    device_name: str,
    launch_tasks: int = 1,
    launch_hosts: list[str] | None = None,
) -> dict[str, Any]:
    """Assemble the record of a launched point from every rank's numbers. ``launch_tasks``: how many
    supervisors (one per node on a cluster) forked the ranks; ``launch_hosts``: the nodes that reported."""
    spec = canonical(spec)
    row = {**base_record(spec), **environment(device_name)}
    row.update(status=status, error=error, error_rank=error_rank, exit_code=exit_code, wall_s=wall_s)
    row.update(launch_tasks=launch_tasks, launch_hosts=launch_hosts)
    done = [r for r in ranks if "peak_allocated_bytes" in r]
    ordered = sorted(ranks, key=lambda r: r["rank"])
    row["per_rank_peak_bytes"] = [r.get("peak_allocated_bytes") for r in ordered]
    row["per_rank_sim_reserved_bytes"] = [r.get("sim_peak_reserved_bytes") for r in ordered]
    row["oom_source"] = None
    if done:
        worst = max(done, key=lambda r: r["peak_allocated_bytes"])
        row["peak_allocated_bytes"] = worst["peak_allocated_bytes"]
        row["worst_rank"] = worst["rank"]
        row["memory_method"] = worst["memory_method"]
        row["tracker_peak_bytes"] = worst.get("tracker_peak_bytes")  # CPU: MemTracker's own peak
        for key in (
            "peak_reserved_bytes",
            "peak_active_bytes",
            "device_used_bytes",
            "num_alloc_retries",
            "num_ooms",
        ):
            values = [r[key] for r in done if key in r]
            row[key] = max(values) if values else None
        # The caching-allocator replay of each rank's own trace (harness/alloc): the rank whose
        # simulated reserved peak is highest, with its fragmentation (reserved - allocated there).
        simulated = [r for r in done if r.get("sim_peak_reserved_bytes") is not None]
        if simulated:
            top = max(simulated, key=lambda r: r["sim_peak_reserved_bytes"])
            row["sim_peak_reserved_bytes"] = top["sim_peak_reserved_bytes"]
            row["sim_fragmentation_bytes"] = top["sim_fragmentation_bytes"]
            row["sim_peak_allocated_bytes"] = max(r["sim_peak_allocated_bytes"] for r in simulated)
            row.update(_capacity_fields(simulated))
        row.update(_cuda_fields(done, simulated))
        traces = [r["trace_file"] for r in sorted(done, key=lambda r: r["rank"]) if r.get("trace_file")]
        snapshots = [r["memory_snapshot"] for r in ranks if r.get("memory_snapshot")]
        row["trace_files"] = traces or None
        row["memory_snapshots"] = snapshots or None
        for name, value in worst.get("categories", {}).items():
            row[f"mem_{name}_bytes"] = value
    # A CUDA rank that ran out of memory reports the allocator's peaks at that moment, and no steps.
    timed = [r for r in done if "losses" in r]
    if timed:
        row.update(step_timing(timed))
        step = row["step_time_s"]
        losses = timed[0]["losses"]
        row.update(loss=losses[-1] if losses else None, losses=losses)
        flops = model_flops_per_step(spec, convention=FLOPS_CONVENTION)
        row["model_flops_per_step"] = flops
        row["flops_convention"] = FLOPS_CONVENTION
        row["tokens_per_s"] = spec.global_batch_size * spec.train.seq_len / step
        row["tflops_per_device"] = flops / (step * spec.parallel.world) / 1e12
        cpu_peak = next((r["cpu_peak_tflops"] for r in timed if "cpu_peak_tflops" in r), None)
        row["mfu_reference_tflops"] = peak = (
            cpu_peak if spec.device.name == "cpu" else gpu_peak_tflops(spec, device_name)
        )
        row["mfu"] = row["tflops_per_device"] / peak if peak and not math.isnan(peak) else math.nan
    if (
        done
        and status == "ok"
        and spec.device.name == "cpu"
        and worst["peak_allocated_bytes"] > spec.device.memory_bytes
    ):
        # Out of memory on CPU is simulated against the preset's capacity; the peak is kept.
        row["status"] = "oom"
        row["oom_source"] = "simulated"
        row["error"] = (
            f"simulated: peak {worst['peak_allocated_bytes']} B on rank {worst['rank']} > capacity "
            f"{spec.device.memory_bytes} B ({spec.device.memory_gib} GiB)"
        )
    if status == "oom":
        row["oom_source"] = "cuda"
        row["oom_kind"] = next((r["oom_kind"] for r in ranks if r.get("oom_kind")), None)
    for key in EMULATION_FIELDS:
        row[key] = next((r[key] for r in ranks if r.get(key) is not None), None)
    return row


# A GPU rank's emulation of a smaller card (worker.emulate_capacity): the cap set on its allocator, the
# card emulated and what already sat outside the allocator when the cap was set.
EMULATION_FIELDS = (
    "emulated",
    "cuda_memory_fraction",
    "emulated_capacity_bytes",
    "outside_allocator_at_cap_bytes",
    "physical_total_bytes",
    "emulated_note",
)


def gpu_peak_tflops(spec: RunSpec, device_name: str | None) -> float:
    """The MFU reference of a GPU run: the card the step ran on, by its name (an emulated 40 GB card on
    an H200 computes at the H200's rate), else the preset's."""
    physical = peak_tflops_for(device_name) if device_name else math.nan
    return physical if not math.isnan(physical) else (spec.device.peak_tflops or math.nan)
