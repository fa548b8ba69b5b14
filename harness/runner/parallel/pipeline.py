"""Pipeline parallelism with ``torch.distributed.pipelining``: manual stage split, 1F1B / GPipe /
interleaved 1F1B schedules.

Each rank builds the full model, deep-copies it per stage it owns and deletes what the stage does not
own (torchtitan's approach), so every stage starts from the reference weights. Interleaved schedules
use the "loop" placement: rank r owns stages r, r + pp, r + 2·pp, …
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stage_ids(*, pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    return [pp_rank + k * pp for k in range(virtual_stages)]


def split_stage(model: nn.Module, *, stage: int, num_stages: int, blocks: range) -> nn.Module:
    """A copy of ``model`` holding only stage ``stage``'s layers, ``blocks`` (spec.chunk_layer_ranges:
    even, or parallel.pp_layers), and the embedding / head at the ends."""
    part = copy.deepcopy(model)
    for key in list(part.layers.keys()):
        if int(key) not in blocks:
            del part.layers[key]
    if stage != 0:
        part.tok_embeddings = None
    if stage != num_stages - 1:
        part.norm = None
        part.output = None
    return part


def build_schedule(
    modules: list[nn.Module],
    ids: list[int],
    *,
    num_stages: int,
    group,
    device: torch.device,
    schedule: str,
    num_microbatches: int,
    loss_fn: Callable,
):
    """Wrap each owned stage module in a PipelineStage and return the schedule that runs them."""
    stages = [
        PipelineStage(mod, sid, num_stages, device, group=group)
        for mod, sid in zip(modules, ids, strict=True)
    ]
    cls = SCHEDULES[schedule]
    if cls is ScheduleInterleaved1F1B:
        return cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
