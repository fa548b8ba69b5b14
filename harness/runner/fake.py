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
  reducer does (``Reducer::rebuild_buckets``). Collectives move no memory under the fake group.
- FSDP2 on a 2-D (dp × tp) mesh builds a concatenated DeviceMesh from real index tensors, which fails
  inside FakeTensorMode; the mesh construction runs with fake mode suspended (``_real_meshes``).
- On a GPU preset the CPU's kernels are replaced by what CUDA's save and allocate
  (:mod:`harness.runner.fake_kernels`); on ``device=cpu`` the CPU kernels are the truth.
- Not seen at all: the CUDA context, NCCL's buffers, cuBLAS/cuDNN workspaces chosen at run time. The
  caching allocator's rounding and fragmentation are modelled: MemTracker's record of the storages
  made and freed in the measured step is replayed through harness/alloc.py (``sim_*`` fields, as a real
  CPU run has), each block on the CUDA stream it would be made on: FSDP2's all-gather outputs on its
  copy-in stream, its reduce-scatter outputs on its reduce-scatter stream, the rest on the default one
  (FSDP2 enters its streams through ``torch.cpu`` here, and the tracker reads the current one:
  harness/runner/measure.py, the stream constants), so each stream's blocks stay in pools of their own.

Out of memory is judged against the device preset's capacity: status ``oom`` with ``oom_source=fake``
when the traced peak exceeds it (the trace completes either way and its peak is kept).

Cost: the distinct ranks are traced side by side, as many at a time as the CPUs and host memory allow
(``trace_jobs``); each is a fork of a parent that has already imported what a trace needs
(``_preload``), so no rank pays for the imports again. Neither changes what a rank traces: every
child starts from the same parent state, and the record lists the same ranks in the same order as
one-at-a-time tracing would (a ZeRO-1 rank is started when the first result names it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.record import finish_record, invalid_record
from harness.specs import InvalidSpec, RunSpec, canonical, config_id

log = logging.getLogger(__name__)

MEMORY_METHOD = "fake"  # issue 14: "memory_method=fake" (MemTracker under FakeTensorMode counts the peak)
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
        return run_fake(spec, timeout_s=timeout_s, cache=run.get("fake_cache"))
    return run_point(spec, timeout_s=timeout_s, task=task, artifacts=artifacts)


def rank_of(spec: RunSpec, *, stage: int, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
    """Global rank of mesh coordinates (pp, dp, cp, tp), innermost tp (compose.MESH_DIMS)."""
    p = spec.parallel
    return ((stage * p.dp + dp) * p.cp + cp) * p.tp + tp


def uneven_tp(spec: RunSpec) -> bool:
    """Whether tensor-parallel shards differ in size between tp ranks."""
    m, tp = spec.model, spec.parallel.tp
    kv_width = m.hidden_size // m.num_heads * m.num_kv_heads
    return tp > 1 and any(x % tp for x in (m.vocab_size, m.hidden_size, m.ffn_hidden_size, kv_width))


def traced_ranks(spec: RunSpec) -> list[int]:
    """The ranks traced before any ZeRO-1 partition is known: one per pipeline stage, plus the last
    tensor-parallel rank of each stage when tp shards are uneven."""
    p = spec.parallel
    ranks = [rank_of(spec, stage=s) for s in range(p.pp)]
    if uneven_tp(spec):
        ranks += [rank_of(spec, stage=s, tp=p.tp - 1) for s in range(p.pp)]
    return sorted(ranks)


def fake_problems(spec: RunSpec) -> list[str]:
    """What the fake mode cannot trace, beyond what the real runner cannot run."""
    from harness.runner.supervisor import runner_problems

    # A GPU preset is what the fake mode is for: the real runner's "needs CUDA" does not apply.
    return [x for x in runner_problems(spec) if "needs CUDA" not in x]


def run_fake(
    spec: RunSpec,
    *,
    timeout_s: float = 600.0,
    kernels: str | None = None,
    jobs: int | None = None,
    cache: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Trace every distinct rank of ``spec`` (one process each, up to ``jobs`` at a time; default
    :func:`trace_jobs`) and return the record. ``kernels``: "cuda" or "cpu" (default: cuda on a GPU
    preset, cpu on device=cpu). ``cache``: a directory of completed rank traces
    (:mod:`harness.runner.fake_cache`): a rank found there is not traced again, one traced is kept."""
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
        from harness.runner.fake_cache import TraceCache

        store = TraceCache(cache)
    results = _trace_ranks(
        spec,
        base,
        deadline=start + timeout_s,
        kernels=kernels or ("cuda" if gpu_kernels(spec) else "cpu"),
        jobs=jobs or trace_jobs(len(base)),
        cache=store,
    )
    return fake_record(spec, results, wall_s=time.monotonic() - start, timeout_s=timeout_s)


def _trace_ranks(
    spec: RunSpec, base: list[int], *, deadline: float, kernels: str, jobs: int, cache=None
) -> list[dict[str, Any]]:
    """The results of tracing ``base`` and every ZeRO-1 rank a result names, up to ``jobs`` processes at
    a time: the same list, in the same order, as tracing them one at a time, each named rank queued
    behind the rest, and stopping at the first failure (``_sequence``). After a failure only the ranks
    before it in that order are started or kept running. A rank ``cache`` (a ``TraceCache``) holds is
    taken from it; each completed trace is stored there."""
    results: dict[int, dict[str, Any]] = {}
    extras: dict[int, int | None] = {}  # traced rank → the ZeRO-1 rank its result names
    running: dict[int, tuple[Any, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="harness-fake-") as tmp:
        while True:
            order, cut = _sequence(base, extras, results)
            for rank in [r for r in running if order.index(r) >= cut]:
                _kill(running.pop(rank)[0])
            todo = [r for r in order[:cut] if r not in results and r not in running]
            reused = False
            while todo and len(running) < max(1, jobs):
                rank = todo.pop(0)
                hit = cache.load(spec, rank, kernels) if cache is not None else None
                if hit is not None:
                    log.info("fake: rank %d of %s taken from the trace cache", rank, config_id(spec))
                    # (an entry may come from the same layout with another dp: fake_cache)
                    results[rank], reused = {**hit, "rank": rank, "cached": True}, True
                    extras[rank] = _zero1_worst_rank(spec, results[rank])
                    continue
                running[rank] = _start_child(spec, rank, Path(tmp) / f"rank{rank}.json", kernels)
            if reused:
                continue  # (a reused result may name a ZeRO-1 rank: look at the order again)
            if not running:
                break
            for rank, result in _wait_any(running, deadline).items():
                results[rank] = result
                if "peak_allocated_bytes" in result:
                    extras[rank] = _zero1_worst_rank(spec, result)
                    if cache is not None:
                        cache.store(spec, rank, kernels, result)
    order, cut = _sequence(base, extras, results)
    return [results[r] for r in order[: cut + 1] if r in results]


def _sequence(
    base: list[int], extras: dict[int, int | None], results: dict[int, dict[str, Any]]
) -> tuple[list[int], int]:
    """The order one-at-a-time tracing takes (``base``, then each named ZeRO-1 rank in the order of the
    ranks that named it), as far as the results so far tell, and the index of the first failed rank
    in it (its length when none failed). Ranks already placed never move relative to each other."""
    order = list(base)
    for rank in order:  # (grows while it is walked)
        extra = extras.get(rank)
        if extra is not None and extra not in order:
            order.append(extra)
    failed = (i for i, r in enumerate(order) if r in results and "peak_allocated_bytes" not in results[r])
    return order, next(failed, len(order))


# Host memory one tracing process may take: issue 14's budget for one traced rank.
TRACE_HOST_BYTES = 4 * 2**30


def trace_jobs(n: int) -> int:
    """How many of ``n`` ranks to trace at a time: no more than this process may run on CPUs, nor than
    the host memory now available holds at ``TRACE_HOST_BYTES`` each; at least one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cpus = os.cpu_count() or 1
    memory = _available_memory_bytes()
    by_memory = n if memory is None else memory // TRACE_HOST_BYTES
    return max(1, min(n, cpus, by_memory))


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _preload() -> None:
    """Import here what every trace imports (a second or more of CPU each), so that the forked tracing
    processes find it done; importing changes nothing they trace."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


PRELOAD = (
    "torch._subclasses.fake_tensor",
    "torch.testing._internal.distributed.fake_pg",
    "torch.distributed._tools.mem_tracker",
    "harness.alloc",
    "harness.runner.fake_ddp",
    "harness.runner.fake_kernels",
    "harness.runner.measure",
    "harness.runner.model",
    "harness.runner.parallel.compose",
)


def _zero1_worst_rank(spec: RunSpec, result: dict[str, Any]) -> int | None:
    """With ZeRO-1: the rank of the same stage holding the largest optimizer partition, when it is not
    the traced one (``result["zero1_partition_numel"]`` lists every dp·cp rank's partition)."""
    sizes = result.get("zero1_partition_numel")
    if not sizes:
        return None
    worst = max(range(len(sizes)), key=lambda i: (sizes[i], -i))
    p = spec.parallel
    coords = result["coords"]
    dp, cp = divmod(worst, p.cp)  # the dp_cp group is the flattened (dp, cp) sub-mesh
    rank = rank_of(spec, stage=coords["pp"], dp=dp, cp=cp, tp=coords["tp"])
    return None if rank == result["rank"] else rank


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


def _trace_in_child(spec: RunSpec, rank: int, *, deadline: float, kernels: str | None) -> dict[str, Any]:
    """``trace_rank`` in a forked process (a fake process group is per process, and the parent's
    memory stays clean); its result, an error, or ``timed_out``."""
    with tempfile.TemporaryDirectory(prefix="harness-fake-") as tmp:
        running = {rank: _start_child(spec, rank, Path(tmp) / "rank.json", kernels)}
        while running:
            ended = _wait_any(running, deadline)
        return ended[rank]


def _start_child(spec: RunSpec, rank: int, out: Path, kernels: str | None) -> tuple[Any, Path]:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_child, args=(spec, rank, out, kernels), daemon=True)
    proc.start()
    return proc, out


def _wait_any(running: dict[int, tuple[Any, Path]], deadline: float) -> dict[int, dict[str, Any]]:
    """Wait for at least one of the ``running`` tracing processes to end (or the deadline, which ends
    them all); the results of those that ended, removed from ``running``."""
    from multiprocessing.connection import wait

    ended = wait(
        [proc.sentinel for proc, _ in running.values()], timeout=max(1.0, deadline - time.monotonic())
    )
    out = {}
    for rank, (proc, path) in list(running.items()):
        if proc.sentinel not in ended:
            if time.monotonic() < deadline:
                continue
            del running[rank]
            _kill(proc)
            out[rank] = {"rank": rank, "timed_out": True}
            continue
        del running[rank]
        proc.join()  # (it has exited: its sentinel is ready; joining reaps it and sets its exit code)
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            sig = -proc.exitcode if proc.exitcode < 0 else None
            why = f"killed by signal {signal.Signals(sig).name}" if sig else f"exit code {proc.exitcode}"
            result = {"rank": rank, "error": f"the tracing process died ({why})"}
        result["exit_code"] = proc.exitcode
        out[rank] = result
    return out


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def _child(spec: RunSpec, rank: int, out: Path, kernels: str | None) -> None:
    import resource

    from harness.runner.supervisor import write_json

    try:
        start = time.perf_counter()
        result = {"rank": rank, **trace_rank(spec, rank, kernels=kernels)}
        result["trace_s"] = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        # CPU seconds too: on a shared machine the wall time says more about the other processes.
        result["trace_cpu_s"] = usage.ru_utime + usage.ru_stime
        result["host_rss_bytes"] = usage.ru_maxrss * 1024
    except BaseException as exc:  # written as data: the parent turns it into the record's reason
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        result = {
            "rank": rank,
            "error": f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500],
            "traceback": traceback.format_exc()[-4000:],
        }
    write_json(out, result)
    os._exit(0)


def gpu_kernels(spec: RunSpec) -> bool:
    """Whether the trace stands in CUDA's kernels for the CPU's (any preset but cpu)."""
    return spec.device.name != "cpu"


def trace_rank(
    spec: RunSpec, rank: int, *, kernels: str | None = None, keep_trace: bool = False
) -> dict[str, Any]:
    """Peak memory of ``rank`` over one measured step after a warm-up step (:func:`warm_up`), traced in
    this process (which must hold no process group); ``kernels`` as in :func:`run_fake`. ``keep_trace``:
    the measured step's allocation trace (the events its ``sim_*`` figures replay) as ``trace``."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.runner import fake_kernels
    from harness.runner.measure import PeakMemory
    from harness.runner.model import Llama
    from harness.runner.parallel import compose
    from harness.runner.parallel.compose import MESH_DIMS, parallelize, train_step

    spec = canonical(spec)
    p, t = spec.parallel, spec.train
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=rank, world_size=p.world, store=FakeStore())
    cuda = gpu_kernels(spec) if kernels is None else kernels == "cuda"
    try:
        # Meshes are built outside FakeTensorMode (their construction reads real values).
        mesh = dist.device_mesh.init_device_mesh("cpu", (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=MESH_DIMS)
        if p.dp * p.cp > 1:
            mesh["dp", "cp"]._flatten("dp_cp")
        cpu = torch.device("cpu")
        kernels = fake_kernels.cuda_kernels() if cuda else contextlib.nullcontext()
        with (
            FakeTensorMode() as fake_mode,
            _real_meshes(),
            _bucketed_ddp(compose),
            _local_stage_meta(spec),
            _fake_deepcopy(fake_mode),
            _private_sharding_propagation(),
            kernels,
        ):
            model = Llama(spec.model, seq_len=t.seq_len)
            par = parallelize(model, spec, mesh, cpu)
            del model  # as the real rank does: a pipeline stage is a copy of it
            per_rank = (t.micro_batch_size * t.num_microbatches, t.seq_len // p.cp)
            tokens = torch.randint(0, spec.model.vocab_size, per_rank)
            memory = PeakMemory(par.modules, par.optimizer, cpu, allocator=False)
            warm_up(par, tokens, spec)
            with memory.measure():
                train_step(par, tokens, tokens, num_microbatches=t.num_microbatches)
        out = {
            **memory.result(),
            "memory_method": MEMORY_METHOD,
            "coords": {name: mesh[name].get_local_rank() for name in MESH_DIMS},
            "kernels": "cuda" if cuda else "cpu",
        }
        if keep_trace:
            out["trace"] = memory.trace["device_traces"][0]
        partition = _zero1_partition(par.optimizer)
        if partition is not None:
            out["zero1_partition_numel"] = partition
        return out
    finally:
        dist.destroy_process_group()


def warm_up(par, tokens, spec: RunSpec) -> None:
    """The step before the measured one. Without a pipeline it runs one micro-batch: what the measured
    step finds afterwards is what all of them leave (optimizer state made, DDP's buckets rebuilt at the
    next forward, FSDP2 initialised, every gradient freed by ``zero_grad``), at 1/num_microbatches of
    the cost (``test_one_micro_batch_warm_up_leaves_the_measured_step_unchanged``; scripts/
    fake_budget.py --compare showed every figure equal on six paper-scale points). A pipeline schedule
    is built for its micro-batch count and prepares its stages for it: it warms up on all of them."""
    from harness.runner.parallel.compose import train_step

    t = spec.train
    if par.schedule is None:
        warm = tokens[: t.micro_batch_size]
        train_step(par, warm, warm, num_microbatches=1)
    else:
        train_step(par, tokens, tokens, num_microbatches=t.num_microbatches)


def _zero1_partition(optimizer) -> list[int] | None:
    """Parameters (elements) held by each rank's ZeroRedundancyOptimizer partition; None otherwise."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return None
    return [
        sum(q.numel() for group in groups for q in group["params"])
        for groups in optimizer._partition_parameters()
    ]


@contextlib.contextmanager
def _real_meshes() -> Iterator[None]:
    """DeviceMesh concatenation (FSDP2 over a dp × tp mesh) with fake mode suspended: it builds its
    index tensor from real values, which FakeTensorMode refuses (../shared/research/torch-cpu.md 6.3)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(device_mesh_list):
        with unset_fake_temporarily():
            return original(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)


@contextlib.contextmanager
def _private_sharding_propagation() -> Iterator[None]:
    """DTensor's output-metadata propagation in a fake mode of its own, as in a real run.

    For ops without a cached rule DTensor runs the op on global-shape fake tensors
    (``ShardingPropagator._propagate_tensor_meta_non_cached``) in ``detect_fake_mode() or
    FakeTensorMode()``. In a real run that is a fresh mode, which MemTracker recognises and skips;
    in a fake run it is the trace's own mode, so MemTracker counted those global-shape tensors as
    the rank's memory: loss_parallel's FP32 log-softmax over the whole vocabulary (tiny, tp 2, s 1024,
    BF16: traced 73.7 MiB against 61.8 MiB measured on a real CPU run). With the trace's mode
    suspended the propagation makes its own, as it does in a real run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        with unset_fake_temporarily():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


@contextlib.contextmanager
def _bucketed_ddp(compose) -> Iterator[None]:
    """The composer's DDP replaced by :class:`BucketedReplica` while tracing."""
    from harness.runner.fake_ddp import apply_bucketed_replica

    original = compose.apply_ddp
    compose.apply_ddp = apply_bucketed_replica
    try:
        yield
    finally:
        compose.apply_ddp = original


def hidden_meta_dtype(spec: RunSpec):
    """The dtype of the hidden states a pipeline stage sends: BF16 under FSDP2 or ``replicate``'s
    mixed precision, FP32 under autocast (the residual stream stays FP32) and in FP32 runs."""
    import torch

    p = spec.parallel
    fsdp_like = p.dp * p.cp > 1  # with pp > 1 the runner always replicates or shards (compose)
    return torch.bfloat16 if spec.train.precision == "bf16" and fsdp_like else torch.float32


@contextlib.contextmanager
def _local_stage_meta(spec: RunSpec) -> Iterator[None]:
    """Pipeline stages without the peer ranks: the schedule's warm-up vote and its metadata exchange
    go over the process group (``recv_object_list``, a value read with ``.item()``), which the fake
    group does not carry. Every stage of the runner votes the same way (none is given shapes), so each
    stage takes its own vote, and the metadata a neighbour would send — the hidden states
    (micro-batch, s / cp [/ tp under sequence parallelism], h) forward, their gradient backward —
    is built here."""
    import torch
    from torch.distributed.pipelining import _utils as pu
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    p, t = spec.parallel, spec.train
    tokens = t.seq_len // p.cp // (p.tp if p.tp > 1 and p.sequence_parallel else 1)
    shape = (t.micro_batch_size, tokens, spec.model.hidden_size)

    def recv_meta(stage, src_stage):
        hidden = torch.empty(shape, dtype=hidden_meta_dtype(spec), requires_grad=True)
        metas = pu.extract_tensor_metas((hidden,))
        if src_stage < stage.stage_index:
            return pu._StageForwardMeta(forward_metas=metas)
        return pu._StageBackwardMeta(backward_metas=stage._stage_meta.outputs or metas)

    def warmup(schedule, stages, has_backward, p2p_done):
        for stage in stages:
            dynamic = pu.InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = pu.InferenceMode.DYNAMIC if dynamic else pu.InferenceMode.STATIC

    patches = [
        (PipelineStage, "_recv_meta", recv_meta),
        (PipelineStage, "_send_meta", lambda stage, meta, dst_stage: None),
        (schedules._PipelineSchedule, "_warmup_p2p", warmup),
    ]
    originals = [(cls, name, cls.__dict__.get(name)) for cls, name, _ in patches]
    for cls, name, fn in patches:
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for cls, name, fn in originals:
            if fn is None:
                delattr(cls, name)
            else:
                setattr(cls, name, fn)


@contextlib.contextmanager
def _fake_deepcopy(fake_mode) -> Iterator[None]:
    """``copy.deepcopy`` of a fake model (a pipeline stage is a copy, ``pipeline.split_stage``) in the
    same fake mode: a plain deepcopy converts each fake tensor into a new mode ("Mixing fake modes"),
    and ``FakeCopyMode`` returns plain fake tensors where parameters were, which are made parameters
    again."""
    import copy

    from torch import nn
    from torch._subclasses.fake_tensor import FakeCopyMode

    from harness.runner.parallel import pipeline

    def deepcopy(obj, memo=None):
        with FakeCopyMode(fake_mode):
            out = copy.deepcopy(obj, memo)
        made: dict[int, nn.Parameter] = {}  # tied weights stay one parameter
        for mod in out.modules() if isinstance(out, nn.Module) else ():
            for name, q in list(mod._parameters.items()):
                if q is not None and not isinstance(q, nn.Parameter):
                    if id(q) not in made:
                        made[id(q)] = nn.Parameter(q, requires_grad=q.requires_grad)
                    mod._parameters[name] = made[id(q)]
        return out

    class _Copy:  # the ``copy`` module as pipeline.py sees it
        def __getattr__(self, name):
            return deepcopy if name == "deepcopy" else getattr(copy, name)

    pipeline.copy = _Copy()
    try:
        yield
    finally:
        pipeline.copy = copy
