"""Each activation term for one small configuration, worked out by hand in the comments.

Model `tiny`: h 128, L 4, a 4, k 2 (k/a = 1/2), f 352, v 4096; s 256, b 2, BF16 (2 bytes per element).
sbh = 256·2·128 = 65,536 elements; sbf = 256·2·352 = 180,224 elements.
"""

from __future__ import annotations

import pytest
from conftest import in_fresh_process, replace, spec

from harness.estimate import activations as act
from harness.estimate import buffers as buf
from harness.estimate import checkpoints as ck
from harness.estimate import pipeline as pipe
from harness.estimate.dtypes import torch_autocast

BASE = dict(train_seq_len=256, train_micro_batch_size=2)
# torch: F.rms_norm also saves its normalised output, 2·sbh more per layer = 131,072 elements · 2 B.
NORM_OUT = 262_144
# torch on the CPU: the composite F.rms_norm upcasts BF16 and keeps both of its tensors in FP32, 2 B
# more per element of the 4·sbh = 262,144 norm elements (dtypes.norm_elem_bytes).
CPU_NORMS_FP32 = 524_288
# torch in BF16: the rotary cos and sin rows cast to BF16 in every layer, 2 · s·head_dim = 2·256·32
# elements · 2 B (act.rope_table_bytes).
ROPE = 32_768
TORCH_LAYER = 2_359_296 + NORM_OUT + CPU_NORMS_FP32 + ROPE


def layer(engine="torch", **kw):
    s = spec("tiny", **{**BASE, **kw})
    return act.layer_activation_bytes(s.model, s.parallel, s.train, engine=engine)


def test_layer_without_parallelism():
    # norms 2·sbh 131,072 + attention input sbh 65,536 + Q and output 2·sbh 131,072
    # + K,V 2·sbh·k/a 65,536 + MLP input sbh 65,536 + 4·sbf 720,896 = 1,179,648 elements · 2 B.
    assert layer("megatron") == 2_359_296
    # The ESTIMATOR's closed form: sbh·2·(12 + 4k/a + 8f/h)/2 = 65,536·(12 + 2 + 22) = 2,359,296.
    assert layer("megatron") == 65_536 * (12 + 2 + 22)
    # torch: + the two norms' outputs, 2·sbh elements = 4·sbh bytes: 65,536·(16 + 2 + 22); on the CPU
    # the norms' four tensors in FP32, and the rotary tables.
    assert layer("torch") == TORCH_LAYER == 65_536 * (16 + 2 + 22) + CPU_NORMS_FP32 + ROPE


def test_megatron_tp_with_sp_shards_everything():
    assert layer("megatron", parallel_tp=2, parallel_sequence_parallel=True) == 2_359_296 // 2


def test_tp_without_sp_llama_form():
    # Korthikanti Table 2 adapted: sbh·(8 + (4 + 4k/a + 8f/h)/t) bytes = 65,536·(8 + 28/2) = 1,441,792.
    assert layer("megatron", parallel_tp=2, parallel_sequence_parallel=False) == 1_441_792
    # torch: the norms' outputs are not sharded without SP either (nor their FP32 width, nor the
    # rotary tables, which no tp rank splits).
    assert layer("torch", parallel_tp=2, parallel_sequence_parallel=False) == (
        1_441_792 + NORM_OUT + CPU_NORMS_FP32 + ROPE
    )


def test_torch_tp_sp_saves_the_gathered_inputs_in_full():
    # norms (inputs and outputs) /2 → 131,072; attention + MLP inputs stay full 131,072; Q,out /2 →
    # 65,536; K,V /2 → 32,768; MLP /2 → 360,448: 720,896 elements = 1,441,792 B; the norms' FP32
    # width halves with them, the rotary tables do not.
    assert (
        layer("torch", parallel_tp=2, parallel_sequence_parallel=True)
        == 1_441_792 + CPU_NORMS_FP32 // 2 + ROPE
    )


def test_context_parallel():
    # megatron divides everything by c = 2.
    assert layer("megatron", parallel_cp=2) == 1_179_648
    # torch: everything /2 except the gathered, full-sequence K and V (65,536 elements):
    # norms 131,072 + 65,536 + 65,536 + 65,536 + 360,448 = 688,128 elements, plus the causal mask SDPA
    # saves in the compute dtype, (s/c)·s = 128·256 = 32,768 elements: 720,896 elements = 1,441,792 B;
    # the norms' FP32 width and the rotary rows (s/c of them) halve too.
    assert layer("torch", parallel_cp=2) == 1_441_792 + (CPU_NORMS_FP32 + ROPE) // 2
    # Recomputing the attention core (selective) recomputes the mask's conversion too.
    assert (
        layer("torch", parallel_cp=2, train_recompute="selective") == 1_376_256 + (CPU_NORMS_FP32 + ROPE) // 2
    )
    s = spec("tiny", **BASE, parallel_cp=2)
    # The gathered K and V (2·s·b·h·k/a = 65,536 elements · 2 B) and the boolean mask (32,768 B).
    assert buf.cp_kv_allgather(s.model, s.parallel, s.train, engine="torch") == 131_072 + 32_768
    assert buf.cp_kv_allgather(s.model, s.parallel, s.train, engine="megatron") == 131_072


def test_math_attention_adds_scores_and_selective_recompute_drops_them():
    # softmax a·s²·b = 4·65,536·2 = 524,288 elements, and K and V repeated to 4 heads from 2:
    # 2·sbh·(1 − 2/4) = 65,536; 589,824 elements = 1,179,648 B more (issue 15: measured on the runner
    # now that it runs the math kernel: the scores before the softmax are not kept) — in FP32, as the
    # megatron engine counts them. torch's math path computes BF16 in FP32 (act.math_attention_bytes):
    # 4 B · (the softmax 524,288 + K, V repeated 131,072) − the BF16 K, V the flash kernel would keep
    # (2 B · 65,536) + Q kept in FP32, not BF16 (2 B · 65,536) = 2,621,440 B.
    assert layer(train_attention="math") == TORCH_LAYER + 2_621_440
    assert layer("megatron", train_attention="math") == 2_359_296 + 1_179_648
    assert layer(train_attention="math", train_recompute="selective") == TORCH_LAYER
    # … but one layer's scores come back while its attention core is recomputed in backward.
    sel = spec("tiny", **BASE, train_attention="math", train_recompute="selective")
    stage = act.stage_layer_activations(sel.model, sel.parallel, sel.train, stage=0, engine="torch")
    assert stage == 4 * TORCH_LAYER + 2_621_440
    # With CP = 2 each rank holds (s/c)·s of the softmax per head and half the repeated K, V (megatron
    # shards K and V by c): everything halves.
    assert layer("megatron", train_attention="math", parallel_cp=2) == (2_359_296 + 1_179_648) // 2


def test_full_recompute_keeps_layer_inputs_plus_one_layer():
    s = spec("tiny", **BASE, train_recompute="full")
    # 4 layers × input sbh·2 B = 131,072 each, plus one layer recomputed in full 2,359,296, whose own
    # input (its first norm input) is one of the four: 3 · 131,072 + 2,359,296 (+ its norms' outputs,
    # their FP32 width and the rotary tables: TORCH_LAYER).
    got = act.stage_layer_activations(s.model, s.parallel, s.train, stage=0, engine="torch")
    assert got == 3 * 131_072 + TORCH_LAYER


@pytest.mark.parametrize(
    ("schedule", "v", "m", "layers_by_stage"),
    [
        # 1F1B: stage i holds min(pp − i, m) micro-batches of L/pp = 2 layers.
        ("1f1b", 1, 4, [4, 2]),
        # GPipe: all m micro-batches.
        ("gpipe", 1, 4, [8, 8]),
        # Interleaved, v = 2 chunks of 1 layer: stage 0 holds 2·1 + 1·2 + 1 = 5 chunks
        # (= L·(1 + (p − 1)/(p·v)) = 4·1.25), stage 1 holds 0 + 2 + 1 = 3.
        ("interleaved_1f1b", 2, 4, [5, 3]),
    ],
)
def test_inflight_microbatches(schedule, v, m, layers_by_stage):
    s = spec(
        "tiny",
        **BASE,
        parallel_pp=2,
        parallel_pp_schedule=schedule,
        parallel_virtual_stages=v,
        train_num_microbatches=m,
    )
    got = [act.stage_layer_activations(s.model, s.parallel, s.train, stage=i, engine="torch") for i in (0, 1)]
    assert got == [n * TORCH_LAYER for n in layers_by_stage]


def test_ends_of_the_model():
    s = spec("tiny", **BASE)
    m, p, t = s.model, s.parallel, s.train
    # Logits: s·b·v = 2,097,152 elements in BF16.
    assert act.logits(m, p, t, stage=0) == 4_194_304
    # The loss's FP32 logits and gradient: 2·4·s·b·v.
    assert buf.loss(m, p, t, stage=0) == 16_777_216
    # Token ids 8·s·b = 4,096 B; the torch runner holds ids and targets (pp = 1: both on stage 0).
    assert act.token_ids(p, t, stage=0, engine="megatron") == 4_096
    assert act.token_ids(p, t, stage=0, engine="torch") == 8_192
    # Final-norm input + LM-head input: 2·sbh·2 B.
    assert act.output_activations(m, p, t, stage=0, engine="megatron") == 262_144


def test_logits_and_loss_sit_on_the_last_stage_only():
    s = replace(spec("tiny", **BASE), parallel_pp=2, train_num_microbatches=2)
    m, p, t = s.model, s.parallel, s.train
    assert act.logits(m, p, t, stage=0) == 0 and buf.loss(m, p, t, stage=0) == 0
    assert act.logits(m, p, t, stage=1) == 4_194_304


def test_torch_pipeline_last_stage_keeps_the_gathered_output_in_its_forward_cache():
    """torch engine under pipelining: the head's output is gathered over tp (no loss_parallel) and kept
    by the schedule's forward cache in the compute dtype, beside the loss's FP32 softmax, its gradient
    and the FP32 gradient of the upcast logits (traced: 3 FP32 and 1 BF16 logit-sized tensors at the
    BF16 last stage's peak under 1F1B; 4 and 2 under GPipe with 2 micro-batches)."""
    s = replace(spec("tiny", **BASE), parallel_pp=2, parallel_tp=2, train_num_microbatches=2)
    m, p, t = s.model, s.parallel, s.train
    sbv = 256 * 2 * 4096  # 2,097,152 elements, BF16 logits, FP32 loss
    # 1F1B: one micro-batch's cached output (BF16) and the upcast logits' gradient (FP32); full vocabulary.
    assert act.logits(m, p, t, stage=1, engine="torch") == sbv * 2 + sbv * 4
    assert buf.loss(m, p, t, stage=1, engine="torch") == 2 * sbv * 4
    # megatron keeps the vocabulary-parallel accounting: / t, one output.
    assert act.logits(m, p, t, stage=1, engine="megatron") == sbv * 2 // 2
    # GPipe: all m = 2 outputs (and their losses' softmax) in flight, plus the two FP32 gradients.
    g = replace(s, parallel_pp_schedule="gpipe")
    assert act.logits(m, g.parallel, g.train, stage=1, engine="torch") == 2 * sbv * 2 + sbv * 4
    assert buf.loss(m, g.parallel, g.train, stage=1, engine="torch") == 3 * sbv * 4


def _cpu_kernel_trace(s, rank):
    from harness.runner.fake.trace import trace_rank

    return trace_rank(s, rank, kernels="cpu")


def test_torch_pipeline_last_stage_matches_its_bf16_trace():
    """The fake trace of tiny's BF16 last stage (s 512, b 4, pp 2, 2 micro-batches, CPU kernels) against
    the torch engine, under 1F1B and GPipe: within 1 % (it was 11 % short under 1F1B when the upcast
    logits' gradient was counted in BF16)."""
    from harness.estimate import estimate
    from harness.runner.fake.ranks import rank_of

    for schedule in ("1f1b", "gpipe"):
        s = spec(
            "tiny",
            parallel_pp=2,
            parallel_pp_schedule=schedule,
            train_seq_len=512,
            train_micro_batch_size=4,
            train_num_microbatches=2,
            train_precision="bf16",
        )
        traced = in_fresh_process(_cpu_kernel_trace, s, rank_of(s, stage=1))["peak_allocated_bytes"]
        engine = next(x for x in estimate(s, engine="torch").stages if x.stage == 1).total_bytes
        assert abs(engine / traced - 1) < 0.01, (schedule, engine, traced)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_pipeline_first_stage_keeps_each_inflight_stage_output(precision):
    """Stage 0 keeps every in-flight micro-batch's stage output for its backward, which no layer saves
    (the last stage has none to keep). GPipe on tiny
    (s 512, b 4, pp 2) holds all m micro-batches on stage 0 at its first backward, so what one more
    micro-batch adds there is one micro-batch's layers, its gradient receive buffer and its stage
    output: the traced growth from m = 2 to m = 4 against the engine's, within 1 % (BF16: 0.75 % short,
    each layer's logsumexp and 1/rms; 4 % short without the stage outputs), in FP32 and in BF16 under
    autocast (the output is FP32 there)."""
    from harness.estimate import estimate
    from harness.runner.fake.ranks import rank_of

    def both(m):
        s = spec(
            "tiny",
            parallel_pp=2,
            parallel_pp_schedule="gpipe",
            train_seq_len=512,
            train_micro_batch_size=4,
            train_num_microbatches=m,
            train_precision=precision,
        )
        traced = in_fresh_process(_cpu_kernel_trace, s, rank_of(s, stage=0))["peak_allocated_bytes"]
        return s, traced, estimate(s, engine="torch").stages[0]

    s, traced2, est2 = both(2)
    _, traced4, est4 = both(4)
    autocast = torch_autocast(s.parallel, s.train)
    assert autocast == (precision == "bf16")
    one = pipe.boundary_bytes(s.model, s.parallel, s.train, autocast=autocast)
    assert one == 4 * 512 * 4 * 128  # FP32: the model in FP32, or the residual stream under autocast
    m, p, t = s.model, s.parallel, s.train
    assert pipe.pipeline_stage_outputs(m, p, t, stage=0, engine="torch", autocast=autocast) == 2 * one
    assert pipe.pipeline_stage_outputs(m, p, t, stage=1, engine="torch", autocast=autocast) == 0
    assert pipe.pipeline_stage_outputs(m, p, t, stage=0, engine="megatron", autocast=autocast) == 0
    grown_traced, grown_engine = traced4 - traced2, est4.total_bytes - est2.total_bytes
    assert abs(grown_engine / grown_traced - 1) < 0.01, (grown_engine, grown_traced)
    assert abs((grown_engine - 2 * one) / grown_traced - 1) > 0.01  # what the engine said before


def test_torch_recomputed_layer_and_loss_buffers_are_not_added():
    """Full recomputation: the layer recomputed in backward and the loss's buffers are never alive
    together, so the torch engine's peak holds the larger (the CPU study over-predicted ~19 % when it
    added both); megatron keeps Korthikanti's sum."""
    from harness.estimate import estimate

    s = spec("tiny", train_recompute="full", train_seq_len=512, train_precision="fp32")
    m, p, t = s.model, s.parallel, s.train
    kept = 4 * act.layer_input_bytes(m, p, t)  # 4 layers' inputs
    working = act.recompute_working_set(m, p, t, engine="torch")
    terms = estimate(s, engine="torch").worst.terms
    head = terms["logits"] + terms["loss"]
    assert 0 < working < head  # at this shape the loss buffers are the larger
    assert terms["activations"] == kept + working - min(working, head) == kept
    meg = estimate(s, engine="megatron").worst.terms
    assert meg["activations"] == act.stage_layer_activations(m, p, t, stage=0, engine="megatron")


def test_op_policy_keeps_its_save_list():
    # torchtitan's op policy (issue 15), measured on one tiny block: input sbh 65,536 + wq's output
    # sbh 65,536 + wv's sbh·k/a 32,768 + the flash output sbh 65,536 + w1's sbf 180,224 + w2's sbh
    # 65,536 = 475,136 elements · 2 B = 950,272 B.
    assert layer(train_recompute="op") == 950_272
    # The math kernel is not one op: its output is recomputed, 65,536 elements fewer.
    assert layer(train_recompute="op", train_attention="math") == 950_272 - 131_072
    # tp 2 with SP: input, wq, wv, attention output and w1 halve (32,768 + 32,768 + 16,384 + 32,768 +
    # 90,112); w2's row-parallel output is the un-reduced full width (65,536); the two reduce-scatter
    # outputs 2·32,768: 335,872 elements = 671,744 B.
    assert layer(train_recompute="op", parallel_tp=2) == 671_744
    # Backward replays one block: its full activations less what was kept, plus its output (sbh):
    # TORCH_LAYER − 950,272 + 131,072 B.
    s = spec("tiny", **BASE, train_recompute="op")
    m, p, t = s.model, s.parallel, s.train
    working = TORCH_LAYER - 950_272 + 131_072
    assert act.recompute_working_set(m, p, t, engine="torch") == working
    assert act.stage_layer_activations(m, p, t, stage=0, engine="torch") == 4 * 950_272 + working


def test_full_recompute_every_nth_block():
    # tiny has 4 blocks; recompute_every 2 checkpoints the 2nd and 4th: 2 inputs (131,072 B each) and
    # 2 full layers (TORCH_LAYER each), plus the 4th's recomputation (TORCH_LAYER − 131,072).
    s = spec("tiny", **BASE, train_recompute="full", train_recompute_every=2)
    m, p, t = s.model, s.parallel, s.train
    assert ck.checkpointed_layers(m, p, t) == 2
    stage = act.stage_layer_activations(m, p, t, stage=0, engine="torch")
    assert stage == 2 * 131_072 + 2 * TORCH_LAYER + TORCH_LAYER - 131_072
    # Every 3rd: only the 3rd block is checkpointed; the 4th keeps everything, and backward frees it
    # before it recomputes the 3rd, so no working set is added: 131,072 + 3 · TORCH_LAYER.
    s3 = replace(s, train_recompute_every=3)
    assert act.stage_layer_activations(s3.model, s3.parallel, s3.train, stage=0, engine="torch") == (
        131_072 + 3 * TORCH_LAYER
    )
    # Every 8th of 4: none checkpointed, as without recomputation.
    s8 = replace(s, train_recompute_every=8)
    none = replace(s, train_recompute="none")
    assert act.stage_layer_activations(s8.model, s8.parallel, s8.train, stage=0, engine="torch") == (
        act.stage_layer_activations(none.model, none.parallel, none.train, stage=0, engine="torch")
    )
    # Under pp 2 each stage's chunk of 2 blocks is counted on its own: 1 checkpointed per chunk.
    pp = replace(s, parallel_pp=2, train_num_microbatches=2)
    assert ck.checkpointed_layers(pp.model, pp.parallel, pp.train) == 1


def _stage(s, engine="torch"):
    return act.stage_layer_activations(s.model, s.parallel, s.train, stage=0, engine=engine)


def test_megatron_uniform_method_recomputes_a_group_at_once():
    # Megatron's uniform N = 2 on tiny's 4 blocks: groups (1, 2) and (3, 4), each keeping its input
    # (131,072 B); backward recomputes a whole group: 2 full layers (TORCH_LAYER each) less the kept
    # input: 262,144 + 2 · TORCH_LAYER − 131,072.
    s = spec(
        "tiny", **BASE, train_recompute="full", train_recompute_every=2, train_recompute_method="uniform"
    )
    m, p, t = s.model, s.parallel, s.train
    assert ck.checkpointed_layers(m, p, t) == 2
    assert ck.recomputed_layers(m, p, t) == 4
    assert act.recompute_working_set(m, p, t, engine="torch") == 2 * TORCH_LAYER - 131_072
    assert _stage(s) == 262_144 + 2 * TORCH_LAYER - 131_072
    # megatron: 2,359,296 per layer: 262,144 + 2 · 2,359,296 − 131,072 = 4,849,664.
    assert _stage(s, "megatron") == 4_849_664
    # N = 3: groups (1, 2, 3) and (4); the 4th is recomputed first, then the first group, after the
    # 4th's input is freed: 262,144 + 3 · TORCH_LAYER − 2 · 131,072.
    assert _stage(replace(s, train_recompute_every=3)) == 262_144 + 3 * TORCH_LAYER - 2 * 131_072
    # N = 4, one group: its input and all 4 layers at once, what no recomputation holds.
    none = replace(s, train_recompute="none")
    assert _stage(replace(s, train_recompute_every=4)) == _stage(none) == 4 * TORCH_LAYER
    # pp 2: each stage's chunk of 2 blocks is one group.
    pp = replace(s, parallel_pp=2, train_num_microbatches=2)
    assert ck.checkpointed_layers(pp.model, pp.parallel, pp.train) == 1


def test_megatron_block_method_checkpoints_the_first_blocks():
    # Megatron's block N = 2 on 4 blocks: the 1st and 2nd keep their input (131,072 B each), the 3rd
    # and 4th everything (TORCH_LAYER each); backward has freed the 4th and 3rd before it recomputes
    # the 2nd, so no working set: 262,144 + 2 · TORCH_LAYER.
    s = spec("tiny", **BASE, train_recompute="full", train_recompute_every=2, train_recompute_method="block")
    m, p, t = s.model, s.parallel, s.train
    assert ck.checkpointed_layers(m, p, t) == ck.recomputed_layers(m, p, t) == 2
    assert act.recompute_working_set(m, p, t, engine="torch") == 0
    assert _stage(s) == 262_144 + 2 * TORCH_LAYER
    # Every 2nd (torchtitan) keeps the same, but its last block is checkpointed: + TORCH_LAYER − 131,072.
    assert _stage(replace(s, train_recompute_method="every")) == 262_144 + 3 * TORCH_LAYER - 131_072
    # megatron: 262,144 + 2 · 2,359,296 = 4,980,736.
    assert _stage(s, "megatron") == 4_980_736


def test_rotary_tables_and_checkpointed_casts():
    from harness.estimate import estimate
    from harness.estimate import states as st
    from harness.estimate.params import layer_params, stage_params

    # Every attention keeps FP32 cos and sin of (s/c) × head_dim: tiny (head_dim 32), s 256, 4 layers.
    assert st.rotary_tables(4, seq_len=256, cp=1, head_dim=32) == 4 * 2 * 4 * 256 * 32
    assert st.rotary_tables(4, seq_len=256, cp=2, head_dim=32) == 4 * 2 * 4 * 128 * 32
    s = spec("tiny", **BASE, train_precision="bf16", train_recompute="full")
    m, p, t = s.model, s.parallel, s.train
    terms = estimate(s, engine="torch").worst.terms
    assert terms["params"] == 4 * stage_params(m, stage=0, pp=1) + st.rotary_tables(
        4, seq_len=256, cp=1, head_dim=32
    )
    # One rank, BF16 autocast: the cache is cleared before backward, so every checkpointed block's casts
    # are gone (2 B per parameter of its 4 layers); under a pipeline they stay (0).
    assert act.checkpointed_casts(m, p, t, autocast=True) == 2 * 4 * layer_params(m)
    pp2 = replace(s, parallel_pp=2, train_num_microbatches=2)
    assert act.checkpointed_casts(m, pp2.parallel, pp2.train, autocast=True) == 0
    assert act.checkpointed_casts(m, p, replace(s, train_recompute="none").train, autocast=True) == 0
    none = estimate(replace(s, train_recompute="none"), engine="torch").worst.terms
    assert none["param_copies"] - terms["param_copies"] == 2 * 4 * layer_params(m)
