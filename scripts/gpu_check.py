"""GPU check: a handful of real points on one CUDA GPU, including real out-of-memory.

Run on a machine with at least one NVIDIA GPU of >= 80 GB (an H100/H200), in under 8 minutes:

    python scripts/gpu_check.py [--out DIR]

Points: a small model on one rank; the same on 2 ranks sharing the GPU over gloo (FSDP) and with tensor
parallelism; and a 2-layer Llama-3-8B-shaped model whose micro-batch is chosen from the estimator so that
its predicted peak lies between 40 and 80 GB, run once as an emulated A100 40 GB (the process's memory
fraction capped: a real ``torch.OutOfMemoryError`` is expected) and once as an emulated 80 GB card
(expected to fit). Prints one line per point and writes every record to DIR/gpu_check.json after each
point (DIR: $OUT if set, else results/runner_checks/gpu_check), so a device lost mid-check keeps what
ran.

The caching-allocator model (issue 13) is judged on the same points: every rank records the allocator's
own history (``run.trace``), and replaying that real trace through ``harness.alloc`` must give the
measured ``max_memory_reserved`` exactly; one FP32 point is also run on the CPU, and the replay of its
CPU-recorded trace must come within 5 % of the GPU's reserved peak. The memory outside the allocator
(``device_used_bytes`` minus reserved on the one-rank point: CUDA context and libraries) is printed
beside the device preset's ``cuda_context_mib``.

Fake runs on the GPU's numbers (issue 14, item 5): every point that ran is traced again with
``run.mode=fake`` (the same spec; CUDA's kernels stood in for the CPU's) and the fake peak is printed
beside the real allocated peak. The step-time model (issue 17, item 5) is fitted on the points that ran
(in sample: a handful of points cannot hold out a world size) and each point's predicted step time is
printed beside the measured one; the fit goes into gpu_check.json as ``step_time_fit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from harness.alloc import load_trace, replay
from harness.cli.config import compose, run_spec
from harness.estimate import estimate
from harness.runner.fake.run import run_fake
from harness.runner.supervisor import run_point

GIB = 2**30
FP32 = ["train.precision=fp32"]
BIG = ["model=llama3_8b", "model.num_layers=2", "train.seq_len=4096", "train.precision=bf16", "train.steps=3"]


def pick_micro_batch() -> int:
    """The smallest micro-batch whose torch-engine estimate is between 50 and 70 GiB."""
    for mbs in range(1, 33):
        spec = run_spec(compose([*BIG, f"train.micro_batch_size={mbs}", "device=a100_80gb"]))
        total = estimate(spec, engine="torch").total_bytes
        if 50 * GIB <= total <= 70 * GIB:
            return mbs
    raise SystemExit("no micro-batch puts the estimate between 50 and 70 GiB")


def points() -> list[tuple[str, list[str], str]]:
    mbs = pick_micro_batch()
    small = ["model=medium", "train.seq_len=1024", "train.micro_batch_size=4", "train.steps=3"]
    return [
        ("small, 1 rank", [*small, "device=h200_141gb"], "ok"),
        ("small FP32, 1 rank (traced on GPU and CPU)", [*small, *FP32, "device=h200_141gb"], "ok"),
        (
            "small, dp2 FSDP, 2 ranks on 1 GPU (gloo)",
            [*small, "device=h200_141gb", "parallel.dp=2", "parallel.zero_stage=3"],
            "ok",
        ),
        ("small, tp2, 2 ranks on 1 GPU (gloo)", [*small, "device=h200_141gb", "parallel.tp=2"], "ok"),
        (
            f"8B-shaped 2 layers, mbs {mbs}, as A100 40 GB",
            [*BIG, f"train.micro_batch_size={mbs}", "device=a100_40gb"],
            "oom",
        ),
        (
            f"8B-shaped 2 layers, mbs {mbs}, as A100 80 GB",
            [*BIG, f"train.micro_batch_size={mbs}", "device=a100_80gb"],
            "ok",
        ),
    ]


def check_replay(record: dict, overrides: list[str]) -> bool:
    """The real traces replayed must give the measured reserved peak exactly; for the FP32 point, the
    CPU-recorded trace of the same point must come within 5 %."""
    files = record.get("trace_files") or []
    real = record.get("peak_reserved_bytes")
    if not files or real is None:
        print("  FAIL replay: no trace recorded")
        return False
    replayed = max(replay(load_trace(f)).peak_reserved_bytes for f in files)
    exact = replayed == real
    print(
        f"  {'PASS' if exact else 'FAIL'} replay of the real trace: {replayed} B vs measured {real} B "
        f"({(replayed - real) / real:+.3%})"
    )
    if record.get("parallel_world_size") == 1 and record.get("device_used_bytes"):
        outside = record["device_used_bytes"] - real
        preset = record.get("device_cuda_context_mib")
        print(
            f"  outside the allocator (device used - reserved): {outside / 2**20:.0f} MiB "
            f"(preset cuda_context_mib {preset})"
        )
    if "train.precision=fp32" not in overrides:
        return exact
    cpu = [o for o in overrides if not o.startswith("device=")] + ["device=cpu", "device.memory_gib=1000"]
    cpu_record = run_point(run_spec(compose(cpu)), timeout_s=300)
    sim = cpu_record.get("sim_peak_reserved_bytes")
    close = sim is not None and abs(sim - real) <= 0.05 * real
    print(
        f"  {'PASS' if close else 'FAIL'} CPU-recorded trace replayed: {sim} B vs GPU reserved {real} B"
        + (f" ({(sim - real) / real:+.2%})" if sim else f"; {cpu_record.get('error')}")
    )
    record["cpu_counterpart"] = {
        k: cpu_record.get(k)
        for k in (
            "status",
            "peak_allocated_bytes",
            "sim_peak_allocated_bytes",
            "sim_peak_reserved_bytes",
            "sim_fragmentation_bytes",
        )
    }
    return exact and close


def check_fake(record: dict, overrides: list[str]) -> dict:
    """The same point traced with run.mode=fake: its peak beside the real allocated peak (the fake run
    cannot see the caching allocator's rounding, which ``peak_allocated_bytes`` includes)."""
    fake = run_fake(run_spec(compose(overrides)), timeout_s=300)
    real, traced = record.get("peak_allocated_bytes"), fake.get("peak_allocated_bytes")
    if real and traced:
        print(
            f"  fake run: {traced / GIB:.3f} GiB vs real allocated {real / GIB:.3f} GiB "
            f"({(traced - real) / real:+.2%})"
        )
    else:
        print(f"  fake run: status {fake.get('status')}; {fake.get('error') or ''}")
    return {
        k: fake.get(k)
        for k in ("status", "peak_allocated_bytes", "per_rank_peak_bytes", "fake_kernels", "error")
    }


def step_time_fit(records: list[dict]) -> dict | None:
    """The step-time model fitted on the points that ran (in sample), each point's prediction beside
    its measurement; None below 3 timed points."""
    import numpy as np
    import pandas as pd

    from harness.analysis.steptime import StepTimeCalibrator, step_time_rows
    from harness.estimate.steptime import TERMS as STEP_TIME_TERMS

    runs = step_time_rows(pd.DataFrame(records))
    # One device preset: the emulated cards' presets carry another card's peak and links.
    runs = (
        runs[runs["st_device"] == runs["st_device"].mode()[0]].reset_index(drop=True) if len(runs) else runs
    )
    if len(runs) < 3:
        return None
    columns = [f"st_{k}" for k in STEP_TIME_TERMS]
    fit = StepTimeCalibrator().fit(
        runs[columns].to_numpy(dtype=float), runs["step_time_s"].to_numpy(dtype=float)
    )
    predicted = fit.predict(runs[columns].to_numpy(dtype=float))
    measured = runs["step_time_s"].to_numpy(dtype=float)
    points = []
    for name, p, m in zip(runs.get("check_name", runs["config_id"]), predicted, measured, strict=True):
        print(f"  step time {name}: predicted {p:.3f} s, measured {m:.3f} s ({(p - m) / m:+.1%})")
        points.append({"point": name, "predicted_s": float(p), "measured_s": float(m)})
    model = fit.model(str(runs["st_device"].iloc[0]))
    print(f"  fit (in sample, {len(runs)} points on {model.device}): " + "; ".join(model.describe()))
    return {
        "in_sample_median_ape": float(np.median(np.abs(predicted - measured) / measured)),
        "coefficients": {k: float(v) for k, v in model.coefficients.items()},
        "constant_s": model.constant_s,
        "unfitted": list(model.unfitted),
        "points": points,
    }


def write(out: Path, records: list[dict], fit: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    tmp = path.with_name(".gpu_check.json.tmp")
    tmp.write_text(json.dumps({"records": records, "step_time_fit": fit}, indent=1, default=str))
    os.replace(tmp, path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/runner_checks/gpu_check")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    out = Path(args.out)
    traces = out / "traces"
    records, failures = [], 0
    for name, overrides, expected in points():
        start = time.perf_counter()
        artifacts = {"trace_dir": traces, "write_trace": True, "memory_snapshot": False}
        record = run_point(run_spec(compose(overrides)), timeout_s=150, artifacts=artifacts)
        record["check_name"], record["check_expected"] = name, expected
        records.append(record)
        peak = record.get("peak_allocated_bytes")
        est = record.get("est_total_bytes")
        ok = record["status"] == expected
        failures += not ok
        print(
            f"{'PASS' if ok else 'FAIL'} {name}: status {record['status']} (expected {expected}); "
            f"peak {'—' if peak is None else f'{peak / GIB:.2f}'} GiB, estimate "
            f"{'—' if est is None else f'{est / GIB:.2f}'} GiB, reserved "
            f"{(record.get('peak_reserved_bytes') or 0) / GIB:.2f} GiB, "
            f"{time.perf_counter() - start:.0f} s; {record.get('error') or ''}",
            flush=True,
        )
        if record["status"] == "ok":
            try:  # one point's failed check must not lose the others' (the device time is scarce)
                failures += not check_replay(record, overrides)
                record["fake_counterpart"] = check_fake(record, overrides)
            except Exception as exc:  # reported as a failed check; the run goes on
                failures += 1
                print(f"  FAIL check raised {type(exc).__name__}: {exc}")
        write(out, records)
    fit = None
    try:
        fit = step_time_fit(records)
    except Exception as exc:  # reported; the records are written either way
        print(f"  step-time fit raised {type(exc).__name__}: {exc}")
    path = write(out, records, fit)
    print(f"{len(records) - failures}/{len(records)} as expected; records in {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
