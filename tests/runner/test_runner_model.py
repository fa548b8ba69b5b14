"""The runner's model and its parallel wrappers do what the spec says (issue 15): ``train.attention``
picks the SDPA kernel that runs, also in context-parallel attention; a tied model stays tied under
tensor parallelism (and through DDP's local-tensor view of it); the recomputation modes wrap the blocks
they name, and torchtitan's op policy keeps the ops it lists.

Each check runs in a fresh interpreter (torch work and process groups stay out of the test process);
the distributed ones on PyTorch's fake process group, which needs no peers.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import in_fresh_process, spec

from harness.runner.parallel.recompute import checkpoint_groups, checkpointed_layers

SDPA_FUSED = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _attention_ops(cp: int) -> dict[str, list[str]]:
    """The ATen ops one forward of ``tiny`` dispatches with each kernel, with ``cp`` context-parallel
    ranks (fake group)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.runner.model import Llama
    from harness.runner.parallel.context import apply_cp

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    s = spec("tiny", train_seq_len=32)
    tokens = torch.zeros(1, 32 // cp, dtype=torch.long)
    if cp > 1:
        dist.init_process_group("fake", rank=0, world_size=cp, store=FakeStore())
        mesh = dist.device_mesh.init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    out = {}
    for kernel in ("flash", "math"):
        model = Llama(s.model, seq_len=32, attention=kernel)
        if cp > 1:
            apply_cp(model, mesh, seq_len=32, load_balance=True)
        with Ops() as ops:
            model(tokens)
        out[kernel] = ops.seen
    return out


@pytest.mark.parametrize("cp", [1, 2], ids=["plain", "context-parallel"])
def test_attention_kernel_is_the_one_asked_for(cp):
    # Before issue 15 the model ignored train.attention: SDPA picked the fused CPU kernel for both.
    # tiny has 4 layers: 4 fused-kernel calls with flash; with math none, and per layer two bmm
    # (QKᵀ and AV) and a softmax.
    ops = in_fresh_process(_attention_ops, cp)
    flash, math = ops["flash"], ops["math"]
    assert flash.count(SDPA_FUSED) == 4 and "aten.bmm.default" not in flash
    assert SDPA_FUSED not in math
    assert math.count("aten.bmm.default") == 2 * 4
    assert math.count("aten._safe_softmax.default") == 4


def _tied_parameter_counts(tp: int) -> dict[str, int]:
    """Elements in the distinct parameters of tied ``tiny`` on one rank and under ``tp`` (DTensor numel
    is the global size), and after DDP's local-tensor view (local numel × tp)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.runner.model import Llama
    from harness.runner.parallel.tensor import apply_tp, localize_for_ddp

    m = dataclasses.replace(spec("tiny").model, tie_embeddings=True)
    single = sum(p.numel() for p in Llama(m, seq_len=32).parameters())
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    mesh = dist.device_mesh.init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = Llama(m, seq_len=32)
    apply_tp(model, mesh, sequence_parallel=True, loss_parallel=True)
    sharded = sum(p.numel() for p in model.parameters())
    same = model.output.weight is model.tok_embeddings.weight
    localize_for_ddp(model)
    local = sum(p.numel() * tp for p in model.parameters())
    same_local = model.output.weight is model.tok_embeddings.weight
    return {"single": single, "tp": sharded, "ddp_local": local, "tied": same, "tied_local": same_local}


def test_tied_embeddings_stay_tied_under_tensor_parallel():
    # tiny tied: 1.79e6 untied parameters less the head's v·h = 4096·128 = 524,288. Before issue 15 the
    # tp plan gave the head a DTensor of its own: tp count = single + 524,288. Every tp-sharded matrix
    # divides by 2 and the norms are replicated, so the local count × 2 overcounts only the norms
    # (2 per layer + the final one = 9 vectors of 128 = 1,152 elements).
    counts = in_fresh_process(_tied_parameter_counts, 2)
    assert counts["tied"] and counts["tied_local"]
    assert counts["tp"] == counts["single"]
    assert counts["ddp_local"] == counts["single"] + 9 * 128


def test_op_policy_keeps_torchtitans_save_list_but_every_second_mm():
    # A pure function of the op (no tensor work): asked here directly.
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from harness.runner.parallel.recompute import op_policy

    class Ctx:
        is_recompute = False

    policy = op_policy()
    ops = [torch.ops.aten.mm.default] * 4 + [
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten.silu.default,
        torch.ops.aten.max.default,
    ]
    decisions = [("save" if policy(Ctx(), op) == CheckpointPolicy.MUST_SAVE else "recompute") for op in ops]
    assert decisions == [
        "save", "recompute", "save", "recompute",  # mm 1-4: the 2nd and 4th recomputed
        "save",  # the flash kernel
        "recompute",  # not on the list
        "save",  # max
    ]  # fmt: skip


def test_recompute_every_counts_like_torchtitan():
    # torchtitan's layer option N wraps the block whose 1-based count is a multiple of N.
    assert checkpointed_layers(4, every=1) == [0, 1, 2, 3]
    assert checkpointed_layers(4, every=2) == [1, 3]
    assert checkpointed_layers(8, every=3) == [2, 5]
    assert checkpointed_layers(2, every=3) == []


def test_megatron_methods_group_blocks_like_megatron():
    # transformer_block.py _checkpointed_forward: uniform runs custom(l, l + N) per checkpoint, block
    # checkpoints layers 0..N-1 alone.
    assert checkpoint_groups(4, method="uniform", every=2) == [[0, 1], [2, 3]]
    assert checkpoint_groups(5, method="uniform", every=2) == [[0, 1], [2, 3], [4]]
    assert checkpoint_groups(4, method="block", every=3) == [[0], [1], [2]]
    assert checkpoint_groups(2, method="block", every=3) == [[0], [1]]
    assert checkpoint_groups(4, method="every", every=2) == [[1], [3]]


def test_uniform_groups_keep_parameter_names():
    import torch

    from harness.runner.model import Llama
    from harness.runner.parallel.recompute import apply_recompute

    s = spec("tiny", train_seq_len=32, train_precision="fp32")
    # One intra-op thread while building the models here: an OpenMP thread pool started in this (the
    # test) process is not fork-safe, and every single-rank run forked from it later in the suite hung
    # in its first parallel region (2 threads) until its timeout.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = Llama(s.model, seq_len=32)
        grouped = Llama(s.model, seq_len=32)
    finally:
        torch.set_num_threads(threads)
    apply_recompute(grouped, mode="full", every=2, method="uniform")
    assert grouped.checkpoint_groups == [["0", "1"], ["2", "3"]]
    # No block is wrapped or renamed: FSDP2's units, the pipeline split and tying see the same names.
    assert [n for n, _ in grouped.named_parameters()] == [n for n, _ in ref.named_parameters()]
    # The groups' numerics are checked through the runner: test_runner_parallel.py's uniform layouts
    # match the single-rank loss.
