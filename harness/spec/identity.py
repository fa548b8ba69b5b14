"""A spec's canonical form, its flat record fields, and the stable ``config_id`` that two spellings of
the same run share."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import fields
from typing import Any

from harness.spec.types import (
    ADDED_FIELD_DEFAULTS,
    CONFIG_ID_VERSION,
    DeviceSpec,
    InvalidSpec,
    ModelSpec,
    ParallelSpec,
    RunSpec,
    TrainSpec,
    stage_layers,
)
from harness.spec.validate import problems


def canonical(spec: RunSpec) -> RunSpec:
    """Validate ``spec`` and return its canonical form; raise :class:`InvalidSpec` with every reason.

    The canonical form resolves ``dp``/``world_size`` and resets fields that have no effect, so that
    the same run spelled two ways gets one ``config_id``: ``pp_schedule``/``virtual_stages`` when
    pp = 1, ``sequence_parallel`` when tp = 1, ``cp_load_balance`` when cp = 1; and it resolves
    ``num_microbatches`` None to pp; ``recompute_every`` and ``recompute_method`` when recompute is not
    full; and Megatron's methods where they checkpoint every block alone, as ``every`` 1 does:
    ``uniform`` with N = 1, ``block`` with N at least the layers of every model chunk
    (L/(pp·virtual_stages) when even); ``pp_layers`` to () where its counts are all equal; and
    ``grad_sync`` to ``last`` where one micro-batch or one data-parallel rank leaves nothing to choose
    and under pipelining (torch's schedules reduce after the last micro-batch);
    ``fsdp_reshard_after_forward`` to ``always`` but at ZeRO-3 with ``default`` over several ranks without
    a pipeline (the head kept unsharded), ZeRO-3 whose policy resolves to ``never`` (``default`` with
    pp > 1) becoming ZeRO-2, which is that run.
    """
    reasons = problems(spec)
    if reasons:
        raise InvalidSpec(reasons)
    return canonical_form(spec)


def canonical_zero(zero_stage: int, reshard: str, *, pp: int, shards: int) -> tuple[int, str]:
    """The canonical (``zero_stage``, ``fsdp_reshard_after_forward``) of a layout with ``pp`` stages
    and ``shards`` = dp·cp data-parallel ranks: ZeRO-3 whose policy resolves to never (``never``, or
    ``default`` with pp > 1) is ZeRO-2, which is that run; ``default`` stays only where it differs from
    ``always`` — ZeRO-3 over several ranks without a pipeline, whose final norm and head are a unit of
    their own kept unsharded after forward; everything else is ``always``. (Also ``plan``'s, which
    builds its candidates in canonical form field by field.)"""
    if zero_stage == 3 and (reshard == "never" or (reshard == "default" and pp > 1)):
        return 2, "always"
    keep_head = zero_stage == 3 and reshard == "default" and pp == 1 and shards > 1
    return zero_stage, "default" if keep_head else "always"


def canonical_grad_sync(grad_sync: str, *, num_microbatches: int, shards: int, pp: int) -> str:
    """``grad_sync`` as the canonical form keeps it: ``last`` where nothing is accumulated over
    data-parallel ranks (one micro-batch, one rank) or under a pipeline, whose schedules in torch reduce
    after the last micro-batch whatever the trainer asks (pipelining/stage.py:
    set_requires_gradient_sync(False) / no_sync until the last backward), which is what torchtitan's
    every_microbatch does under pp."""
    return "last" if num_microbatches == 1 or shards == 1 or pp > 1 else grad_sync


def canonical_form(spec: RunSpec) -> RunSpec:
    """The canonical form of a spec that has already passed :func:`problems` (no re-validation)."""
    p = spec.parallel
    dp = p.dp if p.dp is not None else p.world_size // (p.tp * p.pp * p.cp)
    reshard = p.fsdp_reshard_after_forward
    if spec.train.loss_chunks > 1 and reshard == "always" and p.pp == 1:
        # The chunked loss gathers the head's own unit and keeps it through its slices, then reshards
        # it, under either policy (runner/parallel/loss.py): the same run as torchtitan's "default".
        # Not under a pipeline, where "default" reshards no block (found by the deep property that a
        # second pipeline stage never costs memory: it had turned ZeRO-3 into ZeRO-2).
        reshard = "default"
    zero, reshard = canonical_zero(p.zero_stage, reshard, pp=p.pp, shards=dp * p.cp)
    p = dataclasses.replace(
        p,
        dp=dp,
        world_size=dp * p.tp * p.pp * p.cp,
        pp_schedule=p.pp_schedule if p.pp > 1 else "1f1b",
        virtual_stages=p.virtual_stages if p.pp > 1 else 1,
        sequence_parallel=p.sequence_parallel if p.tp > 1 else False,
        cp_load_balance=p.cp_load_balance if p.cp > 1 else False,
        zero_stage=zero,
        fsdp_reshard_after_forward=reshard,
        pp_layers=() if len(set(p.pp_layers)) <= 1 else tuple(p.pp_layers),  # () or uneven
    )
    t = spec.train
    if t.num_microbatches is None:
        t = dataclasses.replace(t, num_microbatches=p.pp)
    chunk_layers = max(stage_layers(dataclasses.replace(spec, parallel=p))) // p.virtual_stages
    if t.recompute != "full" or (
        (t.recompute_method == "uniform" and t.recompute_every == 1)
        or (t.recompute_method == "block" and t.recompute_every >= chunk_layers)
    ):
        t = dataclasses.replace(t, recompute_every=1, recompute_method="every")
    sync = canonical_grad_sync(t.grad_sync, num_microbatches=t.num_microbatches, shards=p.dp * p.cp, pp=p.pp)
    if sync != t.grad_sync:
        t = dataclasses.replace(t, grad_sync=sync)
    model = spec.model
    if not model.num_experts:
        model = _dense(model)
    if model.head_dim is not None and model.head_dim * model.num_heads == model.hidden_size:
        model = dataclasses.replace(model, head_dim=None)  # the default head size, spelled out
    coeff = model.moe_aux_loss_coeff
    if model.num_experts and type(coeff) is not float:  # (an int 0 is 0.0: one id)
        model = dataclasses.replace(model, moe_aux_loss_coeff=float(coeff))
    imbalance = float(t.moe_imbalance) if model.num_experts else 1.0  # (an int 2 is 2.0: one id)
    if imbalance != t.moe_imbalance or type(t.moe_imbalance) is not float:
        t = dataclasses.replace(t, moe_imbalance=imbalance)
    return dataclasses.replace(spec, model=model, parallel=p, train=t)


MOE_FIELDS = (
    "num_experts",
    "experts_per_token",
    "moe_ffn_hidden_size",
    "num_shared_experts",
    "moe_router",
    "moe_norm_topk",
    "moe_aux_loss_coeff",
    "moe_dense_layers",
)


def _dense(m: ModelSpec) -> ModelSpec:
    """A dense model's mixture-of-experts fields at their defaults (they have no effect)."""
    moe = {k: v for k, v in ADDED_FIELD_DEFAULTS["model"].items() if k in MOE_FIELDS}
    return m if all(getattr(m, k) == v for k, v in moe.items()) else dataclasses.replace(m, **moe)


def flat(spec: RunSpec) -> dict[str, Any]:
    """The spec as record columns: ``model_hidden_size``, ``parallel_tp``, ``train_seq_len``, …"""
    out: dict[str, Any] = {}
    for section in ("model", "parallel", "train", "device"):
        for key, value in dataclasses.asdict(getattr(spec, section)).items():
            out[f"{section}_{key}"] = value
    return out


def config_id(spec: RunSpec) -> str:
    """Stable 16-hex-digit id of the canonical spec (model shape, layout, training shape, device).

    The model and device are hashed by their fields, not their preset names, so renaming a preset
    keeps ids; the device's interconnect figures (used only to rank layouts) are left out.
    """
    return canonical_config_id(canonical(spec))


def canonical_config_id(spec: RunSpec) -> str:
    """:func:`config_id` of a valid spec in canonical form (``canonical_form`` of it), without
    validating it again: ``plan`` names thousands of layouts it has estimated, and validating each
    again was half of its JSON output's time."""
    payload = {
        "v": CONFIG_ID_VERSION,
        "model": {k: v for k, v in _hashed("model", spec.model).items() if k != "name"},
        "parallel": _hashed("parallel", spec.parallel),
        "train": _hashed("train", spec.train),
        "device": {"name": spec.device.name, "memory_gib": float(spec.device.memory_gib)},
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hashed(section: str, part: Any) -> dict[str, Any]:
    """A section's fields as hashed: an added field is left out while it holds its default. (The
    sections are flat dataclasses: their fields read directly give what ``dataclasses.asdict`` gives,
    at a fraction of its cost — ``plan`` names thousands of layouts.)"""
    defaults = ADDED_FIELD_DEFAULTS.get(section, {})
    return {
        k: v
        for k, v in ((f.name, getattr(part, f.name)) for f in dataclasses.fields(part))
        if not (k in defaults and v == defaults[k] and type(v) is type(defaults[k]))
    }


def raw_id(spec: RunSpec) -> str:
    """An id for a spec that may be invalid: the hash of its fields as given (prefixed ``x``), so an
    invalid point's row is found again on resume."""
    sections = {s: _hashed(s, getattr(spec, s)) for s in ("model", "parallel", "train", "device")}
    text = json.dumps({"v": CONFIG_ID_VERSION, **sections}, sort_keys=True, default=str)
    return "x" + hashlib.sha256(text.encode()).hexdigest()[:15]


def spec_id(spec: RunSpec) -> str:
    """:func:`config_id` of a valid spec, :func:`raw_id` of an invalid one: the id its row is filed under."""
    try:
        return config_id(spec)
    except InvalidSpec:
        return raw_id(spec)


def from_dict(data: dict[str, Any]) -> RunSpec:
    """Build a RunSpec from plain nested dicts (the CLI's composed config); unknown keys are an error."""
    built = {}
    for section, cls in (
        ("model", ModelSpec),
        ("parallel", ParallelSpec),
        ("train", TrainSpec),
        ("device", DeviceSpec),
    ):
        given = dict(data.get(section) or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise InvalidSpec(
                [f"unknown key {section}.{k} (known: {', '.join(sorted(known))})" for k in unknown]
            )
        missing = [f.name for f in fields(cls) if f.name not in given and f.default is dataclasses.MISSING]
        if missing:
            raise InvalidSpec([f"missing key {section}.{k}" for k in missing])
        # A list (a YAML or command-line list, a JSON array) is kept as the tuple a frozen spec holds.
        built[section] = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    return RunSpec(**built)


def from_flat(row: dict[str, Any]) -> RunSpec:
    """The inverse of :func:`flat`: a RunSpec from a record's columns (``parallel_tp``, …). A column a
    table stores as float because some rows are null (NaN) comes back as the field's int or None; an
    added field (``ADDED_FIELD_DEFAULTS``) that is missing or null takes its default."""
    data: dict[str, dict[str, Any]] = {}
    for section, cls in (
        ("model", ModelSpec),
        ("parallel", ParallelSpec),
        ("train", TrainSpec),
        ("device", DeviceSpec),
    ):
        given = {}
        for f in fields(cls):
            key = f"{section}_{f.name}"
            if key not in row:
                continue
            value = row[key]
            if getattr(value, "ndim", 0) > 0 or isinstance(value, list):  # a list column's cell
                value = tuple(int(v) for v in value)
            elif hasattr(value, "item"):  # numpy scalar
                value = value.item()
            types = (f.type if isinstance(f.type, str) else f.type.__name__).replace(" ", "").split("|")
            if isinstance(value, float) and value != value:  # NaN: a null in a float column
                value = None
            elif isinstance(value, float) and "int" in types and value.is_integer():
                value = int(value)
            if value is None and ADDED_FIELD_DEFAULTS.get(section, {}).get(f.name) is not None:
                continue  # an added field's null: a row written before it existed, beside newer rows
            given[f.name] = value
        data[section] = given
    return from_dict(data)
