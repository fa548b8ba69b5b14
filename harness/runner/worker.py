"""One rank of one point: join the group (with a timeout), build and parallelise the model, run warm-up
and measured steps on synthetic tokens, and write this rank's numbers to ``<out_dir>/rank<r>.json``.

Runs in a process forked by the supervisor. Every expected failure is written as data (an out-of-memory
error, a Python exception with its first line); the supervisor covers what a rank cannot report itself
(a kill, a hang).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.runner.measure.cpu import start_cpu_accounting, stop_cpu_accounting
from harness.runner.measure.peak import PeakMemory, cpu_peak_tflops, start_cuda_history
from harness.runner.model import Llama
from harness.runner.parallel.compose import MESH_DIMS, parallelize, train_step
from harness.runner.parallel.context import shard_sequence
from harness.runner.procs import HOST_FAULT_EXIT, host_fault, write_json, write_trace_file
from harness.spec import RunSpec, spec_id

WARMUP_STEPS = 1  # AdamW's state appears at the first optimizer.step(): measure from the second step on
DATA_SEED = 1234
MODEL_SEED = 0


def _allocator_capacity(spec: RunSpec) -> int:
    """The card's memory less what the estimate puts outside the caching allocator: the capacity the
    step's replayed trace is judged against (harness.estimate.levels.allocator_capacity_bytes)."""
    from harness.estimate import estimate
    from harness.estimate.levels import allocator_capacity_bytes

    return allocator_capacity_bytes(estimate(spec))


def synthetic_batch(spec: RunSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch of token ids and next-token targets, identical on every rank and in the
    single-rank reference."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    n = spec.global_batch_size
    ids = torch.randint(0, spec.model.vocab_size, (n, spec.train.seq_len + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def rank_batch(
    spec: RunSpec, dp_rank: int, positions: torch.Tensor | None, device: torch.device, *, copy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's token ids and targets: its data-parallel share of the global batch, its context-
    parallel positions (``positions``), on ``device``. On the CPU they are views of the global batch
    (one storage for both where the batch is a single sequence, whose two shifted views are already
    contiguous); moved to a GPU, each is a copy of its own. ``copy``: make that copy without a GPU
    (a fake trace of a GPU preset). The real rank and its fake trace both build it here: a fake trace
    that passed one tensor as both left a 4 micro-batch pipeline's targets out of its last stage."""
    t = spec.train
    tokens, targets = synthetic_batch(spec)
    per_rank = t.micro_batch_size * t.num_microbatches
    tokens = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    targets = targets[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    if positions is not None:
        tokens, targets = shard_sequence(tokens, positions), shard_sequence(targets, positions)
    if copy:
        return tokens.clone(), targets.clone()
    return tokens.to(device), targets.to(device)


def device_for(spec: RunSpec, local_rank: int, local_world: int) -> tuple[torch.device, str]:
    """This rank's device and the process group's backend; ``local_world``: the ranks on this node."""
    if spec.device.name == "cpu":
        return torch.device("cpu"), "gloo"
    n = torch.cuda.device_count()
    if local_world <= n:  # one GPU per rank
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cuda", local_rank % n), "gloo"  # several ranks share a GPU


EMULATION_BELOW = 0.99  # a preset below this share of the physical card is another, emulated card


def emulate_capacity(spec: RunSpec, device: torch.device, local_world: int) -> dict[str, Any]:
    """Cap this process's caching allocator so that the device preset's card is emulated on a larger
    one (a 40 GB card on an H200), divided among the ranks that share the GPU; the fields that say so.

    The cap (``set_per_process_memory_fraction``) limits the allocator alone, while on the emulated
    card the CUDA context, NCCL's buffers and library handles sit in the same memory: what the device
    already uses outside the allocator when the cap is set (the context, after ``set_device``) is
    taken off the preset's capacity. NCCL's buffers, made at each communicator's first collective,
    come later and are not: the emulated card is still optimistic by them (``emulated_note``)."""
    total = torch.cuda.get_device_properties(device).total_memory
    sharing = max(1, -(-local_world // torch.cuda.device_count()))
    free, _ = torch.cuda.mem_get_info(device)
    outside = max(0, (total - free) - torch.cuda.memory_reserved(device))
    # (a preset of the card itself, rounded to its GiB figure, is not an emulation)
    emulated = spec.device.memory_bytes < EMULATION_BELOW * total
    capacity = (spec.device.memory_bytes - outside) if emulated else total
    fraction = min(1.0, capacity / total) / sharing
    if fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    return {
        "cuda_memory_fraction": fraction,
        "emulated": emulated,
        "emulated_capacity_bytes": int(fraction * total) if fraction < 1.0 else None,
        "outside_allocator_at_cap_bytes": outside,
        "physical_total_bytes": total,
        "emulated_note": "NCCL buffers made after the cap are outside it" if emulated else None,
    }


# Errors that are an out-of-memory although they are not torch.OutOfMemoryError, by the text each
# library puts in the message (issue 33): cuBLAS's and cuDNN's failed workspace allocations
# (CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_ALLOC_FAILED), NCCL's "Cuda failure 'out of memory'" when a
# communicator's buffers cannot be made, and a CUDA runtime error raised as torch.AcceleratorError
# (cudaErrorMemoryAllocation: "out of memory").
OOM_KINDS = (
    ("cublas", "CUBLAS_STATUS_ALLOC_FAILED"),
    ("cudnn", "CUDNN_STATUS_ALLOC_FAILED"),
    ("nccl", "Cuda failure 'out of memory'"),
    ("nccl", "Cuda failure: out of memory"),
    ("cuda", "CUDA error: out of memory"),
)


def oom_kind(exc: BaseException) -> str | None:
    """What ran out of memory, or None: ``torch`` (the caching allocator's OutOfMemoryError, also the
    simulated CPU one), or the library whose allocation failed (:data:`OOM_KINDS`)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "torch"
    text = str(exc)
    for kind, marker in OOM_KINDS:
        if marker in text:
            return kind
    return None


def _peaks_at_oom(device: torch.device) -> dict[str, Any]:
    """The allocator's peaks when a CUDA step ran out of memory (since the last reset: the measured
    window, or the process's start when it failed before)."""
    stats = torch.cuda.memory_stats(device)
    return {
        "memory_method": "cuda_caching_allocator",
        "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
        "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
        "peak_active_bytes": stats.get("active_bytes.all.peak", 0),
    }


def run_rank(
    rank: int,
    spec: RunSpec,
    *,
    port: int,
    out_dir: Path,
    timeout_s: float,
    master_addr: str = "127.0.0.1",
    local_rank: int | None = None,
    local_world: int | None = None,
    trace_dir: Path | None = None,
    write_trace: bool = False,
    memory_snapshot: bool = False,
) -> None:
    """The worker's entry point (never raises: the outcome is the JSON file and the exit code).
    ``rank`` is global; ``local_rank`` of ``local_world`` places it on this node (default: every rank
    on this node). ``write_trace``: write the measured step's allocation trace to ``trace_dir`` as
    ``<config_id>.rank<r>.trace.json``; ``memory_snapshot`` (CUDA): dump PyTorch's memory snapshot there
    (``<config_id>.rank<r>.snapshot.pickle``, for memory_viz) after the measured steps or at an
    out-of-memory."""
    out = out_dir / f"rank{rank}.json"
    world = spec.parallel.world
    result: dict[str, Any] = {"rank": rank}
    log = os.open(out_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # the rank's own output goes to its log, not the user's terminal
    os.dup2(log, 2)
    # A fatal signal (a C++ abort in gloo or autograd, a segfault) leaves its Python stacks in the
    # rank's log, where the record reads them (outcome._fatal_lines); an inherited handler (pytest's)
    # would write them to the parent's terminal instead.
    faulthandler.enable(file=2, all_threads=True)
    try:
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
        )
        local_rank = rank if local_rank is None else local_rank
        local_world = world if local_world is None else local_world
        # The node's cores shared among its ranks (a GPU rank's host work too: 8 ranks of 16-core
        # OpenMP pools on a 16-core node thrash).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        device, backend = device_for(spec, local_rank, local_world)
        if device.type == "cpu":
            start_cpu_accounting()  # before anything the measured step could free is allocated
        if device.type == "cuda":
            # A collective that outlives the group's timeout: abort NCCL's communicators but keep the
            # process, so the rank reports its error instead of dying by SIGABRT (outcome.NCCL_WATCHDOG).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            torch.cuda.set_device(device)
            result["device_name"] = torch.cuda.get_device_name(device)
            result.update(emulate_capacity(spec, device, local_world))
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        artifacts = _Artifacts(
            spec,
            rank,
            trace_dir if write_trace else None,
            trace_dir,
            memory_snapshot and device.type == "cuda",
        )
        if device.type == "cuda":
            start_cuda_history(stacks=artifacts.snapshot)
        result.update(_run(spec, device, artifacts))
        write_json(out, result)
        _destroy_process_group()
        os._exit(0)
    except BaseException as exc:
        kind = oom_kind(exc)
        oom = kind is not None
        on_cuda = spec.device.name != "cpu" and torch.cuda.is_initialized()
        if oom and on_cuda:
            with contextlib.suppress(Exception):  # forensics must not hide the out-of-memory itself
                result.update(_peaks_at_oom(torch.device("cuda", torch.cuda.current_device())))
        if oom and memory_snapshot and trace_dir is not None and on_cuda:
            with contextlib.suppress(Exception):
                result["memory_snapshot"] = _Artifacts(spec, rank, None, trace_dir, True).dump_snapshot("oom")
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        result.update(
            error=f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500],
            oom=oom,
            oom_kind=kind,
            traceback=traceback.format_exc()[-4000:],
        )
        if host_fault(exc):  # the machine's fault (a full TMPDIR...): the point has no outcome
            result["host_fault"] = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
        try:
            write_json(out, result)
        except OSError as unwritten:  # not even the report: the exit status says why
            os._exit(HOST_FAULT_EXIT if host_fault(unwritten) else 1)
        os._exit(HOST_FAULT_EXIT if host_fault(exc) else (3 if oom else 1))


DESTROY_TIMEOUT_S = 10.0


def _destroy_process_group() -> None:
    """Leave the process group, but never hang in it: the rank's result is written already, and a
    teardown that waits on a peer (NCCL's communicator destruction can) must not turn a finished point
    into a timeout. After ``DESTROY_TIMEOUT_S`` the rank exits anyway; the OS frees what is left."""
    import threading

    done = threading.Event()

    def destroy() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, daemon=True).start()
    done.wait(DESTROY_TIMEOUT_S)


class _Artifacts:
    """Files a rank writes beside the record on request: its allocation trace, its memory snapshot."""

    def __init__(
        self, spec: RunSpec, rank: int, trace_dir: Path | None, snapshot_dir: Path | None, snapshot: bool
    ):
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.snapshot = snapshot and self.dir is not None
        self.stem = f"{spec_id(spec)}.rank{rank}"

    def write_trace(self, trace: dict[str, Any] | None) -> str | None:
        if self.trace_dir is None or trace is None:
            return None
        return write_trace_file(self.trace_dir, self.stem, trace)

    def dump_snapshot(self, when: str) -> str | None:
        if not self.snapshot:
            return None
        path = self.dir / f"{self.stem}.{when}.snapshot.pickle"
        self.dir.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return str(path)


def _run(spec: RunSpec, device: torch.device, artifacts: _Artifacts | None = None) -> dict[str, Any]:
    p, t = spec.parallel, spec.train
    mesh = dist.device_mesh.init_device_mesh(device.type, (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=MESH_DIMS)
    torch.manual_seed(MODEL_SEED)
    # On the meta device: no memory until each rank's part is known (parallel/materialize.py).
    with torch.device("meta"):
        model = Llama(spec.model, seq_len=t.seq_len, attention=t.attention, moe_imbalance=t.moe_imbalance)
    build_start = time.perf_counter()
    par = parallelize(model, spec, mesh, device)
    del model  # (a pipeline rank's stages are copies of it)
    build_s = time.perf_counter() - build_start
    tokens, targets = rank_batch(spec, mesh["dp"].get_local_rank(), par.positions, device)

    losses: list[float] = []

    def step() -> float:
        loss = train_step(par, tokens, targets, num_microbatches=t.num_microbatches)
        return float("nan") if loss is None else loss.item()

    memory = PeakMemory(par.modules, par.optimizer, device)
    memory.capacity_bytes = _allocator_capacity(spec)
    for _ in range(WARMUP_STEPS):
        losses.append(step())
    if device.type == "cpu":
        # The CPU tracker intercepts every op in Python and slows a step 4-7x (measured on the tiny and
        # small models): one extra step is measured for memory, and the timed steps run untracked.
        with memory.measure():
            losses.append(step())
        stop_cpu_accounting()  # (its bookkeeping would slow the timed steps)
        timed = _timed_steps(step, t.steps - WARMUP_STEPS, device)
    else:  # the CUDA allocator's statistics cost nothing: the timed steps are the measured ones
        with memory.measure():
            timed = _timed_steps(step, t.steps - WARMUP_STEPS, device)
    extra: dict[str, Any] = {}
    if artifacts is not None:
        extra = {
            "trace_file": artifacts.write_trace(memory.trace),
            "memory_snapshot": artifacts.dump_snapshot("peak"),
        }
    losses += [loss for loss, _ in timed]
    times = [seconds for _, seconds in timed]
    losses = _global_losses(losses, mesh, is_last=par.is_last)
    out = {
        "coords": {name: mesh[name].get_local_rank() for name in MESH_DIMS},
        "losses": losses,
        "step_times_s": times,
        "step_time_s": statistics.median(times) if times else float("nan"),
        "build_s": build_s,
        **memory.result(),
        **{k: v for k, v in extra.items() if v is not None},
    }
    if device.type == "cpu" and dist.get_rank() == 0:
        out["cpu_peak_tflops"] = cpu_peak_tflops(torch.bfloat16 if t.precision == "bf16" else torch.float32)
    return out


def _timed_steps(step, n: int, device: torch.device) -> list[tuple[float, float]]:
    """``n`` steps, each as (loss, seconds)."""
    out = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((loss, time.perf_counter() - start))
    return out


def _global_losses(losses: list[float], mesh, *, is_last: bool) -> list[float]:
    """Every step's loss as the whole job sees it: averaged over dp·cp ranks, sent from the last stage."""
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else None
    t = torch.tensor([x if is_last else 0.0 for x in losses], dtype=torch.float64, device=device)
    if mesh["pp"].size() > 1:
        dist.all_reduce(t, group=mesh["pp"].get_group())  # only the last stage holds a non-zero value
    for dim in ("dp", "cp"):
        if mesh[dim].size() > 1:
            dist.all_reduce(t, group=mesh[dim].get_group())
            t /= mesh[dim].size()
    return t.cpu().tolist()
