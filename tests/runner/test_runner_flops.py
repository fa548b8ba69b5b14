"""The estimator's model FLOPs against PyTorch's FlopCounterMode on the runner's own model.

FlopCounterMode counts matmuls exactly; it has no formula for the CPU flash-attention kernel, so the
attention runs on the MATH backend here (``attention="math"``), whose QKᵀ and AV batched matmuls it
counts (without causal halving, which is the ``megatron`` convention). Embedding lookups, norms and
elementwise ops are not matmuls and are in neither count.
"""

from __future__ import annotations

from conftest import in_fresh_process, spec

from harness.estimate.flops import model_flops_per_step


def _count(s) -> int:
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from harness.runner.model import Llama

    torch.manual_seed(0)
    model = Llama(s.model, seq_len=s.train.seq_len, attention="math")
    tokens = torch.randint(0, s.model.vocab_size, (s.train.micro_batch_size, s.train.seq_len))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops()


def test_forward_backward_flops_equal_the_megatron_formula():
    s = spec("tiny", train_seq_len=64, train_micro_batch_size=2, train_precision="fp32")
    assert in_fresh_process(_count, s) == model_flops_per_step(s, convention="megatron")
