"""The pipeline's boundary terms (harness/estimate/pipeline.py), worked out by hand in the comments: the
receive buffers, the sends 1F1B and interleaved 1F1B keep, the receive buffer a first block saves."""

from __future__ import annotations

import pytest
from conftest import replace, spec

from harness.estimate import pipeline as pipe

BASE = dict(train_seq_len=256, train_micro_batch_size=2)


def test_torch_pipeline_receive_buffers_per_virtual_stage():
    # One boundary activation s·b·h = 65,536 elements · 2 B = 131,072 B per micro-batch and direction.
    one = 131_072
    s = replace(spec("tiny", **BASE), parallel_pp=2, train_num_microbatches=8)
    m, p, t = s.model, s.parallel, s.train
    # 1F1B: each rank receives from its one neighbour, and the last keeps the gradient it sent back
    # during the next backward (one_f_one_b_sends_kept); megatron reuses one buffer per direction.
    assert [pipe.pp_p2p(m, p, t, stage=i, engine="torch") for i in (0, 1)] == [8 * one, 9 * one]
    # Over gloo stage 0's warm-up send (W = 2, m = 8 ≥ 3) stays held by its work too.
    assert pipe.pp_p2p(m, p, t, stage=0, engine="torch", gloo=True) == 9 * one
    assert pipe.pp_p2p(m, p, t, stage=0, engine="megatron") == one
    # Interleaved, v = 2: rank 0 holds stages 0 (gradients in) and 2 (activations and gradients in),
    # rank 1 stages 1 and 3 (the last: activations in): 3 per micro-batch on both (measured on the
    # runner: 24 buffers of s·b·h for 8 micro-batches on each rank).
    s = replace(s, parallel_pp_schedule="interleaved_1f1b", parallel_virtual_stages=2)
    m, p, t = s.model, s.parallel, s.train
    # … plus the sends the runtime schedule keeps until the step ends (issue 15), at the last forward:
    # rank 0's warm-up (2 − 1)·2 + 2·1 = 4, so 16 − 4 − 1 = 11 backwards done, over chunks 0 (1 kept
    # each: its activation send) and 2 (2: activation and gradient): 11·3//2 = 16; rank 1's warm-up
    # 2, 13 done over chunks 1 (2) and 3 (1, the gradient): 13·3//2 = 19.
    assert [pipe.interleaved_sends_kept(p, t, stage=i) for i in (0, 1)] == [16, 19]
    assert [pipe.pp_p2p(m, p, t, stage=i, engine="torch") for i in (0, 1)] == [40 * one, 43 * one]
    # Plain 1F1B waits on each send as it goes: nothing kept.
    assert (
        pipe.interleaved_sends_kept(
            replace(s, parallel_pp_schedule="1f1b", parallel_virtual_stages=1).parallel, t, stage=0
        )
        == 0
    )


@pytest.mark.parametrize(
    "model, pp, m, gloo, kept",
    [
        # W = min(m, pp − stage): the gradient sent back is kept on stages > 0 when m > W; over gloo the
        # warm-up's send of micro-batch W − 2 when W ≥ 2 and m ≥ 2W − 1.
        ("small3", 3, 3, True, [0, 2, 1]),  # W = 3, 2, 1: stage 0 m < 5; stage 1 both; stage 2 the gradient
        ("small3", 3, 3, False, [0, 1, 1]),
        ("tiny", 2, 2, True, [0, 1]),  # W = 2, 1: m = 2 < 3 on stage 0; stage 1 m > 1
        ("tiny", 4, 8, True, [1, 2, 2, 1]),  # W = 4, 3, 2, 1
    ],
)
def test_one_f_one_b_keeps_what_it_sent(model, pp, m, gloo, kept):
    s = spec(model, parallel_pp=pp, train_num_microbatches=m)
    got = [pipe.one_f_one_b_sends_kept(s.parallel, s.train, stage=i, gloo=gloo) for i in range(pp)]
    assert got == kept
    gpipe = replace(s, parallel_pp_schedule="gpipe")  # its peak is the first backward: nothing dropped yet
    assert [
        pipe.one_f_one_b_sends_kept(gpipe.parallel, gpipe.train, stage=i, gloo=gloo) for i in range(pp)
    ] == [0] * pp


def test_a_stage_first_block_saves_its_receive_buffer_when_nothing_casts_it():
    # tiny, s 256, b 2, pp 2, 2 micro-batches: a boundary is s·b·h = 65,536 elements; stage 1 holds one
    # micro-batch in flight (1F1B: min(pp − 1, m)).
    s = spec("tiny", **BASE, parallel_pp=2, train_num_microbatches=2)
    m, p, t = s.model, s.parallel, s.train
    fp32 = replace(s, train_precision="fp32").train
    # FP32: the composite norm keeps its FP32 input, the buffer itself; stage 0 receives nothing.
    assert [pipe.received_input_saved(m, p, fp32, stage=i, engine="torch") for i in (0, 1)] == [0, 4 * 65_536]
    # BF16 under autocast: FP32 boundaries and an FP32 norm input: the same.
    assert pipe.received_input_saved(m, p, t, stage=1, engine="torch", autocast=True) == 4 * 65_536
    # BF16 without autocast (FSDP2, replicate) on the CPU: the norm upcasts a copy; CUDA's fused norm
    # keeps the BF16 buffer.
    assert pipe.received_input_saved(m, p, t, stage=1, engine="torch") == 0
    assert pipe.received_input_saved(m, p, t, stage=1, engine="torch", fused_norm=True) == 2 * 65_536
    # Full recomputation's checkpoint keeps the block's input whatever the dtypes; every 2nd block
    # leaves the first block alone, and its norm rule applies.
    full = replace(s, train_recompute="full").train
    assert pipe.received_input_saved(m, p, full, stage=1, engine="torch") == 2 * 65_536
    every2 = replace(s, train_recompute="full", train_recompute_every=2).train
    assert pipe.received_input_saved(m, p, every2, stage=1, engine="torch") == 0
    assert pipe.received_input_saved(m, p, t, stage=1, engine="megatron", autocast=True) == 0
