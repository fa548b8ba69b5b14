"""GPU check: a few real points on one CUDA GPU, measured against the estimate, the replay and fake traces.

The commands (issue 33, item 11). Here, on the CPU, once per change of the points or of the estimator:

    bash scripts/gpu_wheels.sh                    # .whl/: hydra-core, omegaconf, antlr4 (a fallback)
    .venv/bin/python scripts/gpu_check.py --plan  # results/runner_checks/gpu_check/plan.json: commit it

On the H200 machine (the device tool's ``run``, ``carry: [".whl"]``, ``timeout_s: 420``), one line:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl/site .whl/*.whl && export PYTHONPATH=.whl/site:. && python3 scripts/gpu_check.py --out $OUT

``--plan`` composes every point and does all the CPU-side work first: the estimate's allocated, reserved
and device levels (engine torch; the paper and megatron totals beside them), a fake trace of each point
(``run.mode=fake``: its peak and its replayed reserved peak) and the CPU counterpart's trace where it is
cheap (for these points it is not: recorded with the reason). The device run reads the plan and rebuilds
each spec from its frozen dataclasses (``harness.spec.from_dict``): no Hydra there unless the plan is
missing or stale, which is what the wheels are for.

The device run, in this order, each item in a child process of its own (this process never calls into
``torch.cuda``: a CUDA context made here would poison every rank forked later, "Cannot re-initialize
CUDA in forked subprocess"; the device's name comes from the children):
1. a probe of the environment and the CUDA context: Python, torch, CUDA, cuDNN, NCCL and driver
   versions, the allocator's settings and backend, ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF``,
   the memory the context takes, the cuBLAS workspaces (forward and autograd threads), which SDPA
   kernels are enabled and which run (BF16 and FP32, with grouped-query attention);
2. an 8B-shaped BF16 point (Llama-3-8B, 2 layers) on the whole card: measured allocated, reserved and
   device-used memory beside the replay of its own allocation trace and the estimate's three levels;
3. a cut-down Llama-3-8B FSDP2 ZeRO-3 BF16 point (2 ranks sharing the one GPU);
4. an out-of-memory point: point 2's shape with the process capped as an A100 40 GB.
Points run through the project's runner (``harness.runner.supervisor.run_point``). Each item has its own
limit (its child is killed at it); an overall deadline starts no item with under 90 s left; every item
is in a ``try``; after every item the results, the children's and ranks' logs and the traces (as far as
they fit) are rewritten into one compressed file, ``$OUT/gpu_check.tar.gz`` (``--out`` or $OUT; else
results/runner_checks/gpu_check). The expected and the longest duration are printed at the start, a
short table last.
"""  # noqa: E501 (the device command above is one line, to be copied whole)

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the harness package of this checkout
    sys.path.insert(0, str(ROOT))

GIB = 2**30
PLAN = Path("results/runner_checks/gpu_check/plan.json")  # relative to the repository root
RESULT_FILE = "gpu_check.tar.gz"
DEADLINE_S = 330.0  # the whole device run, from its start (the window: 6 minutes, install included)
MIN_START_S = 90.0  # no item starts with less than this left before the deadline
KILL_GRACE_S = 10.0  # kept back from an item's limit: killing its child and packing the results
CHILD_OVERHEAD_S = 20.0  # a point child's own work beside run_point: imports, record, replay
TRACE_BYTES_KEPT = 12 * 2**20  # traces packed into the result file up to this size (16 MiB come back)
CPU_COUNTERPART_MAX_BYTES = 2 * GIB  # a CPU run of the same point is "cheap" below this estimate
PLAN_VERSION = 1

# The whole loss at once (train.loss_chunks=1): the points were sized so (8b_oom_as_a100_40gb runs out
# of 40 GB with it), before torchtitan's chunked loss became stack=torchtitan's default.
BIG = (
    "model=llama3_8b",
    "model.num_layers=2",
    "train.seq_len=4096",
    "train.precision=bf16",
    "train.steps=3",
    "train.loss_chunks=1",
)


@dataclass(frozen=True)
class Item:
    """One thing the device run does in a child process: the probe or a point."""

    name: str
    what: str
    limit_s: float  # its child is killed after this (or earlier, at the deadline)
    expected_s: float  # what it should take on an H200 machine (an order of magnitude, not a measurement)
    overrides: tuple[str, ...] = ()  # a point's config overrides (empty: the probe)
    expected: str | None = None  # a point's expected status


PROBE = Item("probe", "environment and CUDA context", limit_s=60, expected_s=15)
POINTS = (
    Item(
        "8b_bf16",
        "8B-shaped BF16, 2 layers, 1 rank, whole card",
        limit_s=120,
        expected_s=40,
        overrides=(*BIG, "train.micro_batch_size=4", "device=h200_141gb"),
        expected="ok",
    ),
    Item(
        "8b_fsdp2_zero3",
        "Llama-3-8B cut to 2 layers, FSDP2 ZeRO-3 BF16, dp 2 sharing the GPU",
        limit_s=150,
        expected_s=60,
        overrides=(
            *BIG,
            "train.micro_batch_size=2",
            "parallel.dp=2",
            "parallel.zero_stage=3",
            "device=h200_141gb",
        ),
        expected="ok",
    ),
    Item(
        "8b_oom_as_a100_40gb",
        "8b_bf16 capped as an A100 40 GB",
        limit_s=90,
        expected_s=30,
        overrides=(*BIG, "train.micro_batch_size=4", "device=a100_40gb"),
        expected="oom",
    ),
)
ITEMS = (PROBE, *POINTS)
STARTUP_S = 15.0  # the wheels' install, the interpreter, loading the plan


def time_budget(items=ITEMS) -> tuple[float, float]:
    """(expected, longest) seconds of the device run: the longest is bounded by the deadline."""
    expected = STARTUP_S + sum(i.expected_s for i in items)
    longest = min(STARTUP_S + sum(i.limit_s for i in items), DEADLINE_S + KILL_GRACE_S + STARTUP_S)
    return expected, longest


# ---------------------------------------------------------------------------------------- the plan (CPU)


def compose_spec(overrides):
    from harness.cli.config import compose, run_spec

    return run_spec(compose(list(overrides)))


def estimate_levels(spec) -> dict[str, Any]:
    """The estimate's three levels (engine torch), the reserved level with the GPU presets' default
    calibration profile (what ``estimate`` prints by default; issue 32 item 7) and the other engines'
    allocated totals, in bytes."""
    from harness.analysis.profile import load_profile
    from harness.cli.shared import DEFAULT_GPU_PROFILE
    from harness.estimate import estimate

    est = estimate(spec, engine="torch")
    profile = load_profile(Path(__file__).resolve().parents[1] / DEFAULT_GPU_PROFILE)
    return {
        "allocated_bytes": est.total_bytes,
        "reserved_bytes": est.reserved_total_bytes,
        "calibrated_reserved_bytes": profile.reserved_bytes(est),
        "device_bytes": est.device_total_bytes,
        "capacity_bytes": est.capacity_bytes,
        "fits": est.device_total_bytes <= est.capacity_bytes,
        "paper_allocated_bytes": estimate(spec, engine="paper").total_bytes,
        "megatron_allocated_bytes": estimate(spec, engine="megatron").total_bytes,
    }


FAKE_FIELDS = (
    "status",
    "error",
    "peak_allocated_bytes",
    "per_rank_peak_bytes",
    "sim_peak_allocated_bytes",
    "sim_peak_reserved_bytes",
    "sim_fragmentation_bytes",
    "fake_kernels",
    "wall_s",
)


def fake_trace(spec, *, cache: Path | None = None, timeout_s: float = 300) -> dict[str, Any]:
    """``cache``: a directory of traced ranks (the capped point's layout is the uncapped one's)."""
    from harness.runner.fake.run import run_fake

    record = run_fake(spec, timeout_s=timeout_s, cache=cache)
    return {k: record.get(k) for k in FAKE_FIELDS}


def cpu_counterpart(spec, allocated_bytes: int) -> dict[str, Any]:
    """The same point on device=cpu with its trace replayed (``sim_*``), where that is cheap."""
    if allocated_bytes > CPU_COUNTERPART_MAX_BYTES:
        return {
            "skipped": f"not cheap: the estimate is {allocated_bytes / GIB:.1f} GiB per rank (limit "
            f"{CPU_COUNTERPART_MAX_BYTES / GIB:.0f} GiB) and its steps would take hours on this CPU"
        }
    from harness.runner.supervisor import run_point
    from harness.spec import DeviceSpec

    cpu = dataclasses.replace(spec, device=DeviceSpec(name="cpu", memory_gib=1000.0))
    record = run_point(cpu, timeout_s=300)
    return {k: record.get(k) for k in ("status", "error", *FAKE_FIELDS[2:7])}


def make_plan(points=POINTS, *, fake: bool = True) -> dict[str, Any]:
    """Every point composed, estimated, fake-traced and its CPU counterpart judged: the device run's
    input."""
    from harness.runner.record import git_revision
    from harness.spec import config_id

    start = time.perf_counter()
    out = []
    cache = Path(tempfile.mkdtemp(prefix="gpu_check-fake-"))
    for p in points:
        t0 = time.perf_counter()
        spec = compose_spec(p.overrides)
        levels = estimate_levels(spec)
        entry = {
            **{k: v for k, v in dataclasses.asdict(p).items() if k != "overrides"},
            "overrides": list(p.overrides),
            "spec": dataclasses.asdict(spec),
            "config_id": config_id(spec),
            "estimate": levels,
            "fake": fake_trace(spec, cache=cache) if fake else {"skipped": "not asked"},
            "cpu_counterpart": cpu_counterpart(spec, levels["allocated_bytes"]),
        }
        entry["plan_s"] = round(time.perf_counter() - t0, 2)
        out.append(entry)
    shutil.rmtree(cache, ignore_errors=True)
    import torch

    return {
        "version": PLAN_VERSION,
        "created": datetime.date.today().isoformat(),
        "harness_revision": git_revision(),
        "planned_with": {"python": platform.python_version(), "torch": torch.__version__},
        "deadline_s": DEADLINE_S,
        "min_start_s": MIN_START_S,
        "probe": dataclasses.asdict(PROBE),
        "points": out,
        "plan_s": round(time.perf_counter() - start, 2),
    }


def write_plan(plan: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(plan, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_points(plan_path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The plan's points, each spec checked to rebuild from its dataclasses; a missing or stale plan is
    made again here when Hydra is importable (the carried wheels), else the error says what to do."""
    from harness.spec import from_dict

    try:
        plan = json.loads(plan_path.read_text())
        if plan.get("version") != PLAN_VERSION or [p["name"] for p in plan["points"]] != [
            p.name for p in POINTS
        ]:
            raise ValueError("the plan is for other points: run --plan again")
        for p in plan["points"]:
            from_dict(p["spec"])
        return plan, plan["points"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    try:
        import hydra  # noqa: F401  (the carried wheels)
    except ImportError:
        raise SystemExit(f"no usable plan at {plan_path} ({reason}) and no Hydra to make one") from None
    print(f"plan unusable ({reason}): composing the points here, without fake traces", flush=True)
    plan = make_plan(fake=False)
    return plan, plan["points"]


# ------------------------------------------------------------------------------------- the children


def child_argv(role: str, result: Path, **options: Any) -> list[str]:
    """This script as a child process (``--child probe|point``), its answer written to ``result``."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", role, "--result", str(result)]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def child_env() -> dict[str, str]:
    """The children's environment: torch.cuda.is_available() answered by NVML, which makes no CUDA
    context (the runner asks it in the process that forks the ranks: issue 33, item 1)."""
    return {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONUNBUFFERED": "1"}


def run_child(argv: list[str], *, limit_s: float, log: Path, result: Path) -> dict[str, Any]:
    """Run one child under ``limit_s`` (its whole process group killed at it) and return its answer."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its ranks too (they also die with their parent)
            proc.wait()
            return {"status": "timeout", "error": f"killed at its limit of {limit_s:.0f} s"}
    try:
        answer = json.loads(result.read_text())
    except (OSError, ValueError):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        return {
            "status": "crash",
            "error": f"child exited with {code} and no result: {lines[-1][:300] if lines else ''}",
        }
    answer.setdefault("child_exit_code", code)
    return answer


class ChildRunner:
    """Runs an item in a child process of this script; ``argv`` is injectable (tests: a fake child)."""

    def __init__(self, plan_path: Path, argv: Callable[..., list[str]] = child_argv):
        self.plan_path = plan_path
        self.argv = argv

    def __call__(self, item: Item, limit_s: float, work: Path) -> dict[str, Any]:
        result = work / f"{item.name}.result.json"
        if item is PROBE or item.name == PROBE.name:
            argv = self.argv("probe", result)
        else:
            timeout = max(10.0, limit_s - CHILD_OVERHEAD_S)
            argv = self.argv(
                "point",
                result,
                plan_file=self.plan_path,
                point=item.name,
                timeout=f"{timeout:.0f}",
                work=work,
            )
        return run_child(argv, limit_s=limit_s, log=work / "logs" / f"{item.name}.log", result=result)


# ------------------------------------------------------------------------------- the device run (parent)


def compare(point: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """The measured levels beside the replay, the fake trace and the estimate (bytes, and relative
    differences as fractions of the measurement)."""
    est, fake = point.get("estimate") or {}, point.get("fake") or {}
    replayed = (record.get("replay") or {}).get("peak_reserved_bytes")
    rows = {
        "allocated": ("peak_allocated_bytes", "allocated_bytes", "peak_allocated_bytes"),
        "reserved": ("peak_reserved_bytes", "reserved_bytes", "sim_peak_reserved_bytes"),
        "device": ("device_used_bytes", "device_bytes", None),
    }
    out: dict[str, Any] = {}
    for level, (measured_key, estimate_key, fake_key) in rows.items():
        measured = record.get(measured_key)
        entry = {
            "measured_bytes": measured,
            "estimate_bytes": est.get(estimate_key),
            "fake_bytes": fake.get(fake_key) if fake_key else None,
        }
        if level == "reserved":
            entry["calibrated_bytes"] = est.get("calibrated_reserved_bytes")
            entry["replay_bytes"] = replayed
            entry["replay_exact"] = None if not measured or replayed is None else replayed == measured
        for key in ("estimate", "calibrated", "fake", "replay"):
            value = entry.get(f"{key}_bytes")
            if measured and value is not None:
                entry[f"{key}_error"] = (value - measured) / measured
        out[level] = entry
    return out


def write_results(out: Path, results: dict[str, Any], work: Path) -> Path:
    """Rewrite the one compressed result file whole: results.json, the children's and ranks' logs, and
    the traces while they fit (atomic: a device lost mid-check leaves the last complete file)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULT_FILE
    tmp = out / f".{RESULT_FILE}.tmp"
    skipped = []
    with tarfile.open(tmp, "w:gz") as tar:
        files = sorted(p for p in work.rglob("*") if p.is_file())
        kept = 0
        for f in files:
            if f.name.endswith(".trace.json"):
                if kept + f.stat().st_size > TRACE_BYTES_KEPT:
                    skipped.append(str(f.relative_to(work)))
                    continue
                kept += f.stat().st_size
            tar.add(f, arcname=str(f.relative_to(work)))
        data = json.dumps({**results, "traces_left_out": skipped}, indent=1, default=str).encode()
        info = tarfile.TarInfo("results.json")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)
    return path


def _gib(x) -> str:
    return "—" if x is None else f"{x / GIB:.2f}"


def table(results: dict[str, Any]) -> str:
    """The short table printed last: one line per point."""
    head = (
        f"{'point':<22} {'status':<16} {'alloc meas/est':>15} {'reserved meas/replay/est/cal':>31} "
        f"{'device meas/est':>16} {'s':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results["points"]:
        c = r.get("compare") or {}
        a, v, d = c.get("allocated", {}), c.get("reserved", {}), c.get("device", {})
        status = f"{r.get('status')}" + ("" if r.get("as_expected") else f" (want {r.get('expected')})")
        lines.append(
            f"{r['name']:<22} {status:<16} "
            f"{_gib(a.get('measured_bytes')):>7}/{_gib(a.get('estimate_bytes')):<7} "
            f"{_gib(v.get('measured_bytes')):>8}/{_gib(v.get('replay_bytes'))}/"
            f"{_gib(v.get('estimate_bytes'))}/{_gib(v.get('calibrated_bytes')):<7} "
            f"{_gib(d.get('measured_bytes')):>7}/{_gib(d.get('estimate_bytes')):<8} "
            f"{r.get('elapsed_s', 0):>5.0f}"
        )
    lines.append(
        "(GiB = 2^30 B; est: engine torch, allocated / reserved / device levels; cal: reserved with the"
        " GPU presets' default profile)"
    )
    return "\n".join(lines)


def device_run(
    out: Path,
    plan: dict[str, Any],
    points: list[dict[str, Any]],
    runner: Callable[[Item, float, Path], dict[str, Any]],
    *,
    clock: Callable[[], float] = time.monotonic,
    deadline_s: float = DEADLINE_S,
    items: tuple[Item, ...] = ITEMS,
) -> dict[str, Any]:
    """The scheduling of the device run, free of CUDA: every item under its limit and the deadline,
    none started with under MIN_START_S left, each in a try, the result file rewritten after each."""
    start = clock()
    deadline = start + deadline_s
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    by_name = {p["name"]: p for p in points}
    results: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "plan": {k: plan.get(k) for k in ("version", "created", "harness_revision", "planned_with")},
        "deadline_s": deadline_s,
        "device_name": None,
        "probe": None,
        "points": [],
    }
    for item in items:
        left = deadline - clock()
        entry: dict[str, Any] = {"name": item.name, "what": item.what, "expected": item.expected}
        if left < MIN_START_S:
            entry.update(
                status="skipped", error=f"{left:.0f} s left before the deadline (< {MIN_START_S:.0f})"
            )
        else:
            limit = min(item.limit_s, left - KILL_GRACE_S)
            entry["limit_s"] = round(limit, 1)
            t0 = clock()
            try:
                record = runner(item, limit, work)
                entry.update(status=record.get("status"), record=record)
                reached = record.get("status") not in ("invalid", "skipped", "timeout")
                if reached and record.get("device_name"):  # (an invalid record names the preset)
                    results["device_name"] = results["device_name"] or record["device_name"]
            except Exception as exc:  # one item's failure must not lose the others (device time is scarce)
                entry.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            entry["elapsed_s"] = round(clock() - t0, 1)
        if item.expected is None:
            results["probe"] = entry
        else:
            entry["compare"] = compare(by_name.get(item.name, {}), entry.get("record") or {})
            entry["as_expected"] = entry.get("status") == item.expected
            results["points"].append(entry)
        results["elapsed_s"] = round(clock() - start, 1)
        path = write_results(out, results, work)
        error = entry.get("error") or (entry.get("record") or {}).get("error") or ""
        print(
            f"{item.name}: {entry.get('status')} in {entry.get('elapsed_s', 0):.0f} s "
            f"({deadline - clock():.0f} s left); {error}",
            flush=True,
        )
    results["result_file"] = str(path)
    shutil.rmtree(work, ignore_errors=True)  # everything is in the result file
    return results


def device_main(out: Path, plan_path: Path, runner=None) -> int:
    start = time.monotonic()
    expected, longest = time_budget()
    print(
        f"gpu_check: expected {expected / 60:.1f} min, at most {longest / 60:.1f} min "
        f"(deadline {DEADLINE_S:.0f} s; no item starts with under {MIN_START_S:.0f} s left)",
        flush=True,
    )
    plan, points = load_points(plan_path)
    results = device_run(out, plan, points, runner or ChildRunner(plan_path))
    probe = (results["probe"] or {}).get("record") or {}
    print(
        f"device: {results['device_name'] or probe.get('device_name')}; torch {probe.get('torch')}, "
        f"CUDA {probe.get('cuda')}, driver {probe.get('driver')}"
    )
    print(table(results))
    print(f"results in {results['result_file']} after {time.monotonic() - start:.0f} s")
    return 0 if all(p.get("as_expected") for p in results["points"]) else 1


# --------------------------------------------------------------------------- inside the child processes


def _try(fn: Callable[[], Any]) -> Any:
    """A probe's value, or its error as a string (a private torch internal missing on this version)."""
    try:
        return fn()
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"error: {type(exc).__name__}: {first}"[:300]


def _sdpa_kernels(torch) -> dict[str, Any]:
    """Which SDPA backends are enabled, and which of them run a BF16 and an FP32 grouped-query attention
    (32 query heads, 8 K/V heads) of the model's head size (issue 33, item 3)."""
    import torch.nn.functional as F

    be = torch.backends.cuda
    out: dict[str, Any] = {
        "enabled": {
            name: _try(getattr(be, f"{name}_sdp_enabled"))
            for name in ("flash", "mem_efficient", "math", "cudnn")
            if hasattr(be, f"{name}_sdp_enabled")
        }
    }
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:
        out["runs"] = f"error: {exc}"
        return out
    runs: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, 32, 256, 128, device="cuda", dtype=dtype)
        kv = torch.randn(1, 8, 256, 128, device="cuda", dtype=dtype)
        for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            backend = getattr(SDPBackend, name, None)
            if backend is None:
                continue

            def run(backend=backend, q=q, kv=kv):
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                return "ok"

            runs[f"{name.lower()}_{str(dtype).removeprefix('torch.')}_gqa"] = _try(run)
    out["runs"] = runs
    return out


def _cublas_workspaces(torch) -> dict[str, Any]:
    """Bytes the caching allocator gains at the first matmul of the forward thread and at the first of
    the autograd thread, beyond their outputs: cuBLAS's workspaces (one per handle and stream)."""
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = a @ a
    torch.cuda.synchronize()
    forward = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    before = torch.cuda.memory_allocated()
    y.sum().backward()
    torch.cuda.synchronize()
    grad = a.grad.numel() * a.grad.element_size()
    backward = torch.cuda.memory_allocated() - before - grad
    return {
        "forward_thread_bytes": forward,
        "autograd_thread_bytes": backward,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def probe() -> dict[str, Any]:
    """The environment and the CUDA context (a child process: the only place it is made)."""
    import torch

    from harness.runner.record import driver_version

    out: dict[str, Any] = {
        "status": "ok",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver_version(),  # (harness.runner.record: /proc, else nvidia-smi)
        "PYTORCH_ALLOC_CONF": os.environ.get("PYTORCH_ALLOC_CONF"),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "PYTORCH_NVML_BASED_CUDA_CHECK": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
    }
    if not torch.cuda.is_available():
        return {**out, "status": "crash", "error": "no CUDA device visible to torch"}
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    out.update(
        device_name=torch.cuda.get_device_name(0),
        device_count=torch.cuda.device_count(),
        capability=list(torch.cuda.get_device_capability(0)),
        multiprocessors=getattr(props, "multi_processor_count", None),
        total_memory_bytes=total,
        # Before any tensor: what the context (and anything else on the card) holds.
        context_used_bytes=total - free,
        cudnn=_try(torch.backends.cudnn.version),
        nccl=_try(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
        allocator_backend=_try(torch.cuda.memory.get_allocator_backend),
        # torch.cuda.memory._snapshot is private; 'allocator_settings' is absent on older versions.
        allocator_settings=_try(lambda: torch.cuda.memory._snapshot().get("allocator_settings")),
        cublas_workspace=_try(lambda: _cublas_workspaces(torch)),
        sdpa=_try(lambda: _sdpa_kernels(torch)),
    )
    free, _ = torch.cuda.mem_get_info()
    out["used_after_probe_bytes"] = total - free
    out["reserved_after_probe_bytes"] = torch.cuda.memory_reserved()
    return out


def _replay(record: dict[str, Any]) -> dict[str, Any]:
    """Each rank's own allocation trace replayed through harness.alloc from the segments it started
    with; the largest reserved peak (the measured one is the max over ranks)."""
    from harness.alloc import load_trace, replay

    files = record.get("trace_files") or []
    if not files:
        return {"error": "no trace recorded"}
    peaks = []
    for f in files:
        t0 = time.perf_counter()
        data = json.loads(Path(f).read_text())
        segments = data.get("segments") if isinstance(data, dict) else None
        r = replay(load_trace(f), initial_segments=segments or None)
        peaks.append(
            {
                "file": Path(f).name,
                "peak_reserved_bytes": r.peak_reserved_bytes,
                "peak_allocated_bytes": getattr(r, "peak_allocated_bytes", None),
                "replay_s": round(time.perf_counter() - t0, 2),
            }
        )
    top = max(peaks, key=lambda p: p["peak_reserved_bytes"])
    return {"peak_reserved_bytes": top["peak_reserved_bytes"], "ranks": peaks}


def point(plan_path: Path, name: str, timeout_s: float, work: Path) -> dict[str, Any]:
    """One point through the project's runner; the rank logs kept under ``work/<name>``."""
    from harness.runner.supervisor import run_point
    from harness.spec import from_dict

    _, points = load_points(plan_path)
    spec = from_dict(next(p for p in points if p["name"] == name)["spec"])
    keep = work / name
    kwargs: dict[str, Any] = {
        "timeout_s": timeout_s,
        "artifacts": {"trace_dir": keep / "traces", "write_trace": True, "memory_snapshot": False},
    }
    accepts = inspect.signature(run_point).parameters
    if "keep_dir" in accepts:  # the ranks' logs and numbers stay
        keep.mkdir(parents=True, exist_ok=True)
        kwargs["keep_dir"] = keep
    if "share_gpus" in accepts and spec.parallel.world > 1:  # run.share_gpus (issue 33, item 7): one GPU
        kwargs["share_gpus"] = True
    record = run_point(spec, **kwargs) or {"status": "crash", "error": "run_point returned no record"}
    if record.get("status") == "ok":
        try:
            record["replay"] = _replay(record)
        except Exception as exc:  # a trace the model refuses is a finding, not a lost point
            record["replay"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return record


def child_main(args) -> int:
    result = Path(args.result)
    if args.child == "probe":
        answer = probe()
    else:
        answer = point(Path(args.plan_file), args.point, float(args.timeout), Path(args.work))
    result.write_text(json.dumps(answer, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", action="store_true", help="compose and trace every point here; write the plan")
    ap.add_argument("--plan-file", default=str(ROOT / PLAN), help="where the plan is written and read")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / PLAN.parent))
    ap.add_argument("--child", choices=("probe", "point"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--point", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.plan:
        plan = make_plan()
        path = write_plan(plan, Path(args.plan_file))
        for p in plan["points"]:
            e, f = p["estimate"], p["fake"]
            print(
                f"{p['name']}: estimate {_gib(e['allocated_bytes'])} / {_gib(e['reserved_bytes'])} / "
                f"{_gib(e['device_bytes'])} GiB (allocated / reserved / device), fake {f.get('status')} "
                f"{_gib(f.get('peak_allocated_bytes'))} GiB, replayed reserved "
                f"{_gib(f.get('sim_peak_reserved_bytes'))} GiB; {p['plan_s']:.1f} s"
            )
        print(f"plan in {path} after {plan['plan_s']:.1f} s")
        return 0
    return device_main(Path(args.out), Path(args.plan_file))


if __name__ == "__main__":
    sys.exit(main())
