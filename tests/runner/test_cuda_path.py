"""The CUDA path, checked on the CPU (issue 33): the supervisor never initialises CUDA before it forks its
ranks, ranks are placed on the GPUs they see or refused, context parallelism keeps its tables and mask on
the queries' device, a model is built on the meta device and only each rank's shards are materialised,
out-of-memory errors of cuBLAS/cuDNN/NCCL are out-of-memory, NCCL's watchdog is a symptom, and a rank
that wrote its result never hangs in the teardown."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import in_fresh_process, spec

from harness.runner import devices, outcome, supervisor, worker
from harness.runner.model import Llama, init_key, initial_value, rope_tables
from harness.runner.parallel.materialize import materialize

H200 = {"device_count": 8, "device_name": "NVIDIA H200", "fused_gqa_fp32": True, "torch_version": "2.11"}
CUDA_ENTRY_POINTS = (
    "is_available",
    "device_count",
    "get_device_name",
    "get_device_properties",
    "init",
    "_lazy_init",
    "set_device",
    "mem_get_info",
    "current_device",
)


@pytest.fixture
def cuda_forbidden(monkeypatch):
    """Every CUDA entry point raises in this process (and in what it forks): a call from the
    supervisor fails the test. The probe's answer is an H200 node's, as a throwaway child would give."""
    calls: list[str] = []
    for name in CUDA_ENTRY_POINTS:

        def forbidden(*args, _name=name, **kwargs):
            calls.append(_name)
            raise AssertionError(f"torch.cuda.{_name} called in the supervisor")

        monkeypatch.setattr(torch.cuda, name, forbidden)
    monkeypatch.setattr(devices, "probe", lambda: dict(H200))
    return calls


def _gpu_rank(rank, spec, *, out_dir, **kwargs):
    """A rank as a CUDA worker reports one (no CUDA here): its device name and peak, loss, timing."""
    result = {
        "rank": rank,
        "device_name": "NVIDIA H200",
        "memory_method": "cuda_caching_allocator",
        "peak_allocated_bytes": 1 << 30,
        "peak_reserved_bytes": 1 << 30,
        "losses": [8.0, 7.9],
        "step_times_s": [0.1],
        "step_time_s": 0.1,
        "coords": {"pp": 0, "dp": rank, "cp": 0, "tp": 0},
        "categories": {},
        "local": [kwargs["local_rank"], kwargs["local_world"]],
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def test_a_gpu_point_runs_without_cuda_in_the_supervisor(cuda_forbidden, tmp_path):
    s = spec("tiny", "h100_80gb", parallel_dp=2, train_steps=2)
    record = supervisor.run_point(s, timeout_s=60, rank_fn=_gpu_rank, keep_dir=tmp_path)
    assert record["status"] == "ok", record["error"]
    assert record["env_device_name"] == "NVIDIA H200"  # from the ranks, not from a CUDA call here
    assert cuda_forbidden == []
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local"] for r in ranks] == [[0, 2], [1, 2]]  # one GPU each, indexed on the node


def test_without_a_gpu_a_gpu_preset_is_invalid_with_the_probes_reason(monkeypatch):
    monkeypatch.setattr(devices, "probe", lambda: {"device_count": 0, "error": "no driver"})
    record = supervisor.run_point(spec("tiny", "h100_80gb", train_steps=2), timeout_s=30)
    assert (
        record["status"] == "invalid" and "needs CUDA" in record["error"] and "no driver" in record["error"]
    )


def test_the_probe_answers_from_a_child_and_this_process_stays_cuda_clean():
    devices.probe.cache_clear()
    try:
        found = devices.probe()
    finally:
        devices.probe.cache_clear()
    assert found["device_count"] == 0 and found["torch_version"] == torch.__version__  # (a CPU wheel)
    assert not torch.cuda.is_initialized()


def test_fp32_grouped_query_attention_without_a_fused_kernel_is_refused(monkeypatch):
    monkeypatch.setattr(devices, "probe", lambda: {**H200, "fused_gqa_fp32": False})
    gqa = spec("tiny", "h100_80gb", train_precision="fp32")  # tiny: 4 heads, 2 KV heads
    (problem,) = supervisor.device_problems(gqa)
    assert "no fused SDPA kernel of torch 2.11" in problem and "train.precision=bf16" in problem
    assert supervisor.device_problems(spec("tiny", "h100_80gb", train_precision="bf16")) == []
    assert (
        supervisor.device_problems(spec("tiny", "h100_80gb", train_precision="fp32", train_attention="math"))
        == []
    )
    monkeypatch.setattr(devices, "probe", lambda: dict(H200))
    assert supervisor.device_problems(gqa) == []


def test_ranks_are_placed_on_the_gpus_their_task_sees():
    place = devices.placement
    # Every GPU of the node visible: the node-local index.
    assert place(node_world=8, task_ranks=4, first_local=4, visible=8, share=False, pp=2) == (4, 8)
    # Slurm's per-task binding (one task per GPU, each sees one): indexed within the task.
    assert place(node_world=8, task_ranks=1, first_local=3, visible=1, share=False, pp=2) == (0, 1)
    # The paper's H100 study: 8 ranks a node where the preset says 4 GPUs: refused unless asked for.
    refused = place(node_world=8, task_ranks=8, first_local=0, visible=4, share=False, pp=1)
    assert isinstance(refused, str) and "run.share_gpus=true" in refused
    assert place(node_world=8, task_ranks=8, first_local=0, visible=4, share=True, pp=1) == (0, 8)
    never = place(node_world=8, task_ranks=8, first_local=0, visible=4, share=True, pp=2)
    assert isinstance(never, str) and "pipelining" in never


def test_a_point_whose_ranks_outnumber_the_gpus_is_invalid_unless_shared(cuda_forbidden, monkeypatch):
    monkeypatch.setattr(devices, "probe", lambda: {**H200, "device_count": 1})
    s = spec("tiny", "h100_80gb", parallel_dp=2, train_steps=2)
    record = supervisor.run_point(s, timeout_s=60, rank_fn=_gpu_rank)
    assert record["status"] == "invalid" and "share_gpus" in record["error"]
    shared = supervisor.run_point(s, timeout_s=60, rank_fn=_gpu_rank, share_gpus=True)
    assert shared["status"] == "ok", shared["error"]


def _context_parallel_rows() -> dict:
    from harness.runner.parallel.context import AllGatherKVAttention, local_positions

    with torch.device("meta"):
        model = Llama(spec("tiny").model, seq_len=64)
    attn = model.layers["0"].attention
    mine = local_positions(64, rank=1, cp=2, load_balance=True)  # CPU indices
    attn.positions = mine
    attn.reset_rope()  # on the meta device: no index across devices
    out = {"meta_rows": attn.rope_cos.is_meta and tuple(attn.rope_cos.shape) == (32, attn.head_dim)}
    materialize([model], torch.device("cpu"), spec("tiny").model)
    cos, _ = rope_tables(64, attn.head_dim)
    out["rows"] = torch.equal(attn.rope_cos, cos[mine])  # recomputed for the rank's rows, on its device
    core = AllGatherKVAttention(None, mine, torch.arange(64), kernel="flash")
    out["mask_moved"] = core.mask(torch.device("meta")).is_meta  # moved to the queries' device once
    return out


def test_context_parallel_rows_and_mask_follow_the_device():
    # (torch work in a fresh process: OpenMP threads left here would hang the ranks later tests fork)
    assert in_fresh_process(_context_parallel_rows) == {"meta_rows": True, "rows": True, "mask_moved": True}


def _weights_by_name() -> list[str]:
    m = spec("tiny").model
    with torch.device("meta"):
        meta = Llama(m, seq_len=32)
    materialize([meta], torch.device("cpu"), m)
    again = Llama(m, seq_len=32)
    materialize([again.to("meta")], torch.device("cpu"), m)
    wrong = []
    for (name, a), (_, b) in zip(meta.named_parameters(), again.named_parameters(), strict=True):
        whole = initial_value(m, name, tuple(a.shape), seed=0, device=torch.device("cpu"))
        if not (torch.equal(a, b) and torch.equal(a, whole)):
            wrong.append(name)
    # A tied head stays the embedding's parameter (to_empty from meta registers new ones per module).
    tied_spec = dataclasses.replace(m, tie_embeddings=True)
    with torch.device("meta"):
        tied = Llama(tied_spec, seq_len=32)
    materialize([tied], torch.device("cpu"), tied_spec)
    if tied.output.weight is not tied.tok_embeddings.weight:
        wrong.append("output.weight is no longer tok_embeddings.weight")
    return wrong


def test_materialised_weights_are_a_function_of_the_parameter_name():
    assert in_fresh_process(_weights_by_name) == []
    assert init_key("layers.0._checkpoint_wrapped_module.attention.wq.weight", tied=False) == (
        "layers.0.attention.wq.weight"
    )
    assert init_key("module.output.weight", tied=True) == "tok_embeddings.weight"


def _shard_sizes(rank, spec, *, port, out_dir, **kwargs):
    """A rank that builds the model on meta and parallelises it (dp 2, ZeRO-3): what it holds."""
    import torch.distributed as dist

    from harness.runner.parallel.compose import MESH_DIMS, parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    p = spec.parallel
    mesh = dist.device_mesh.init_device_mesh("cpu", (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=MESH_DIMS)
    with torch.device("meta"):
        model = Llama(spec.model, seq_len=spec.train.seq_len)
    whole = sum(q.numel() for q in model.parameters())
    par = parallelize(model, spec, mesh, torch.device("cpu"))
    local = sum(q.to_local().numel() for mod in par.modules for q in mod.parameters())
    meta = any(q.is_meta for mod in par.modules for q in mod.parameters())
    (Path(out_dir) / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "whole": whole, "local": local, "meta": meta})
    )
    dist.destroy_process_group()
    os._exit(0)


def test_a_zero3_rank_materialises_only_its_shards(tmp_path):
    s = spec("tiny", parallel_dp=2, parallel_zero_stage=3, train_precision="fp32", train_steps=2)
    supervisor.run_point(s, timeout_s=120, rank_fn=_shard_sizes, keep_dir=tmp_path)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert not got["meta"] and got["local"] <= got["whole"] // 2 + 1024  # (dim-0 chunks of each)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "torch"),
        (
            RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
            "cublas",
        ),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), "cudnn"),
        (
            RuntimeError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nLast error:\nCuda failure "
                "'out of memory'"
            ),
            "nccl",
        ),
        (
            RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
            "cuda",
        ),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), None),
    ],
)
def test_out_of_memory_of_every_library_is_an_oom(error, kind):
    assert worker.oom_kind(error) == kind


def _write(out_dir: Path, rank: int, result: dict | None, log: str = "") -> None:
    if result is not None:
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **result}))
    (out_dir / f"rank{rank}.log").write_text(log)


def _task_outcome(codes: list, *, killed: list, timed_out: bool, wall_s: float) -> dict:
    """One task's outcome as the supervisor returns it (harness.runner.supervisor), for ranks 0..n-1."""
    return {
        "task": 0,
        "host": "h",
        "ranks": list(range(len(codes))),
        "codes": codes,
        "killed": killed,
        "timed_out": timed_out,
        "host_oom_kills": 0,
        "started": time.time(),
        "wall_s": wall_s,
    }


def test_a_rank_aborted_by_nccls_watchdog_is_a_symptom_of_the_hung_peer(tmp_path):
    # Rank 1 waited in an all-reduce for rank 0, which never came; NCCL's watchdog aborted rank 1
    # (SIGABRT, no result file); the supervisor killed rank 0 at its deadline.
    _write(tmp_path, 0, None)
    watchdog = (
        "[rank1]:[E1204 10:00:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=240000) "
        "ran for 240012 milliseconds before timing out."
    )
    _write(tmp_path, 1, None, log=f"some output\n{watchdog}\nterminate called\n")
    outcomes = [_task_outcome([None, -signal.SIGABRT], killed=[0], timed_out=True, wall_s=300.0)]
    s = spec("tiny", parallel_dp=2, train_precision="fp32", train_steps=2)
    record = outcome.point_record(s, tmp_path, outcomes, 300.0, count=1)
    assert record["status"] == "timeout" and record["error_rank"] == 0
    assert "rank 0 never arrived at a collective" in record["error"] and "Watchdog" in record["error"]


def test_the_process_group_times_out_well_before_the_point():
    assert supervisor.process_group_timeout(300) == 240
    assert supervisor.process_group_timeout(60) == 30
    assert supervisor.process_group_timeout(10) == 5


def test_a_rank_never_hangs_in_the_teardown(monkeypatch):
    import torch.distributed as dist

    release = threading.Event()  # a hung teardown, ended after the check: no thread left behind
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(3600))
    monkeypatch.setattr(worker, "DESTROY_TIMEOUT_S", 0.2)
    start = time.monotonic()
    try:
        worker._destroy_process_group()
        assert time.monotonic() - start < 2
    finally:
        release.set()


def test_an_emulated_card_leaves_room_for_what_sits_beside_the_allocator(monkeypatch):
    total, context = 141 * 2**30, 600 * 2**20
    caps = []

    class Props:
        total_memory = total

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total - context, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: caps.append(f))
    got = worker.emulate_capacity(spec("tiny", "a100_40gb"), torch.device("cuda", 0), 1)
    assert got["emulated"] and caps == [got["cuda_memory_fraction"]]
    assert got["cuda_memory_fraction"] == pytest.approx((40 * 2**30 - context) / total)
    assert got["outside_allocator_at_cap_bytes"] == context
    full = worker.emulate_capacity(spec("tiny", "h200_141gb"), torch.device("cuda", 0), 1)
    assert not full["emulated"] and full["cuda_memory_fraction"] == 1.0 and len(caps) == 1


def test_torchrun_ranks_take_their_node_local_gpu(monkeypatch, tmp_path):
    from harness.runner import torchrun_entry
    from harness.spec import canonical

    seen = {}
    monkeypatch.setattr(torchrun_entry, "run_rank", lambda rank, spec, **kw: seen.update(rank=rank, **kw))
    path = tmp_path / "spec.json"

    path.write_text(json.dumps(dataclasses.asdict(canonical(spec("tiny", parallel_dp=2)))))
    env = {"RANK": "9", "WORLD_SIZE": "16", "MASTER_PORT": "1234", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}
    monkeypatch.setattr(os, "environ", {**os.environ, **env})
    monkeypatch.setattr("sys.argv", ["x", str(path), str(tmp_path), "60"])
    torchrun_entry.main()
    assert seen["rank"] == 9 and seen["local_rank"] == 1 and seen["local_world"] == 8


def test_a_rank_that_aborted_on_a_lost_peer_is_not_blamed_over_the_rank_that_raised(tmp_path):
    # Seen in a suite run: rank 3 raised; rank 1, waiting for it in gloo, aborted (SIGABRT, no result)
    # and was blamed because it was "killed".
    _write(tmp_path, 0, {"error": "RuntimeError: Connection closed by peer"})
    _write(tmp_path, 1, None, log="terminate called after throwing an instance of 'gloo::IoException'\n")
    _write(tmp_path, 2, {"error": "RuntimeError: Connection closed by peer"})
    _write(tmp_path, 3, {"error": "RuntimeError: injected on rank 3"})
    outcomes = [_task_outcome([1, -signal.SIGABRT, 1, 1], killed=[], timed_out=False, wall_s=3.0)]
    s = spec("tiny", parallel_dp=4, train_precision="fp32", train_steps=2)
    record = outcome.point_record(s, tmp_path, outcomes, 60.0, count=1)
    assert record["status"] == "crash" and record["error_rank"] == 3
    assert record["error"] == "RuntimeError: injected on rank 3"
