"""A dry run: one process stands in for one rank of a layout, with PyTorch's fake process group and
``FakeTensorMode`` — no compute, no real memory — and MemTracker measures what that rank would hold.

The same model and composer as the real run build the rank; only the process group and the tensors are
fake. What it leaves out on a GPU: the caching allocator's rounding and fragmentation, the CUDA context,
NCCL buffers, library workspaces. Measured against real runs (tests/test_dryrun.py): FSDP equal within
0.02 %; tensor parallelism about 6 % high. Known limits: DDP (ZeRO 0/1 over more than one rank) cannot
be traced (its reducer reads tensor data), and FSDP2 on a 2-D (dp × tp) mesh cannot be applied inside
FakeTensorMode (DeviceMesh concatenation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.runner.measure import PeakMemory
from harness.runner.model import Llama
from harness.runner.parallel.compose import MESH_DIMS, parallelize, train_step
from harness.specs import RunSpec, canonical


def dry_run_peak(spec: RunSpec, *, rank: int = 0) -> dict[str, Any]:
    """Peak memory of ``rank`` for one measured step after one warm-up step, traced in this process."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    spec = canonical(spec)
    p, t = spec.parallel, spec.train
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=rank, world_size=p.world, store=FakeStore())
    try:
        # Meshes are built outside FakeTensorMode (their construction reads real values).
        mesh = dist.device_mesh.init_device_mesh("cpu", (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=MESH_DIMS)
        if p.dp * p.cp > 1:
            mesh["dp", "cp"]._flatten("dp_cp")
        with FakeTensorMode():
            model = Llama(spec.model, seq_len=t.seq_len, attention=t.attention)
            par = parallelize(model, spec, mesh, torch.device("cpu"))
            del model  # as the real rank does: a pipeline stage is a copy of it
            per_rank = (t.micro_batch_size * t.num_microbatches, t.seq_len // p.cp)
            tokens = torch.randint(0, spec.model.vocab_size, per_rank)
            memory = PeakMemory(par.modules, par.optimizer, torch.device("cpu"), allocator=False)
            train_step(par, tokens, tokens, num_microbatches=t.num_microbatches)
            with memory.measure():
                train_step(par, tokens, tokens, num_microbatches=t.num_microbatches)
        return {**memory.result(), "memory_method": "mem_tracker_fake"}
    finally:
        dist.destroy_process_group()
