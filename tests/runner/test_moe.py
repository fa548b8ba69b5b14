"""Mixture-of-experts blocks (issue 27): the deterministic routing, the spec's checks, the runner's layer
against a single-rank reference in every layout it runs, what it keeps against the ``torch`` engine
(saved tensors of one block, real runs stage by stage, a fake run), and the parameter count of
Mixtral-8x7B as published."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import fast_few, in_fresh_process, spec, stage_peaks

from harness.estimate import estimate
from harness.estimate.params import total_params
from harness.runner.parallel import compose
from harness.runner.supervisor import run_point, runner_problems
from harness.spec import InvalidSpec, canonical, config_id
from harness.spec.routing import expert_counts, routing_table


@pytest.mark.parametrize(
    ("experts", "top_k", "imbalance"), [(8, 2, 1.0), (8, 2, 2.5), (4, 4, 1.0), (16, 4, 4.0)]
)
def test_the_routing_puts_imbalance_times_the_balanced_share_on_expert_0(experts, top_k, imbalance):
    table = routing_table(experts, top_k, imbalance)
    assert all(len(set(row)) == top_k for row in table)  # k distinct experts per token
    counts = expert_counts(table, list(range(4 * experts)), batch=3)
    balanced = 4 * 3 * top_k  # 4·E tokens of 3 sequences: T·k/E routes per expert
    assert sum(counts) == 4 * experts * 3 * top_k
    assert counts[0] == imbalance * balanced
    assert max(counts[1:]) - min(counts[1:]) <= 4 * 3  # the others as even as the rest allows


def test_a_moe_spec_is_checked_with_its_arithmetic():
    s = spec("tiny_moe")
    bad = dataclasses.replace(
        s,
        model=dataclasses.replace(s.model, experts_per_token=9, moe_router="top1", moe_aux_loss_coeff=-0.1),
    )
    with pytest.raises(InvalidSpec) as err:
        canonical(bad)
    assert err.value.reasons == [
        "model.experts_per_token=9 must be from 1 to num_experts 8",
        "model.moe_router='top1' must be one of softmax, sigmoid",
        "model.moe_aux_loss_coeff=-0.1 must be a finite number >= 0",
    ]
    # dense first layers: fewer than the model's blocks, and not under interleaving (chunks counted alike)
    for dense, overrides, message in [
        (4, {}, "model.moe_dense_layers=4 must be from 0 to num_layers - 1 = 3"),
        (-1, {}, "model.moe_dense_layers=-1 must be from 0"),
        (
            1,
            dict(pp=2, virtual_stages=2, pp_schedule="interleaved_1f1b"),
            "model.moe_dense_layers=1 under interleaved 1F1B (virtual_stages 2) is not built",
        ),
    ]:
        layered = dataclasses.replace(
            s,
            model=dataclasses.replace(s.model, moe_dense_layers=dense),
            parallel=dataclasses.replace(s.parallel, world_size=None, **overrides),
        )
        with pytest.raises(InvalidSpec, match=re.escape(message)):
            canonical(layered)
    with pytest.raises(
        InvalidSpec, match=r"moe_imbalance · experts_per_token = 1.3·2 = 2.6\) a whole number"
    ):
        canonical(dataclasses.replace(s, train=dataclasses.replace(s.train, moe_imbalance=1.3)))
    # Expert parallelism: ep groups are made of dp·cp ranks and hold whole shares of the experts.
    ep = [
        (dict(parallel_dp=2, parallel_ep=4), "parallel.ep=4 must divide dp·cp = 2·1 = 2"),
        (dict(parallel_dp=6, parallel_ep=3), "parallel.ep=3 must divide model.num_experts 8 (8 % 3 = 2)"),
    ]
    for overrides, message in ep:
        with pytest.raises(InvalidSpec, match=re.escape(message)):
            spec("tiny_moe", **overrides)
    # Layouts this runner does not build are valid specs (Megatron's distributed optimizer is ZeRO-1
    # with expert parallelism): the runner refuses them, real and fake, with the reason, and the torch
    # engine's estimate says it was never measured.
    unbuilt = [
        (dict(parallel_dp=2, parallel_ep=2, parallel_zero_stage=1), "with zero_stage 1 is not built"),
        (
            dict(parallel_dp=2, parallel_ep=2, parallel_zero_stage=3, train_recompute="op"),
            "the experts' FSDP2 unit would span one rank",
        ),
    ]
    for overrides, message in unbuilt:
        layout = spec("tiny_moe", **overrides)
        assert any(message in r for r in runner_problems(layout)), runner_problems(layout)
        assert any(message in n for n in estimate(layout, engine="torch").notes)
    assert runner_problems(spec("tiny_moe", parallel_dp=2, parallel_ep=2, parallel_zero_stage=2)) == []
    with pytest.raises(InvalidSpec, match=r"parallel.ep=2 needs a mixture of experts"):
        spec("tiny", parallel_dp=2, parallel_ep=2)
    # ep = 1 is every existing run: its config_id is unchanged by the new field.
    assert config_id(spec("tiny_moe", parallel_dp=2, parallel_ep=1)) == config_id(
        spec("tiny_moe", parallel_dp=2)
    )
    # A dense model's expert fields have no effect: the same config_id whatever they hold.
    dense = spec("tiny")
    moe_fields = dataclasses.replace(
        dense.model, experts_per_token=4, moe_ffn_hidden_size=7, moe_aux_loss_coeff=0.01
    )
    stray = dataclasses.replace(
        dense, model=moe_fields, train=dataclasses.replace(dense.train, moe_imbalance=3.0)
    )
    assert config_id(stray) == config_id(dense)
    # No load-balancing loss is every existing run (the field is not hashed at 0.0, and an int 0 is 0.0).
    assert config_id(
        canonical(dataclasses.replace(s, model=dataclasses.replace(s.model, moe_aux_loss_coeff=0)))
    ) == config_id(s)


def test_the_moe_presets_have_their_published_parameter_counts():
    # Mistral AI's 46.7B and Qwen's 30.5B and 235B (the released checkpoints' tensor counts); Qwen3's
    # head size of 128 is its own (h/a = 64 and 64) and every layer has query and key norms.
    assert total_params(spec("mixtral_8x7b").model) == 46_702_792_704
    assert total_params(spec("qwen3_30b_a3b").model) == 30_532_122_624
    assert total_params(spec("qwen3_235b_a22b").model) == 235_093_634_560


# ------------------------------------------------------------------ loss equality (as test_runner_parallel)

GLOBAL_BATCH = 4
RTOL = 2e-4
COMMON = dict(train_precision="fp32", train_steps=3, train_seq_len=64)


def _run(model_overrides: dict | None = None, **kw) -> list[float]:
    return _record(model_overrides, **kw)["losses"]


def _record(model_overrides: dict | None = None, **kw) -> dict:
    mp = pytest.MonkeyPatch()
    mp.setattr(compose, "ADAM_EPS", 1.0)  # gradient-sensitive steps (tests/runner/test_runner_parallel.py)
    mp.setattr(compose, "LEARNING_RATE", 2.0)
    try:
        s = spec("tiny_moe", **COMMON, **kw)
        if model_overrides:
            s = canonical(dataclasses.replace(s, model=dataclasses.replace(s.model, **model_overrides)))
        record = run_point(s, timeout_s=240)
    finally:
        mp.undo()
    assert record["status"] == "ok", record["error"]
    return record


# Qwen3-MoE's attention: a head size of its own (64 where h/a is 32) and query/key norms
QWEN3_LIKE = dict(head_dim=64, qk_norm=True, experts_per_token=4)
VARIANTS = {
    "top2": None,
    "shared-sigmoid-top3": dict(num_shared_experts=1, moe_router="sigmoid", experts_per_token=3),
    "qwen3-like": QWEN3_LIKE,
    # the load-balancing loss, under a routing it can pull on (a balanced one gives it no gradient:
    # Σ f_i·P_i is 1/E whatever the router says when every f_i is 1/E)
    "aux-loss": dict(moe_aux_loss_coeff=0.5),
    # the first block's MLP dense (DeepSeek's first_k_dense_replace): under pp 2 stage 0 mixes both kinds
    "dense-first": dict(moe_dense_layers=1),
}
# Training keys a variant runs with, in its reference and in every layout.
VARIANT_TRAIN = {"aux-loss": dict(train_moe_imbalance=2.0)}


class _References(dict):
    """Each variant's single-rank reference losses, run the first time a test asks for them."""

    def __missing__(self, variant: str) -> list[float]:
        losses = _run(
            VARIANTS[variant],
            train_micro_batch_size=GLOBAL_BATCH,
            train_num_microbatches=1,
            **VARIANT_TRAIN.get(variant, {}),
        )
        assert losses[1] < losses[0] - 0.05  # the steps train
        self[variant] = losses
        return losses


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    return _References()


LAYOUTS = {
    "dp2-zero0": dict(parallel_dp=2, train_micro_batch_size=2),
    "dp2-zero1": dict(parallel_dp=2, parallel_zero_stage=1, train_micro_batch_size=2),
    "dp2-zero3": dict(parallel_dp=2, parallel_zero_stage=3, train_micro_batch_size=2),
    "cp2": dict(parallel_cp=2, train_micro_batch_size=4),
    "pp2-1f1b": dict(parallel_pp=2, train_micro_batch_size=2, train_num_microbatches=2),
    "accumulate4-full": dict(train_micro_batch_size=1, train_num_microbatches=4, train_recompute="full"),
    "recompute-op": dict(train_micro_batch_size=4, train_recompute="op"),
    "dp2-cp2-pp2-zero2": dict(
        parallel_dp=2, parallel_cp=2, parallel_pp=2, parallel_zero_stage=2, train_num_microbatches=2
    ),
    # Expert parallelism: DDP (the experts' gradients reduced by hand), FSDP2 units over the expert
    # data-parallel ranks, ep groups mixing cp ranks (different token positions), pipelines, both
    # recomputations with the all-to-all inside
    "dp2-ep2-zero0": dict(parallel_dp=2, parallel_ep=2, train_micro_batch_size=2),
    "dp4-ep2-zero2": dict(parallel_dp=4, parallel_ep=2, parallel_zero_stage=2),
    "dp2-cp2-ep4-accumulate2": dict(parallel_dp=2, parallel_cp=2, parallel_ep=4, train_num_microbatches=2),
    "pp2-dp2-ep2": dict(parallel_pp=2, parallel_dp=2, parallel_ep=2, train_num_microbatches=2),
    "dp2-ep2-op": dict(parallel_dp=2, parallel_ep=2, train_micro_batch_size=2, train_recompute="op"),
    "dp4-ep2-zero3-full": dict(parallel_dp=4, parallel_ep=2, parallel_zero_stage=3, train_recompute="full"),
    # ep = dp·cp: the experts' FSDP2 unit spans one rank (harness/runner/parallel/data.py)
    "dp2-ep2-zero3-full": dict(
        parallel_dp=2, parallel_ep=2, parallel_zero_stage=3, train_micro_batch_size=2, train_recompute="full"
    ),
    # Tensor parallelism (harness/runner/parallel/tensor.py moe_plan): with and without sequence
    # parallelism, under FSDP2 and DDP, a pipeline, cp, op recomputation, and with expert parallelism
    # over the data-parallel ranks (each expert sharded over tp as Megatron's default ETP = TP)
    "tp2": dict(parallel_tp=2, parallel_sequence_parallel=False, train_micro_batch_size=4),
    "tp2-sp-dp2-zero3": dict(parallel_tp=2, parallel_dp=2, parallel_zero_stage=3, train_micro_batch_size=2),
    "tp2-sp-pp2": dict(parallel_tp=2, parallel_pp=2, train_micro_batch_size=2, train_num_microbatches=2),
    "tp2-cp2-op": dict(parallel_tp=2, parallel_cp=2, train_micro_batch_size=4, train_recompute="op"),
    "tp2-sp-dp2-ep2-zero0": dict(parallel_tp=2, parallel_dp=2, parallel_ep=2, train_micro_batch_size=2),
    "tp2-sp-dp2-ep2-zero3-full": dict(
        parallel_tp=2,
        parallel_dp=2,
        parallel_ep=2,
        parallel_zero_stage=3,
        train_micro_batch_size=2,
        train_recompute="full",
    ),
}


# The default run keeps four layouts of the top-2 model, one of each other; -m slow runs the rest.
FAST = {
    ("top2", "dp2-zero3"),
    ("top2", "pp2-1f1b"),
    ("qwen3-like", "cp2"),
    ("top2", "dp4-ep2-zero2"),
    ("shared-sigmoid-top3", "dp2-cp2-ep4-accumulate2"),
    ("aux-loss", "dp2-cp2-ep4-accumulate2"),
    ("aux-loss", "pp2-1f1b"),
    ("dense-first", "pp2-dp2-ep2"),
    ("top2", "tp2-sp-dp2-ep2-zero3-full"),
    ("shared-sigmoid-top3", "tp2-sp-pp2"),
}
CASES = [
    pytest.param(v, n, id=f"{v}-{n}", marks=() if (v, n) in FAST else pytest.mark.slow)
    for v in VARIANTS
    for n in LAYOUTS
    # Qwen3's query/key norms under tensor parallelism are refused by the spec check (not built)
    if not ((VARIANTS[v] or {}).get("qk_norm") and LAYOUTS[n].get("parallel_tp", 1) > 1)
]


@pytest.mark.parametrize(("variant", "name"), CASES)
def test_moe_layout_matches_single_rank(references, variant, name):
    losses = _run(VARIANTS[variant], **LAYOUTS[name], **VARIANT_TRAIN.get(variant, {}))
    assert losses == pytest.approx(references[variant], rel=RTOL), (losses, references[variant])


def test_the_load_balancing_loss_trains_the_router_and_keeps_no_tensor():
    """Its gradient reaches the router (the losses after the first step move), and it adds no memory
    term: the measured peak is the run's without it to within the few (E,) FP32 tensors it makes."""
    single = dict(train_micro_batch_size=GLOBAL_BATCH, train_num_microbatches=1, train_moe_imbalance=2.0)
    without = _record(None, **single)
    with_aux = _record(VARIANTS["aux-loss"], **single)
    first, second = (with_aux["losses"][i] - without["losses"][i] for i in (0, 1))
    assert abs(first) < 1e-6  # reported: the language model's loss alone
    assert abs(second) > 1e-3, (with_aux["losses"], without["losses"])
    assert abs(with_aux["peak_allocated_bytes"] - without["peak_allocated_bytes"]) <= 4096


# ------------------------------------------------------------------ memory against the engine


def _saved_bytes_of_one_block() -> tuple[int, int]:
    """What autograd saves for one BF16-autocast MoE block (parameters and buffers aside), and the
    engine's figure for it: its activations and autocast's BF16 casts of the block's weights (which it
    counts with the parameters, ``param_copies``)."""
    import torch

    from harness.estimate.activations import layer_activation_bytes
    from harness.estimate.params import layer_params
    from harness.runner.model import TransformerBlock

    s = spec("tiny_moe", train_seq_len=512, train_precision="bf16")
    block = TransformerBlock(s.model, 512, "flash")
    skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and not (t.grad_fn is None and t.requires_grad):
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    x = torch.randn(1, 512, 128, requires_grad=True)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        block(x * 1)
    engine = layer_activation_bytes(s.model, s.parallel, s.train, engine="torch", autocast=True)
    return sum(seen.values()), engine + 2 * layer_params(s.model)


def test_one_moe_block_saves_what_the_engine_counts():
    # Before the combine kept only its index (torch's index_add saves its FP32 (N, h) source too,
    # torchtitan's scatter-add does not) the block saved 0.5 MiB more than the engine counted.
    saved, engine = in_fresh_process(_saved_bytes_of_one_block)
    # Left out by the engine: each norm's FP32 1/rms (2 × 2 KiB) and the attention's log-sum-exp (8 KiB).
    assert abs(saved - engine) <= 12288, (saved, engine)


MEMORY_POINTS = {
    # measured/engine per stage when written: 1.0005, 1.0014, 1.0017/1.0005, 0.9983, 1.0005, 0.9919/1.0005
    "bf16": dict(train_precision="bf16"),
    "dp2-zero3-bf16": dict(train_precision="bf16", parallel_dp=2, parallel_zero_stage=3),
    "pp2-bf16": dict(train_precision="bf16", parallel_pp=2, train_num_microbatches=2),
    "cp2-fp32": dict(train_precision="fp32", parallel_cp=2),
    # torchtitan's op policy over the experts' matmuls (moe.moe_op_bytes); under a pipeline, stage 0's
    # first backward with every gradient made (peaks.pipeline_first_backward; 4.3 % above before it)
    "op-bf16": dict(train_precision="bf16", train_recompute="op"),
    "op-pp2-fp32": dict(
        train_precision="fp32", train_recompute="op", parallel_pp=2, train_num_microbatches=2
    ),
    # Qwen3's attention (QWEN3_LIKE): its query and key norms keep what a norm keeps; applied before
    # the heads' transpose, as Qwen3's code does (after it, SDPA's output needed a copy: +2.7 %)
    "qwen3-like-bf16": dict(train_precision="bf16", model=QWEN3_LIKE),
    # Over-predicted by 2.0 % on stage 0 (41.49 MiB measured, 42.35 estimated): the block's saved tensors
    # equal the engine's count (a bare block under FSDP2's BF16: 1.4 % over, its rotary tables), so the
    # rest is in how the combine's backward working set meets FSDP2's prefetch; not traced yet.
    "qwen3-like-pp2-dp2-zero3": dict(
        low=0.975,
        train_precision="bf16",
        parallel_pp=2,
        parallel_dp=2,
        parallel_zero_stage=3,
        train_num_microbatches=2,
        model=QWEN3_LIKE,
    ),
}

# Dense first layers (model.moe_dense_layers; params.chunk_blocks: each kind of block at its own size),
# when written: 1.0009, 1.0024/1.0008, 1.0010, 1.0085/1.0008. Stage 0 of the last holds dense blocks
# only, where the engine is a dense model's (tiny_moe's experts' width 96 as the dense MLP's read 2.0 %
# over there, as a dense model of that shape does: a property of MLPs narrower than h, not of the kinds).
MEMORY_POINTS.update(
    {
        "dense-first-bf16": dict(train_precision="bf16", model=dict(moe_dense_layers=1)),
        "dense-first-pp2-bf16": dict(
            train_precision="bf16", parallel_pp=2, train_num_microbatches=2, model=dict(moe_dense_layers=1)
        ),
        "dense-first-op-bf16": dict(
            train_precision="bf16", train_recompute="op", model=dict(moe_dense_layers=1)
        ),
        "dense-stage-pp2-bf16": dict(
            train_precision="bf16",
            parallel_pp=2,
            train_num_microbatches=2,
            model=dict(moe_dense_layers=2, ffn_hidden_size=352),
        ),
    }
)

# Tensor parallelism (every tp rank runs the layer on all its tokens, each expert's SwiGLU by t), when
# written: 1.0015, 0.9956 (SP), 0.9991 (dp 2 ZeRO-3), 0.9900/0.9951 (pp 2), 0.9871 (op), 0.9936 (full),
# 1.0010 (dp 2 × ep 2 ZeRO-3), 0.9978 (cp 2, FP32)
MEMORY_POINTS.update(
    {
        "tp2-bf16": dict(train_precision="bf16", parallel_tp=2, parallel_sequence_parallel=False),
        "tp2-sp-dp2-ep2-zero3-bf16": dict(
            train_precision="bf16", parallel_tp=2, parallel_dp=2, parallel_ep=2, parallel_zero_stage=3
        ),
        "tp2-sp-pp2-bf16": dict(
            low=0.985, train_precision="bf16", parallel_tp=2, parallel_pp=2, train_num_microbatches=2
        ),
        "tp2-sp-op-bf16": dict(low=0.98, train_precision="bf16", parallel_tp=2, train_recompute="op"),
        "tp2-cp2-fp32": dict(
            train_precision="fp32", parallel_tp=2, parallel_cp=2, parallel_sequence_parallel=False
        ),
    }
)

# Expert parallelism (moe.received_rows: each rank's experts run the rows the all-to-all brings; under
# op the all-to-all's two outputs kept, traced: 6.1 % under without them), when written: 1.004, 1.004,
# 0.947, 0.970 (measured/engine). Without FSDP2 the engine reads 3-5 % over: the peak comes later in
# backward, some gradients made and some kept tensors freed (traced, not modelled).
MEMORY_POINTS.update(
    {
        "dp4-ep2-zero3-bf16": dict(
            train_precision="bf16", parallel_dp=4, parallel_ep=2, parallel_zero_stage=3
        ),
        "dp4-ep2-zero3-op-bf16": dict(
            train_precision="bf16",
            parallel_dp=4,
            parallel_ep=2,
            parallel_zero_stage=3,
            train_recompute="op",
        ),
        "cp2-ep2-op-fp32": dict(
            low=0.94, train_precision="fp32", parallel_cp=2, parallel_ep=2, train_recompute="op"
        ),
        "dp2-ep2-bf16": dict(low=0.965, train_precision="bf16", parallel_dp=2, parallel_ep=2),
    }
)


@pytest.mark.parametrize(
    "name",
    fast_few(
        MEMORY_POINTS,
        {
            "op-pp2-fp32",
            "qwen3-like-pp2-dp2-zero3",
            "dp4-ep2-zero3-bf16",
            "dense-first-pp2-bf16",
            "tp2-sp-dp2-ep2-zero3-bf16",
        },
    ),
)
def test_moe_every_stage_measures_its_estimate(name):
    # (named layouts are allowed up to 6 % over: see MEMORY_POINTS)
    # Before the MoE terms (the engine counting a dense MLP of ffn_hidden_size): 1.48 on one rank.
    point = dict(MEMORY_POINTS[name])
    model, low = point.pop("model", None), point.pop("low", 0.99)
    s = spec("tiny_moe", train_seq_len=512, **point)
    if model:
        s = canonical(dataclasses.replace(s, model=dataclasses.replace(s.model, **model)))
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    for stage, measured, estimated in stage_peaks(s, real):
        assert low * estimated <= measured <= 1.01 * estimated, (name, stage, measured, estimated)


def test_a_fake_moe_run_traces_what_the_real_run_measures():
    # Fake mode traces the routing as the real run does: the experts' rows are Python ints (no tensor
    # is read back), and context parallelism gives the layer its tokens' global positions.
    from harness.runner.fake.run import run_fake

    s = spec("tiny_moe", train_seq_len=512, train_precision="bf16", parallel_pp=2, parallel_cp=2)
    real, fake = run_point(s, timeout_s=240), in_fresh_process(run_fake, s)
    assert real["status"] == "ok" and fake["status"] == "ok", (real["error"], fake["error"])
    for rank, peak in zip(fake["fake_traced_ranks"], fake["per_rank_peak_bytes"], strict=True):
        assert peak == pytest.approx(real["per_rank_peak_bytes"][rank], rel=0.002)


def test_the_paper_and_megatron_engines_say_what_they_do_with_experts():
    s = spec("mixtral_8x7b", "h100_80gb")
    assert any("has no experts" in n for n in estimate(s, engine="paper").notes)
    assert any(
        "Megatron-LM's alltoall dispatcher with TransformerEngine's grouped GEMM" in n
        for n in estimate(s, engine="megatron").notes
    )
    assert estimate(s, engine="torch").notes == ()


def test_the_megatron_engine_counts_megatrons_own_moe_tensors():
    # Mixtral-8x7B, one rank, s 8192, BF16: Megatron-LM's saved tensors of one MoE block's MLP (alltoall
    # dispatcher, TE grouped GEMM with the fused weighted SwiGLU; moe.megatron_moe_layer_bytes), listed
    # one by one (T tokens, N = 2T rows, E 8, h 4096, f 14336)
    from harness.estimate.activations import layer_activation_bytes
    from harness.estimate.moe import megatron_moe_layer_bytes, moe_layer_bytes

    s = spec("mixtral_8x7b", "h100_80gb", train_precision="bf16", train_seq_len=8192)
    m, p, t = s.model, s.parallel, s.train
    T, N, E, h, f = 8192, 16384, 8, 4096, 14336
    tensors = {
        "input": 2 * T * h,
        "top-k indices": 8 * T * 2,
        "top-k softmax": 4 * T * 2,
        "argsort": 8 * T * E,
        "sorted indices": 8 * N,
        "fc1 input": 2 * N * h,
        "fc1 output": 2 * N * 2 * f,
        "fc2 input": 2 * N * f,
        "permuted probs": 2 * N,
        "dispatcher probs and map": T * E * 3,
    }
    assert megatron_moe_layer_bytes(m, p, t) == sum(tensors.values())
    # torchtitan's layer keeps FP32 copies Megatron's does not (the router's input, the combine's rows)
    assert moe_layer_bytes(m, p, t, autocast=False) - megatron_moe_layer_bytes(m, p, t) > 4 * N * h
    # the block: the dense part's tensors as for a dense model, the MLP's input counted once
    dense = dataclasses.replace(s.model, num_experts=0)
    block = layer_activation_bytes(m, p, t, engine="megatron")
    mlp = 2 * (T * h + 4 * T * f)  # a dense SwiGLU of f, BF16: its input and 4·s·b·f elements
    assert (
        block - megatron_moe_layer_bytes(m, p, t)
        == layer_activation_bytes(dense, p, t, engine="megatron") - mlp
    )


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_megatron_engine_shards_expert_states_over_the_ranks_that_hold_the_same_experts(zero):
    # Megatron's distributed optimizer shards an expert's states over the expert-data-parallel group
    # (d·c/ep ranks), a dense weight's over d·c: a rank's shard is the whole stage's parameters / d·c,
    # with or without expert parallelism. (Taking the rank's 1/ep of the experts read them ep times low.)
    from harness.estimate.params import stage_params

    base = spec("mixtral_8x7b", "h100_80gb", parallel_dp=8, parallel_zero_stage=zero, train_precision="bf16")
    with_ep = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, ep=8))
    whole = stage_params(base.model, stage=0, pp=1, tp=1)
    sharded = {1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}[zero]
    per_param = {"params": 2, "grads": 4, "optimizer": 12}
    for s in (base, with_ep):
        terms = estimate(s, engine="megatron").worst.terms
        for term in sharded:
            assert terms[term] == -(-per_param[term] * whole // 8), (s.parallel.ep, term)
    # what expert parallelism does change: the unsharded states hold 1/ep of the experts
    if zero < 3:
        ep_terms = estimate(with_ep, engine="megatron").worst.terms
        assert ep_terms["params"] < estimate(base, engine="megatron").worst.terms["params"]


def test_plan_lists_megatrons_expert_parallel_zero_1_and_this_runners_layouts_only_for_the_torch_engine():
    from harness.estimate.plan import PlanOptions, candidates

    base = spec("mixtral_8x7b", "h100_80gb")
    layouts = {}
    for engine in ("torch", "megatron"):
        opts = PlanOptions(gpus=16, engine=engine)
        layouts[engine] = {
            (c.parallel.ep, c.parallel.zero_stage) for c in candidates(base, opts) if c.parallel.ep > 1
        }
    assert not any(zero == 1 for _, zero in layouts["torch"])
    assert {zero for _, zero in layouts["megatron"]} >= {1, 2, 3}


def test_a_fake_expert_parallel_run_traces_what_the_real_run_measures():
    # The ep meshes are cut from the real mesh tensor outside FakeTensorMode; under DDP the fake
    # replica leaves the experts out of its buckets as DDP does. The traced rank (rank 0) holds
    # expert 0, the most loaded at an imbalance of 2.
    from harness.runner.fake.run import run_fake

    s = spec(
        "tiny_moe",
        train_seq_len=512,
        train_precision="fp32",
        train_moe_imbalance=2.0,
        parallel_dp=2,
        parallel_ep=2,
    )
    real, fake = run_point(s, timeout_s=240), in_fresh_process(run_fake, s)
    assert real["status"] == "ok" and fake["status"] == "ok", (real["error"], fake["error"])
    assert max(real["per_rank_peak_bytes"]) == real["per_rank_peak_bytes"][0]
    for rank, peak in zip(fake["fake_traced_ranks"], fake["per_rank_peak_bytes"], strict=True):
        assert peak == pytest.approx(real["per_rank_peak_bytes"][rank], rel=0.002)
