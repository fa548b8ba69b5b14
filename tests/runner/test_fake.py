"""`harness run run.mode=fake`: which ranks are traced, the record, every layout the runner supports, and
CUDA's kernels' memory where it differs from the CPU's (harness/runner/fake/kernels.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import weakref

import pytest
from conftest import (
    fast_few,
    harness_cli,
    in_fresh_process,
    ok_trace,
    scripted_tracing,
    spec,
    trace_all,
    trace_one,
)

from harness.runner.fake.ranks import _zero1_worst_rank, rank_of, traced_ranks, uneven_tp
from harness.runner.fake.run import fake_record, run_fake
from harness.runner.fake.trace import MEMORY_METHOD
from harness.spec import canonical

MIB = 2**20


# --- which ranks ---------------------------------------------------------------------------------


def test_one_traced_rank_per_pipeline_stage():
    # mesh (pp, dp, cp, tp) = (4, 2, 1, 2): stage s starts at rank s·dp·cp·tp = 4s.
    s = spec("small", parallel_pp=4, parallel_dp=2, parallel_tp=2, train_num_microbatches=4)
    assert traced_ranks(s) == [0, 4, 8, 12]
    assert rank_of(s, stage=1, dp=1, tp=1) == 4 + 2 + 1


def test_uneven_tensor_parallel_shards_add_the_last_tp_rank():
    s = spec("tiny", parallel_tp=2)
    assert not uneven_tp(s)
    odd = dataclasses.replace(s, model=dataclasses.replace(s.model, vocab_size=4097))
    assert uneven_tp(odd)
    assert traced_ranks(odd) == [0, 1]  # tp rank 0 and tp rank 1 of the one stage


def test_zero1_traces_the_rank_with_the_largest_partition():
    s = spec("tiny", parallel_dp=4, parallel_zero_stage=1)
    coords = {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    # dp rank 2 holds the most parameters: it is traced too; when rank 0 holds the most, nothing is added.
    assert _zero1_worst_rank(s, {"rank": 0, "coords": coords, "zero1_partition_numel": [5, 6, 9, 6]}) == 2
    assert _zero1_worst_rank(s, {"rank": 0, "coords": coords, "zero1_partition_numel": [9, 6, 9, 6]}) is None


# --- the record ----------------------------------------------------------------------------------


def _traced(rank, peak):
    return {"rank": rank, "peak_allocated_bytes": peak, "memory_method": MEMORY_METHOD, "categories": {}}


def test_record_over_capacity_is_a_fake_oom_with_its_peak_and_no_timing():
    s = spec("tiny")  # device cpu: 1 GiB
    row = fake_record(s, [_traced(0, 2 * 2**30)], wall_s=1.0, timeout_s=10)
    assert (row["status"], row["oom_source"], row["peak_allocated_bytes"]) == ("oom", "fake", 2 * 2**30)
    assert "step_time_s" not in row and "mfu" not in row
    ok = fake_record(s, [_traced(0, 3 * MIB), _traced(4, 5 * MIB)], wall_s=1.0, timeout_s=10)
    assert (ok["status"], ok["worst_rank"], ok["fake_traced_ranks"]) == ("ok", 4, [0, 4])


def test_an_untraceable_rank_makes_the_point_invalid_with_the_reason():
    row = fake_record(spec("tiny"), [{"rank": 0, "error": "RuntimeError: boom"}], wall_s=1.0, timeout_s=10)
    assert row["status"] == "invalid"
    assert "fake mode cannot trace rank 0: RuntimeError: boom" in row["error"]


def test_layouts_the_runner_refuses_are_invalid_before_tracing():
    s = spec("tiny", parallel_pp=2, parallel_dp=2, parallel_zero_stage=1, train_num_microbatches=2)
    row = run_fake(s)
    assert row["status"] == "invalid" and "zero_stage 1" in row["error"]


def test_harness_run_fake_prints_a_normal_row():
    out = harness_cli(
        "run", "run.mode=fake", "model=tiny", "parallel.dp=2", "parallel.zero_stage=3", "format=json"
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert (row["status"], row["memory_method"], row["fake_traced_ranks"]) == ("ok", MEMORY_METHOD, [0])
    # FSDP: the FP32 shard, 4 B × n / 2; the engine counts the rotary tables (buffers) with params.
    assert row["mem_params_bytes"] + row["mem_buffers_bytes"] == row["est_params_bytes"]
    assert "step_time_s" not in row
    # The traced storages, replayed through the caching-allocator model, as a real CPU run's are: the
    # same requests rounded to 512 B (within 1 % of MemTracker's peak), in segments that hold them.
    assert (
        row["peak_allocated_bytes"] <= row["sim_peak_allocated_bytes"] <= 1.01 * row["peak_allocated_bytes"]
    )
    assert row["sim_peak_reserved_bytes"] - row["sim_peak_allocated_bytes"] <= row["sim_fragmentation_bytes"]
    assert row["sim_peak_reserved_bytes"] >= row["sim_peak_allocated_bytes"]
    bad = harness_cli("run", "run.mode=dream", "model=tiny")
    assert bad.returncode == 2 and "run.mode" in bad.stderr


# --- every layout ----------------------------------------------------------------------------------

LAYOUTS = {
    "ddp": {"parallel_dp": 2, "parallel_zero_stage": 0},
    "ddp_zero1": {"parallel_dp": 2, "parallel_zero_stage": 1},
    "ddp_tp": {"parallel_dp": 2, "parallel_tp": 2, "parallel_zero_stage": 0},
    "fsdp_dp_tp": {"parallel_dp": 2, "parallel_tp": 2, "parallel_zero_stage": 3},
    "fsdp_dp_cp": {"parallel_dp": 2, "parallel_cp": 2, "parallel_zero_stage": 2},
    "cp_balanced": {"parallel_cp": 2, "parallel_cp_load_balance": True},
    "pp_1f1b_dp": {"parallel_pp": 2, "parallel_dp": 2, "train_num_microbatches": 2},
    "pp_gpipe": {"parallel_pp": 2, "parallel_pp_schedule": "gpipe", "train_num_microbatches": 2},
    "pp_interleaved": {
        "parallel_pp": 2,
        "parallel_pp_schedule": "interleaved_1f1b",
        "parallel_virtual_stages": 2,
        "train_num_microbatches": 2,
    },
    # Megatron's uniform method: groups of blocks under one checkpoint, inside FSDP2's per-block units
    "fsdp_recompute_uniform": {
        "parallel_dp": 2,
        "parallel_zero_stage": 3,
        "train_recompute": "full",
        "train_recompute_every": 2,
        "train_recompute_method": "uniform",
    },
}


FAST = ("ddp", "fsdp_dp_tp", "pp_1f1b_dp")  # the rest (each 6-25 s here) run with -m slow


@pytest.mark.parametrize("name", fast_few(LAYOUTS, FAST))
def test_every_runner_layout_is_traced(name):
    s = spec("tiny", train_seq_len=128, **LAYOUTS[name])
    row, ranks = trace_all(s)
    assert row["status"] == "ok", row["error"]
    assert [r["coords"]["pp"] for r in ranks] == list(range(s.parallel.pp))
    # Every rank holds optimizer state (DDP + TP's parameters, swapped to local tensors by
    # _pre_dp_module_transform, are counted as "other" rather than "params", as in a real CPU run).
    assert all(r["categories"]["optimizer"] > 0 for r in ranks)
    assert all(r["peak_allocated_bytes"] > r["categories"]["optimizer"] for r in ranks)
    if name == "ddp_zero1":
        assert len(ranks[0]["zero1_partition_numel"]) == 2


TIED = {
    # Llama-3.2-1B and 3B tie the head to the embedding: before issue 30 a pipeline layout of a tied
    # model could not be traced at all (the tied group read the mesh's real rank tensor under fake
    # mode) and tp × ZeRO-1 met a head untied from its embedding (torch's DDP transform).
    "tied_pp": {"parallel_pp": 2, "train_num_microbatches": 2},
    "tied_tp_zero1": {"parallel_tp": 2, "parallel_dp": 2, "parallel_zero_stage": 1},
}


@pytest.mark.parametrize("name", fast_few(TIED, ["tied_pp"]))
def test_tied_layouts_are_traced_as_the_real_run_measures_them(name):
    from harness.runner.supervisor import run_point

    s = spec("tiny", train_precision="fp32", train_seq_len=128, **TIED[name])
    s = canonical(dataclasses.replace(s, model=dataclasses.replace(s.model, tie_embeddings=True)))
    row, ranks = trace_all(s)
    assert row["status"] == "ok", row["error"]
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    for r in ranks:  # each traced rank against the same rank of the real run
        assert r["peak_allocated_bytes"] == pytest.approx(real["per_rank_peak_bytes"][r["rank"]], rel=0.01)


def test_ddp_buckets_are_the_gradients_and_are_rebuilt_once():
    from harness.runner.fake.ddp import BUCKET_CAP_BYTES, _group, initial_buckets

    class P:  # a parameter's size and dtype are all the assignment reads
        def __init__(self, n, dtype="fp32"):
            self.n, self.dtype = n, dtype

        def numel(self):
            return self.n

        def element_size(self):
            return 4

    params = [P(n) for n in (1000, 300_000, 4 * MIB, 7 * MIB, 10)]
    # Before the rebuild: one bucket per dtype, in reverse order (torch 2.13 DDP without
    # find_unused_parameters: initial size limit sys.maxsize).
    assert initial_buckets(params) == [[4, 3, 2, 1, 0]]
    assert initial_buckets([P(1), P(2, "bf16"), P(3, "bf16")]) == [[2, 1], [0]]
    # The rebuild, in gradient-ready order, closes a bucket once it reaches 25 MiB.
    assert _group([3, 2, 4, 1, 0], params) == [[3], [2, 4, 1, 0]]
    assert 7 * MIB * 4 >= BUCKET_CAP_BYTES > 4 * MIB * 4


@pytest.mark.slow
def test_ddp_fake_run_matches_the_real_rank():
    """The explicit buckets against the real reducer: a real CPU run's allocator peak (which sees the
    C++ buckets) and the fake run of the same point."""
    from harness.runner.dryrun import dry_run_peak
    from harness.runner.supervisor import run_point

    s = spec("small", train_precision="fp32", train_seq_len=256, train_micro_batch_size=2, parallel_dp=2)
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    fake = in_fresh_process(dry_run_peak, s)["peak_allocated_bytes"]
    assert fake == pytest.approx(real["per_rank_peak_bytes"][0], rel=0.03)


def test_fake_math_attention_is_traced_as_math_and_matches_the_real_rank():
    """Issue 33 item 10: the fake trace built its model without ``train.attention``, so a math point was
    traced as flash. The math kernel materialises the (seq x seq) scores per head (tiny, seq 256: 4 heads
    x 256² x 4 B = 1 MiB a layer, saved for backward) where flash keeps only its output and log-sum-exp,
    so the two traces differ; the math trace agrees with the real CPU run within the 3 % of the DDP
    fake-vs-real test above."""
    from harness.runner.dryrun import dry_run_peak
    from harness.runner.supervisor import run_point

    math_spec = spec("tiny", train_precision="fp32", train_seq_len=256, train_attention="math")
    flash = in_fresh_process(dry_run_peak, spec("tiny", train_precision="fp32", train_seq_len=256))
    fake = in_fresh_process(dry_run_peak, math_spec)["peak_allocated_bytes"]
    assert fake > flash["peak_allocated_bytes"]
    real = run_point(math_spec, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    assert fake == pytest.approx(real["per_rank_peak_bytes"][0], rel=0.03)


# --- CUDA's kernels (fake_kernels.py), each difference pinned --------------------------------------


def _saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd saves while ``fn(*inputs)`` runs forward."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return sum(seen.values()), out


class _Live:
    """Live bytes of the storages created under it (fake tensors included) and their peak."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        live, state = {}, {"now": 0, "peak": 0}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in live:
                        st = t.untyped_storage()
                        live[st._cdata] = st.nbytes()
                        state["now"] += st.nbytes()
                        state["peak"] = max(state["peak"], state["now"])
                        weakref.finalize(
                            st, lambda k=st._cdata: state.__setitem__("now", state["now"] - live.pop(k))
                        )
                return out

        self.mode, self.state = Mode(), state


def test_rms_norm_saves_the_input_and_fp32_rstd_on_cuda_not_two_fp32_copies():
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.runner.fake.kernels import cuda_kernels

    s, h = 64, 128
    with FakeTensorMode():
        x = torch.empty(1, s, h, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(h, dtype=torch.bfloat16, requires_grad=True)
        cpu, _ = _saved_bytes(lambda: F.rms_norm(x, (h,), w, 1e-5))
        with cuda_kernels():
            cuda, out = _saved_bytes(lambda: F.rms_norm(x, (h,), w, 1e-5))
            out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    # CUDA (_fused_rms_norm): input 2 B·s·h + rstd 4 B·s + weight 2 B·h.
    assert cuda == 2 * s * h + 4 * s + 2 * h
    # CPU composite: FP32 upcast input and FP32 normalised tensor (4 + 4 B·s·h), rstd, weight.
    assert cpu == 8 * s * h + 4 * s + 2 * h


def test_flash_attention_saves_what_cpu_flash_saves_plus_philox_state():
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.runner.fake.kernels import cuda_kernels

    b, hq, hk, s, d = 1, 8, 2, 256, 64
    with FakeTensorMode():
        q = torch.empty(b, hq, s, d, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(b, hk, s, d, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(b, hk, s, d, dtype=torch.bfloat16, requires_grad=True)

        def attn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def backward_peak(kernels) -> int:
            with kernels:
                out = attn()
                grad = torch.empty_like(out)
                live = _Live()
                with live.mode:
                    out.backward(grad)
            return live.state["peak"]

        cpu, _ = _saved_bytes(attn)
        with cuda_kernels():
            cuda, _ = _saved_bytes(attn)
        cpu_bwd = backward_peak(contextlib.nullcontext())
        cuda_bwd = backward_peak(cuda_kernels())
    # Both: q, k, v, out (bf16) and the FP32 logsumexp (b, hq, s); CUDA adds rng_state (16 B) + unused (8 B).
    both = 2 * (2 * b * hq * s * d + 2 * b * hk * s * d) + 4 * b * hq * s
    assert cpu == both
    assert cuda == both + 16 + 8
    # Flash's mha_bwd workspace beside dq, dk, dv: softmax_d FP32 (b, hq, 256), dq_accum FP32
    # (b, 256, hq, 64) and the GQA-expanded dk, dv (b, s, hq, d) in bf16; the CPU kernel has none.
    workspace = 4 * b * hq * 256 + 4 * b * 256 * hq * 64 + 2 * 2 * b * s * hq * d
    grads = 2 * (b * hq * s * d + 2 * b * hk * s * d)
    grad_out_copy = 2 * b * hq * s * d  # the incoming gradient, made contiguous for the (b, s, h, d) output
    assert cuda_bwd == grads + grad_out_copy + workspace
    assert cpu_bwd < cuda_bwd - workspace // 2


def test_foreach_adamw_step_allocates_one_fp32_copy_of_the_states_on_either_device():
    """No CUDA difference: the same _multi_tensor_adam runs; its one large intermediate is
    _foreach_sqrt(exp_avg_sq) (harness/estimate/buffers.py optimizer_step)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(1000, 100)) for _ in range(3)]
        opt = torch.optim.AdamW(params, foreach=True)
        for q in params:
            q.grad = torch.empty_like(q)
        opt.step()  # the states appear
        live = _Live()
        with live.mode:
            opt.step()
    # 3 × 1000·100 FP32 elements = 1.2 MB, plus the step counters' scalars.
    assert 4 * 300_000 <= live.state["peak"] < 4 * 300_000 + 4096


def test_bf16_loss_upcast_is_the_same_with_cuda_kernels():
    """The loss is FP32 by code (compose.loss_fn), not by kernel: 12 B per logit at its backward
    (saved FP32 log-softmax, the FP32 gradient of it, the FP32 gradient of the upcast logits)."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.runner.fake.kernels import cuda_kernels
    from harness.runner.parallel.compose import loss_fn

    s, v = 128, 1000
    peaks = []
    for kernels in (False, True):
        with FakeTensorMode():
            logits_in = torch.empty(1, s, 64, dtype=torch.bfloat16, requires_grad=True)
            w = torch.empty(v, 64, dtype=torch.bfloat16, requires_grad=True)
            tgt = torch.randint(0, v, (1, s))
            live = _Live()
            kernels_cm = cuda_kernels() if kernels else contextlib.nullcontext()
            with kernels_cm, live.mode:
                loss_fn(F.linear(logits_in, w), tgt).backward()
            peaks.append(live.state["peak"])
    assert peaks[0] == peaks[1]
    assert peaks[0] >= 12 * s * v


def test_torch_engine_counts_cuda_fused_rms_norm_on_gpu_presets():
    """Issue 14's 8B gap: the engine counted the CPU composite norm's two tensors per norm on GPUs.
    Llama-3-8B, s 8192, b 1, BF16: per layer 2 B · s·h · (12 + 4k/a + 8f/h) = 2 · 33,554,432 ·
    (12 + 1 + 28)/2 = 41 B per s·h (ESTIMATOR.md 3's 41.0) on a GPU, and the rotary tables (2 · s ·
    head_dim in BF16); on the CPU the composite norm keeps two FP32 tensors per norm where CUDA's fused
    kernel keeps its BF16 input: 2 norms × (4 + 4 − 2) = 12 B per s·h more."""
    from harness.estimate import estimate

    kw = {"parallel_dp": 8, "parallel_zero_stage": 3, "train_seq_len": 8192, "train_precision": "bf16"}
    gpu = estimate(spec("llama3_8b", "h100_94gb", **kw)).worst.terms["activations"]
    cpu = estimate(spec("llama3_8b", "cpu", **kw)).worst.terms["activations"]
    sh = 8192 * 4096
    rope = 2 * 2 * 8192 * 128
    assert gpu == 32 * (41 * sh + rope)
    assert cpu - gpu == 32 * 12 * sh


@pytest.mark.slow
def test_cpu_and_cuda_kernels_differ_by_the_norms_on_a_moderate_point():
    """Llama-3-8B cut to 2 layers, dp 8, ZeRO-3, s 8192, BF16 (7 s per trace here): the CPU kernels'
    trace holds 12 B per s·h per layer more (two norms × (FP32 upcast + FP32 normalised − BF16 input)
    = 2 × (4 + 4 − 2)), plus the final norm's 6 B per s·h."""
    s = spec("llama3_8b", "h100_94gb", parallel_dp=8, parallel_zero_stage=3, train_seq_len=8192)
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, num_layers=2))
    cpu = in_fresh_process(_trace_kernels, s, "cpu")
    cuda = in_fresh_process(_trace_kernels, s, "cuda")
    sh = 8192 * 4096
    assert cpu - cuda == pytest.approx((2 * 12 + 6) * sh, rel=0.01)


def _trace_kernels(s, kernels):
    from harness.runner.fake.trace import trace_rank

    return trace_rank(s, 0, kernels=kernels)["peak_allocated_bytes"]


def test_torch_engine_holds_the_fp32_gradient_of_the_upcast_logits_at_the_loss():
    """Traced (run.mode=fake, Llama-3-8B BF16, 2 layers, s 4096): at the loss's backward peak three FP32
    logits-sized tensors are alive — the saved log-softmax, its gradient, and the gradient of the FP32
    logits — 12 B per logit; the engine's loss (8 B) + logits term, now FP32 (4 B), not BF16 (2 B)."""
    from harness.estimate import estimate

    s = spec("llama3_8b", "h100_94gb", parallel_dp=8, parallel_zero_stage=3, train_seq_len=4096)
    terms = estimate(s).worst.terms
    sv = 4096 * 128_256
    assert (terms["logits"], terms["loss"]) == (4 * sv, 8 * sv)


def test_dtensor_sharding_propagation_is_not_counted():
    """DTensor propagates an op's output metadata on global-shape fake tensors; in a fake run they were
    made in the trace's own fake mode and MemTracker counted them (loss_parallel's FP32 log-softmax over
    the whole vocabulary). tiny, tp 2, s 256, BF16: a real CPU run measured 25,186,752 B on rank 0
    (`harness run model=tiny train.precision=bf16 train.seq_len=256 parallel.world_size=2
    parallel.tp=2`); the trace read 28,323,996 B before (+12 %), 25,186,732 B now (at s 512:
    38,382,784 B measured, 44,657,308 before, 38,382,764 now)."""
    s = spec("tiny", parallel_tp=2, train_seq_len=256, train_precision="bf16")
    traced = in_fresh_process(trace_one, s, 0)["peak_allocated_bytes"]
    assert traced == pytest.approx(25_186_752, rel=0.001)


# --- tracing ranks side by side ----------------------------------------------------------------------


def test_ranks_traced_side_by_side_are_recorded_in_one_at_a_time_order(monkeypatch):
    """Two at a time, rank 8 ends first and names ZeRO-1 rank 9, then rank 0 names rank 1: one at a time
    would have traced 0, 8, then 1 (named first), then 9. The record lists them so: the worst rank is
    the first of equal peaks in that order, as before."""
    from harness.runner.fake.pool import _trace_ranks

    results = {0: ok_trace(5, extra=1), 8: ok_trace(7, extra=9), 1: ok_trace(6), 9: ok_trace(6)}
    started, killed = scripted_tracing(monkeypatch, [[8], [0], [9], [1]], results)
    traced = _trace_ranks(spec("tiny"), [0, 8], deadline=0.0, kernels=None, jobs=2)
    assert [r["rank"] for r in traced] == [0, 8, 1, 9]
    assert started == [0, 8, 9, 1] and killed == []


def test_after_a_failure_earlier_ranks_finish_and_later_ones_stop(monkeypatch):
    """Ranks 0, 4, 8, 12, two at a time. Rank 4 fails while rank 0 still runs: rank 0 finishes (one at
    a time it was traced before 4), ranks 8 and 12 are never started, and the record ends at rank 4.
    Then rank 0 failing while rank 4 runs: rank 4 is killed, the record ends at rank 0."""
    from harness.runner.fake.pool import _trace_ranks

    failed = {"error": "RuntimeError: boom"}
    results = {0: ok_trace(5), 4: failed, 8: ok_trace(1), 12: ok_trace(1)}
    started, killed = scripted_tracing(monkeypatch, [[4], [0]], results)
    traced = _trace_ranks(spec("tiny"), [0, 4, 8, 12], deadline=0.0, kernels=None, jobs=2)
    assert [r["rank"] for r in traced] == [0, 4] and "error" in traced[1]
    assert started == [0, 4] and killed == []

    results = {0: failed, 4: ok_trace(5), 8: ok_trace(1)}
    started, killed = scripted_tracing(monkeypatch, [[0]], results)
    traced = _trace_ranks(spec("tiny"), [0, 4, 8], deadline=0.0, kernels=None, jobs=2)
    assert [r["rank"] for r in traced] == [0]
    assert started == [0, 4] and killed == [4]


def test_trace_jobs_is_bounded_by_ranks_cpus_and_host_memory(monkeypatch):
    import os

    from harness.runner.fake import pool

    monkeypatch.setattr(pool, "_available_memory_bytes", lambda: 64 * 2**30)
    assert pool.trace_jobs(1) == 1
    assert 1 <= pool.trace_jobs(64) <= os.cpu_count()
    monkeypatch.setattr(pool, "_available_memory_bytes", lambda: 9 * 2**30)  # 9 // 4: two traces fit
    assert pool.trace_jobs(64) == min(2, os.cpu_count())
    monkeypatch.setattr(pool, "_available_memory_bytes", lambda: 2**30)
    assert pool.trace_jobs(64) == 1


def _figures_one_and_two_at_a_time(s, queue):
    from harness.runner.fake.run import run_fake

    rows = [run_fake(s, jobs=jobs) for jobs in (1, 2)]
    skip = ("wall_s", "fake_trace_s", "fake_trace_cpu_s", "fake_host_rss_bytes")
    queue.put([{k: v for k, v in row.items() if k not in skip and not k.startswith("env_")} for row in rows])


@pytest.mark.slow
def test_tracing_ranks_side_by_side_changes_no_figure():
    """The same point traced one rank at a time and two at a time: the same record (bar the times).
    (scripts/fake_budget.py --compare checks the same of larger points against an older revision.)"""
    import multiprocessing

    s = spec("tiny", parallel_pp=2, train_seq_len=128, train_num_microbatches=2)
    # A spawned process that may fork (in_fresh_process's pool workers may not).
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_figures_one_and_two_at_a_time, args=(s, queue))
    proc.start()
    one, two = queue.get(timeout=600)
    proc.join()
    assert one["status"] == "ok" and one["fake_traced_ranks"] == [0, 1]
    nan = [k for k, v in one.items() if v != v]  # (NaN: a step-time spread without timed steps)
    assert {k: v for k, v in one.items() if k not in nan} == {k: v for k, v in two.items() if k not in nan}


# --- cost: a shorter warm-up, and traces kept across GPU presets ------------------------------------


def _trace_with_warm_up(s, full):
    from harness.runner.fake import trace as fake_trace
    from harness.runner.parallel.compose import train_step

    if full:  # the warm-up a real run takes: every micro-batch

        def every_micro_batch(par, tokens, targets, spec):
            train_step(par, tokens, targets, num_microbatches=spec.train.num_microbatches)

        fake_trace.warm_up = every_micro_batch
    r = fake_trace.trace_rank(s, 0)
    return {k: v for k, v in r.items() if k not in ("trace_s", "trace_cpu_s", "host_rss_bytes")}


WARM_UP_LAYOUTS = {
    "ddp": {"parallel_dp": 2, "parallel_zero_stage": 0},  # DDP: its buckets are rebuilt after the first step
    "fsdp2_dp_tp": {"parallel_dp": 2, "parallel_tp": 2, "parallel_zero_stage": 3},  # FSDP2 on a 2-D mesh
}


@pytest.mark.parametrize("name", fast_few(WARM_UP_LAYOUTS, ["ddp"]))
def test_one_micro_batch_warm_up_leaves_the_measured_step_unchanged(name):
    """A fake run warms up on one micro-batch where the real run takes all four: every figure of the
    measured step (peaks, categories, the allocator replay) is the same to the byte."""
    s = spec("tiny", train_seq_len=128, train_num_microbatches=4, **WARM_UP_LAYOUTS[name])
    short = in_fresh_process(_trace_with_warm_up, s, False)
    full = in_fresh_process(_trace_with_warm_up, s, True)
    assert short["peak_allocated_bytes"] > 0
    assert short == full


def test_first_stage_holds_the_mlp_backward_working_set_as_traced():
    """Pipeline stage 0 peaks at its first backward, all in-flight activations alive, with the MLP's
    backward gradients on top: tiny, s 512, b 4, FP32, 3 of b·s·f = 4·512·352 elements, 3 × 2.75 MiB =
    8 650 752 B — the trace's "temporaries" at the peak, exactly. The engine lacked them (−8 %). The
    down projection's saved input, one of the same size, is released before the peak: two above the
    activations (``backward_working_set``)."""
    from harness.estimate import estimate
    from harness.estimate.activations import backward_working_set

    s = spec(
        "tiny",
        parallel_pp=2,
        train_seq_len=512,
        train_micro_batch_size=4,
        train_num_microbatches=2,
        train_precision="fp32",
    )
    assert backward_working_set(s.model, s.parallel, s.train) == 2 * 4 * 512 * 352 * 4 == 5_767_168
    traced = in_fresh_process(trace_one, s, 0)
    assert traced["categories"]["temporaries"] == 8_650_752
    engine = estimate(s, engine="torch").stages[0].total_bytes
    assert abs(engine - traced["peak_allocated_bytes"]) <= 0.01 * traced["peak_allocated_bytes"]


def test_a_fake_row_says_what_the_card_would_do_with_its_trace():
    # Issue 32: each rank's trace replayed against what the allocator may reserve on the card (on the
    # CPU preset: device.memory_gib, nothing outside the allocator). Room for the replayed reserve:
    # fits; between the tensors' peak and the reserve: the allocator must flush its cache (and then
    # fits, or runs out by fragmentation); below the tensors' peak: out of memory at the allocated level.
    import dataclasses

    def row(memory_bytes: float) -> dict:
        s = spec("tiny", parallel_dp=2, parallel_zero_stage=3, train_seq_len=512)
        s = dataclasses.replace(s, device=dataclasses.replace(s.device, memory_gib=memory_bytes / 2**30))
        out = run_fake(s)
        assert out["status"] in ("ok", "oom"), out["error"]
        return out

    roomy = row(2**30)
    allocated, reserved = roomy["sim_peak_allocated_bytes"], roomy["sim_peak_reserved_bytes"]
    assert roomy["sim_capacity_verdict"] == "fits" and roomy["sim_num_alloc_retries"] == 0
    assert reserved > 1.05 * allocated  # room between the two levels to judge
    between = row((allocated + reserved) / 2)
    assert between["sim_capacity_verdict"] in ("fits_after_flush", "oom_fragmentation")
    assert between["sim_num_alloc_retries"] >= 1
    short = row(0.9 * allocated)
    assert short["sim_capacity_verdict"] == "oom_allocated"


@pytest.mark.parametrize("name", fast_few(["1f1b", "interleaved"], ["interleaved"]))
def test_a_cpu_trace_keeps_what_gloos_pipeline_sends_hold(name):
    """issue 30: gloo's send works hold the tensor sent while the schedule keeps them (1F1B: the first
    warm-up forward's across the steady state; interleaved: every send until the step ends); the fake
    group's held nothing, and stage 0's trace read 0.5 % (1F1B, FP32) and 9 % (interleaved, BF16, 8
    micro-batches) below the real run."""
    from harness.runner.fake.run import run_fake
    from harness.runner.supervisor import run_point

    layout = {
        "1f1b": dict(train_precision="fp32", train_num_microbatches=4),
        "interleaved": dict(
            parallel_pp_schedule="interleaved_1f1b", parallel_virtual_stages=2, train_num_microbatches=8
        ),
    }[name]
    s = spec("tiny", train_seq_len=512, parallel_pp=2, **layout)
    # the trace from a fresh process: this one may hold what earlier tests did under fake mode
    real, fake = run_point(s, timeout_s=240), in_fresh_process(run_fake, s)
    assert real["status"] == "ok" and fake["status"] == "ok", (real["error"], fake["error"])
    for rank, peak in zip(fake["fake_traced_ranks"], fake["per_rank_peak_bytes"], strict=True):
        assert peak == pytest.approx(real["per_rank_peak_bytes"][rank], rel=0.002)
    assert fake["sim_peak_reserved_bytes"] == real["sim_peak_reserved_bytes"]
