"""Named training stacks: the memory-level choices of the trainer a user runs, as spec keys.

Two runs of one layout differ by gigabytes depending on choices the layout does not name: when data
parallelism reduces gradients under accumulation, whether ZeRO-3 keeps the gathered parameters under
pipelining, whose optimizer and gradient buffers are allocated. A stack names one trainer's set of them
(issue 28). The composed config leaves each choice ``null`` unless the user (or a study) sets it; the
stack fills what is left, and every command says in one line which stack and which values it took.

- ``torchtitan``: torchtitan's own defaults (the default on GPU devices). Sources (pytorch/torchtitan):
  the training loop runs forward and backward per micro-batch with no ``no_sync`` or
  ``set_requires_gradient_sync(False)``, so FSDP2 reduce-scatters every micro-batch
  (``train.grad_sync=every_microbatch``); ``parallelism.fsdp_reshard_after_forward = "default"``:
  resharded after forward without pipelining, kept with it
  (``parallel.fsdp_reshard_after_forward=default``; its final norm and head are a unit never resharded
  after forward); activation checkpointing ``SelectiveAC`` by default, per operator
  (``train.recompute=op``); FSDP2 mixed precision BF16 parameters, FP32 reduction; tensor and sequence
  parallelism saving the gathered input, loss parallelism (this runner's code path); the head and the
  loss over 8 slices of the tokens (``ChunkedLossWrapper`` in its Llama configs, ``components/loss.py``:
  ``train.loss_chunks=8``). docs/stacks.md
  lists each choice with its source, and those this project does not model.
- ``megatron``: Megatron-LM / NeMo: BF16 parameters, an FP32 main-gradient buffer, the distributed
  optimizer's FP32 master weights; gradients reduced after the last micro-batch; sequence parallelism
  saves the sharded input; no recomputation unless asked (``recompute_granularity`` None).
  This runner cannot run it: the ``megatron`` engine judges it.
- ``harness``: this runner's first choices, under which every CPU study was measured (the default on
  the CPU, where those studies live): reduce after the last micro-batch, ZeRO-3 always resharded, no
  recomputation unless asked.

No torch here: ``estimate`` and ``plan`` resolve stacks without it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from harness.spec.identity import from_dict
from harness.spec.types import InvalidSpec, RunSpec


@dataclass(frozen=True)
class Stack:
    """One trainer's choices: ``choices`` maps a dotted spec key to the value the stack takes where the
    config leaves it null; ``engine`` is the estimator engine that models it; ``runnable`` whether this
    project's runner can run it (``run``, ``sweep``)."""

    name: str
    about: str
    engine: str
    runnable: bool
    choices: dict[str, Any] = field(default_factory=dict)


STACKS = {
    "torchtitan": Stack(
        "torchtitan",
        "torchtitan's defaults: FSDP2 reduce-scatter after every micro-batch, not resharded under "
        "pipelining, chunked loss",
        "torch",
        True,
        {
            "train.grad_sync": "every_microbatch",
            "parallel.fsdp_reshard_after_forward": "default",
            "train.recompute": "op",
            "train.loss_chunks": 8,
        },
    ),
    "megatron": Stack(
        "megatron",
        "Megatron-LM: BF16 weights, FP32 main gradients, distributed optimizer (the megatron engine)",
        "megatron",
        False,
        {
            "train.grad_sync": "last",
            "parallel.fsdp_reshard_after_forward": "always",
            "train.recompute": "none",
            "train.loss_chunks": 1,
        },
    ),
    "harness": Stack(
        "harness",
        "this runner's own choices (the CPU studies): reduce after the last micro-batch, ZeRO-3 resharded",
        "torch",
        True,
        {
            "train.grad_sync": "last",
            "parallel.fsdp_reshard_after_forward": "always",
            "train.recompute": "none",
            "train.loss_chunks": 1,
        },
    ),
}
AUTO = "auto"  # torchtitan on a GPU device, harness on the CPU


@dataclass(frozen=True)
class ResolvedStack:
    """What a command assumed: the stack (``requested`` may be ``auto``), the engine, the value of each
    of the stack's keys, and the keys the config set to another value than the stack's."""

    name: str
    requested: str
    engine: str
    choices: dict[str, Any]
    overridden: tuple[str, ...]

    def line(self) -> str:
        """One line: ``stack: torchtitan (auto: GPU device) · train.grad_sync=every_microbatch · …``."""
        why = (
            f" ({AUTO}: {'the CPU' if self.name == 'harness' else 'a GPU device'})"
            if self.requested == AUTO
            else ""
        )
        keys = [f"{k}={v}{' (set)' if k in self.overridden else ''}" for k, v in self.choices.items()]
        return f"stack: {self.name}{why} · engine {self.engine} · " + " · ".join(keys)

    def as_record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requested": self.requested,
            "engine": self.engine,
            "choices": dict(self.choices),
            "overridden": list(self.overridden),
        }


def stack_of(cfg: dict[str, Any]) -> Stack:
    """The stack a composed config names (``stack``: a name or ``auto``); an unknown name raises
    :class:`InvalidSpec` naming the known ones."""
    name = str(cfg.get("stack") or AUTO)
    if name == AUTO:
        device = cfg.get("device") or {}
        name = "harness" if str(device.get("name", "cpu")) == "cpu" else "torchtitan"
    if name not in STACKS:
        raise InvalidSpec([f"stack={name!r} must be one of {AUTO}, {', '.join(STACKS)}"])
    return STACKS[name]


def apply_stack(cfg: dict[str, Any]) -> tuple[dict[str, Any], ResolvedStack]:
    """A copy of the composed ``cfg`` whose stack keys left null hold the stack's values, and what was
    assumed. A key the config sets keeps its value and is listed as overridden where it differs."""
    stack = stack_of(cfg)
    out = copy.deepcopy(cfg)
    choices, overridden = {}, []
    for key, value in stack.choices.items():
        section, name = key.split(".")
        part = out.setdefault(section, {})
        if part.get(name) is None:
            part[name] = value
        elif part[name] != value:
            overridden.append(key)
        choices[key] = part[name]
    engine = out.get("engine")
    engine = engine.get("name") if isinstance(engine, dict) else engine
    engine = stack.engine if engine in (None, AUTO) else str(engine)
    resolved = ResolvedStack(stack.name, str(cfg.get("stack") or AUTO), engine, choices, tuple(overridden))
    return out, resolved


def require_runnable(cfg: dict[str, Any], command: str) -> None:
    """``run`` and ``sweep`` of a stack this runner cannot run: :class:`InvalidSpec` saying so and what to
    do instead."""
    stack = stack_of(cfg)
    if not stack.runnable:
        raise InvalidSpec(
            [
                f"stack={stack.name}: this runner cannot {command} it ({stack.about}); estimate and plan "
                f"judge it with the {stack.engine} engine; stack=torchtitan or stack=harness run here"
            ]
        )


def stacks_of(spec: RunSpec) -> tuple[str, ...]:
    """The stacks whose choices (recomputation aside, which a study varies on purpose) give this
    canonical ``spec``: each stack's values put in and the canonical form taken again. A point with
    nothing to choose (one micro-batch, one data-parallel rank, no ZeRO-3) matches every stack."""
    import dataclasses

    from harness.spec.identity import canonical_form

    out = []
    for stack in STACKS.values():
        fields: dict[str, dict[str, Any]] = {"parallel": {}, "train": {}}
        for key, value in stack.choices.items():
            section, name = key.split(".")
            if key != "train.recompute":
                fields[section][name] = value
        other = dataclasses.replace(
            spec,
            parallel=dataclasses.replace(spec.parallel, **fields["parallel"]),
            train=dataclasses.replace(spec.train, **fields["train"]),
        )
        if canonical_form(other) == spec:
            out.append(stack.name)
    return tuple(out)


def config_spec(cfg: dict[str, Any]) -> RunSpec:
    """The RunSpec of a composed config, its stack applied (the one conversion every command uses)."""
    resolved, _ = apply_stack(cfg)
    return from_dict({k: resolved.get(k) for k in ("model", "parallel", "train", "device")})
