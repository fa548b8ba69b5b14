"""Give a model built on the meta device its memory and its initial weights, on the rank's device, after
the parallelisms have decided which part each rank holds (torchtitan's pattern: build on meta, shard,
``to_empty``, initialise).

No rank ever holds the whole model: a pipeline rank's stages are meta copies until here, FSDP2 shards
meta parameters, so a 70B point needs no host memory for the model and no GPU memory beyond the rank's
shards (issue 33: eight ranks each building the whole FP32 model on the host needed 416 GB for
Llama-2-13B, and the freed whole-model blocks stayed in the caching allocator's cache, inflating the
measured reserved memory). Each parameter's initial value is a function of its name alone
(``model.initial_value``), made whole on the device one parameter at a time, and each rank copies its
shard of it (``distribute_tensor`` without communication: every rank made the same whole value), so any
layout starts from the single-rank reference's weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from harness.runner.model import Attention, init_key, initial_value
from harness.spec import ModelSpec

MODEL_SEED = 0


def on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


@torch.no_grad()
def materialize(
    modules: list[nn.Module], device: torch.device, m: ModelSpec, *, seed: int = MODEL_SEED
) -> None:
    """Allocate ``modules``' parameters and buffers on ``device`` and fill them: each parameter with its
    shard of its initial value, the rotary tables recomputed for the positions each attention holds."""
    for mod in modules:
        shared = _shared_parameters(mod)
        mod.to_empty(device=device)
        _retie(shared)
        for name, param in mod.named_parameters():
            key = init_key(name, tied=m.tie_embeddings)
            whole = initial_value(m, key, tuple(param.shape), seed=seed, device=device)
            if isinstance(param, DTensor):
                shard = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(whole)
            del whole
        for sub in mod.modules():
            if isinstance(sub, Attention):
                sub.reset_rope()
    if device.type == "cuda":
        # The whole values were made one at a time and freed: give their cached blocks back, so that the
        # allocator starts the steps holding the rank's own tensors only.
        torch.cuda.empty_cache()


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The places each parameter registered in more than one module is held (tied embeddings: the head's
    ``weight`` is the embedding's)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((sub, name))
    return [refs for refs in places.values() if len(refs) > 1]


def _retie(shared: list[list[tuple[nn.Module, str]]]) -> None:
    """Make every place of a shared parameter hold one object again: ``to_empty`` from the meta device
    cannot swap a parameter's data in place (torch ``Module._apply``: no compatible shallow-copy type),
    so it registers a new Parameter in each module, and a tied head would train apart from its
    embedding."""
    for (first, first_name), *rest in shared:
        param = first._parameters[first_name]
        for sub, name in rest:
            if sub._parameters[name] is not param:
                sub._parameters[name] = param
