"""Frozen specs of one training configuration, their single validation, and the stable config_id.

Everything below the CLI (estimator, runner, store) takes these dataclasses; nothing here imports
anything outside the standard library. A spec is built once, validated once (``problems`` lists every
reason), and put into canonical form (``canonical``) so that two spellings of the same run share one
``config_id``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any

PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
# none; selective: the attention core (Korthikanti et al. 2022); op: torchtitan's op-level policy (the
# outputs of matmuls, every second one excepted, and of the attention kernels are kept, the rest
# recomputed); full: whole transformer blocks (every ``recompute_every``-th one, or Megatron's methods).
RECOMPUTE = ("none", "selective", "op", "full")
# Which blocks full recomputation checkpoints, N = ``recompute_every`` (per pipeline stage / virtual
# chunk): every: every N-th block (torchtitan's layer option); uniform: groups of N consecutive blocks,
# each checkpointed as one unit; block: the first N blocks one by one, the rest not recomputed (Megatron's
# ``--recompute-method uniform|block --recompute-num-layers N``).
RECOMPUTE_METHODS = ("every", "uniform", "block")
PRECISIONS = ("bf16", "fp32")
ATTENTION = ("flash", "math")
# Fields added after the first study, left out of the hashed payload (config_id, raw_id) while they hold
# this default, so that every spec that existed before keeps its id.
ADDED_FIELD_DEFAULTS = {
    "train": {"recompute_every": 1, "recompute_method": "every"},
    # The device's memory-beside-tensors constants and step-time figures: config_id hashes only the
    # device's name and capacity; raw_id (invalid points) leaves them out while they hold the default.
    "device": {
        "cuda_context_mib": 0.0,
        "nccl_mib_per_communicator": 0.0,
        "cublas_workspace_mib": 0.0,
        "nccl_channels": 0,
        "nccl_buffsize_mib": None,
        "memory_gbps": None,
        "link_latency_us": None,
        "inter_node_latency_us": None,
    },
}
# Bumped whenever the canonical form or the hashed fields change: old results then get new ids
# instead of silently matching runs of a different meaning.
CONFIG_ID_VERSION = 1


class InvalidSpec(ValueError):
    """A configuration that cannot run; the message lists every reason with its arithmetic."""

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-architecture decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP, no biases."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool = False


@dataclass(frozen=True)
class ParallelSpec:
    """Degrees of the four axes and how each is realised; world = dp·tp·pp·cp.

    ``world_size`` is optional: when given it must equal the product of the degrees, and when ``dp`` is
    ``None`` it is derived from it (``dp = world_size / (tp·pp·cp)``) by :func:`canonical`.
    """

    dp: int | None = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    cp_load_balance: bool = True
    world_size: int | None = None

    @property
    def world(self) -> int:
        """Number of ranks (requires a resolved ``dp``)."""
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True)
class TrainSpec:
    """The shape of one optimizer step: micro-batch of ``micro_batch_size`` sequences of ``seq_len``
    tokens, ``num_microbatches`` of them per data-parallel rank (gradient accumulation or pipeline).
    ``num_microbatches`` None means one per pipeline stage, the fewest that fill a 1F1B pipeline
    (resolved by :func:`canonical`)."""

    seq_len: int = 256
    micro_batch_size: int = 1
    num_microbatches: int | None = None
    recompute: str = "none"
    # With recompute=full, only every N-th transformer block is checkpointed (torchtitan's layer option
    # ``selective_ac_option=N``); 1 = every block. Reset to 1 by :func:`canonical` under other modes.
    recompute_every: int = 1
    # With recompute=full, which blocks N (``recompute_every``) selects: "every" N-th (torchtitan), or
    # Megatron's "uniform" (groups of N blocks per checkpoint) or "block" (the first N blocks), N being
    # Megatron's ``--recompute-num-layers``. Reset to "every" by :func:`canonical` under other modes.
    recompute_method: str = "every"
    precision: str = "bf16"
    attention: str = "flash"
    steps: int = 3


@dataclass(frozen=True)
class DeviceSpec:
    """A device preset: capacity in GiB (2^30 bytes), dense BF16 peak in TFLOP/s (None = unknown), links,
    and the memory a process uses beside its tensors (none of these but ``name`` and ``memory_gib`` enter
    the ``config_id``)."""

    name: str
    memory_gib: float
    peak_tflops: float | None = None
    gpus_per_node: int = 8
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    # Memory beside the tensors (harness/estimate/levels.py), cited in each preset: the CUDA context and
    # NCCL's buffers live outside the caching allocator, cuBLAS's workspaces inside it. 0 on the CPU.
    cuda_context_mib: float = 0.0
    nccl_mib_per_communicator: float = 0.0
    cublas_workspace_mib: float = 0.0
    # What nccl_mib_per_communicator is made of, so that another NCCL_BUFFSIZE can be estimated: ring
    # channels per communicator, and the buffer size in MiB (None: NCCL's default, 4 MiB).
    nccl_channels: int = 0
    nccl_buffsize_mib: float | None = None
    # For the step-time model only (harness/estimate/steptime.py), like the links: not in config_id.
    memory_gbps: float | None = None
    link_latency_us: float | None = None
    inter_node_latency_us: float | None = None  # a group spanning nodes (None: link_latency_us)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


@dataclass(frozen=True)
class RunSpec:
    """One point of a study: what runs (model, parallel, train) and where (device)."""

    model: ModelSpec
    parallel: ParallelSpec
    train: TrainSpec
    device: DeviceSpec

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks (of a canonical spec)."""
        return self.parallel.dp * self.train.micro_batch_size * self.train.num_microbatches


def _field_type_problems(spec: Any, section: str) -> list[str]:
    """Fields whose value has the wrong type (a YAML typo shows up here, not deep in the arithmetic)."""
    out = []
    for f in fields(spec):
        value = getattr(spec, f.name)
        allowed = f.type if isinstance(f.type, str) else f.type.__name__
        kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
        ok = False
        for alt in allowed.replace(" ", "").split("|"):
            if alt == "None" and value is None:
                ok = True
            elif alt in kinds and isinstance(value, kinds[alt]):
                # bool is an int in Python; an int field given true/false is a mistake.
                ok = not (alt in ("int", "float") and isinstance(value, bool))
            if ok:
                break
        if not ok:
            out.append(f"{section}.{f.name}={value!r} must be {allowed}")
    return out


def _positive(section: str, spec: Any, names: tuple[str, ...]) -> list[str]:
    values = [getattr(spec, n) for n in names]
    if min(values) >= 1:
        return []
    return [f"{section}.{n}={v} must be >= 1" for n, v in zip(names, values, strict=True) if v < 1]


def type_problems(spec: RunSpec) -> list[str]:
    """Fields of ``spec`` whose value has the wrong type."""
    return [
        reason
        for section in ("model", "parallel", "train", "device")
        for reason in _field_type_problems(getattr(spec, section), section)
    ]


def problems(spec: RunSpec) -> list[str]:
    """Every reason why ``spec`` cannot run, each with the arithmetic that shows it (empty if valid)."""
    # Arithmetic on wrongly typed values would only add noise.
    return type_problems(spec) or layout_problems(spec)


def layout_problems(spec: RunSpec) -> list[str]:
    """:func:`problems` for a spec whose fields are known to have the right types (``plan`` checks the
    types of its base spec once, then the arithmetic of each candidate)."""
    m, p, t = spec.model, spec.parallel, spec.train
    microbatches = p.pp if t.num_microbatches is None else t.num_microbatches
    out = _positive(
        "model",
        m,
        ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size"),
    )
    out += _positive("parallel", p, ("tp", "pp", "cp", "virtual_stages"))
    out += _positive("train", t, ("seq_len", "micro_batch_size", "steps", "recompute_every"))
    if isinstance(t.steps, int) and t.steps == 1:
        out.append(
            "train.steps=1 must be >= 2 (a warm-up step: AdamW state appears at the first; then timed steps)"
        )
    if t.num_microbatches is not None and t.num_microbatches < 1:
        out.append(f"train.num_microbatches={t.num_microbatches} must be >= 1 (or null: one per stage)")
    if p.dp is not None and p.dp < 1:
        out.append(f"parallel.dp={p.dp} must be >= 1")
    if p.world_size is not None and p.world_size < 1:
        out.append(f"parallel.world_size={p.world_size} must be >= 1")
    if spec.device.memory_gib <= 0:
        out.append(f"device.memory_gib={spec.device.memory_gib} must be > 0")
    if out:
        return out

    # Model shape.
    if m.hidden_size % m.num_heads:
        out.append(
            f"hidden_size {m.hidden_size} % num_heads {m.num_heads} = {m.hidden_size % m.num_heads} ≠ 0"
        )
    if m.num_heads % m.num_kv_heads:
        out.append(f"num_heads {m.num_heads} % num_kv_heads {m.num_kv_heads} ≠ 0 (GQA groups must be whole)")

    # Degrees against the world size.
    rest = p.tp * p.pp * p.cp
    if p.dp is None:
        if p.world_size is None:
            out.append("parallel.dp is null and parallel.world_size is not set: one of them is needed")
        elif p.world_size % rest:
            out.append(
                f"world_size {p.world_size} is not divisible by tp·pp·cp = {p.tp}·{p.pp}·{p.cp} = {rest}"
            )
    elif p.world_size is not None and p.dp * rest != p.world_size:
        out.append(f"dp·tp·pp·cp = {p.dp}·{p.tp}·{p.pp}·{p.cp} = {p.dp * rest} ≠ world_size {p.world_size}")

    # Tensor parallel shards heads, KV heads and the vocabulary.
    for what, n in (
        ("num_heads", m.num_heads),
        ("num_kv_heads", m.num_kv_heads),
        ("ffn_hidden_size", m.ffn_hidden_size),
        ("vocab_size", m.vocab_size),
    ):
        if n % p.tp:
            out.append(f"{what} {n} % tp {p.tp} = {n % p.tp} ≠ 0")

    # Pipeline: whole layers per (virtual) stage, enough micro-batches to fill the schedule.
    if p.pp_schedule not in PP_SCHEDULES:
        out.append(f"parallel.pp_schedule={p.pp_schedule!r} must be one of {', '.join(PP_SCHEDULES)}")
    chunks = p.pp * p.virtual_stages
    if m.num_layers % chunks:
        out.append(
            f"num_layers {m.num_layers} % (pp·virtual_stages = {p.pp}·{p.virtual_stages} = {chunks}) "
            f"= {m.num_layers % chunks} ≠ 0"
        )
    if p.virtual_stages > 1 and p.pp_schedule != "interleaved_1f1b":
        out.append(
            f"virtual_stages {p.virtual_stages} > 1 needs pp_schedule=interleaved_1f1b, not {p.pp_schedule}"
        )
    if p.pp_schedule == "interleaved_1f1b":
        if p.virtual_stages < 2:
            out.append("pp_schedule=interleaved_1f1b needs virtual_stages >= 2 (with 1 it is plain 1f1b)")
        if p.pp < 2:
            out.append("pp_schedule=interleaved_1f1b needs pp >= 2")
        elif microbatches % p.pp:
            # Megatron's rule; torch's Interleaved1F1B accepts a few more counts, but the in-flight
            # accounting of the estimator (Narayanan et al. 2021) assumes whole rounds.
            out.append(
                f"interleaved_1f1b needs num_microbatches % pp = 0: {microbatches} % {p.pp} "
                f"= {microbatches % p.pp}"
            )
    if p.pp > 1 and p.pp_schedule == "1f1b" and microbatches < p.pp:
        out.append(f"1f1b needs num_microbatches >= pp: {microbatches} < {p.pp}")

    # Context parallel splits the sequence (in 2·cp chunks when head–tail load-balanced), sequence
    # parallel splits each context shard again by tp.
    cp_chunks = 2 * p.cp if (p.cp > 1 and p.cp_load_balance) else p.cp
    if t.seq_len % cp_chunks:
        how = "2·cp" if cp_chunks != p.cp else "cp"
        out.append(f"seq_len {t.seq_len} % ({how} = {cp_chunks}) = {t.seq_len % cp_chunks} ≠ 0")
    elif p.tp > 1 and p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        out.append(
            f"sequence parallel needs (seq_len/cp) % tp = 0: ({t.seq_len}/{p.cp}) % {p.tp} "
            f"= {(t.seq_len // p.cp) % p.tp}"
        )

    if p.zero_stage not in (0, 1, 2, 3):
        out.append(f"parallel.zero_stage={p.zero_stage} must be 0, 1, 2 or 3")
    for name, value, allowed in (
        ("train.recompute", t.recompute, RECOMPUTE),
        ("train.recompute_method", t.recompute_method, RECOMPUTE_METHODS),
        ("train.precision", t.precision, PRECISIONS),
        ("train.attention", t.attention, ATTENTION),
    ):
        if value not in allowed:
            out.append(f"{name}={value!r} must be one of {', '.join(allowed)}")
    return out


def canonical(spec: RunSpec) -> RunSpec:
    """Validate ``spec`` and return its canonical form; raise :class:`InvalidSpec` with every reason.

    The canonical form resolves ``dp``/``world_size`` and resets fields that have no effect, so that
    the same run spelled two ways gets one ``config_id``: ``pp_schedule``/``virtual_stages`` when
    pp = 1, ``sequence_parallel`` when tp = 1, ``cp_load_balance`` when cp = 1; and it resolves
    ``num_microbatches`` None to pp; ``recompute_every`` and ``recompute_method`` when recompute is not
    full; and Megatron's methods where they checkpoint every block alone, as ``every`` 1 does: ``uniform``
    with N = 1, ``block`` with N at least the layers of a model chunk (L/(pp·virtual_stages)).
    """
    reasons = problems(spec)
    if reasons:
        raise InvalidSpec(reasons)
    return canonical_form(spec)


def canonical_form(spec: RunSpec) -> RunSpec:
    """The canonical form of a spec that has already passed :func:`problems` (no re-validation)."""
    p = spec.parallel
    dp = p.dp if p.dp is not None else p.world_size // (p.tp * p.pp * p.cp)
    p = dataclasses.replace(
        p,
        dp=dp,
        world_size=dp * p.tp * p.pp * p.cp,
        pp_schedule=p.pp_schedule if p.pp > 1 else "1f1b",
        virtual_stages=p.virtual_stages if p.pp > 1 else 1,
        sequence_parallel=p.sequence_parallel if p.tp > 1 else False,
        cp_load_balance=p.cp_load_balance if p.cp > 1 else False,
    )
    t = spec.train
    if t.num_microbatches is None:
        t = dataclasses.replace(t, num_microbatches=p.pp)
    chunk_layers = spec.model.num_layers // (p.pp * p.virtual_stages)
    if t.recompute != "full" or (
        (t.recompute_method == "uniform" and t.recompute_every == 1)
        or (t.recompute_method == "block" and t.recompute_every >= chunk_layers)
    ):
        t = dataclasses.replace(t, recompute_every=1, recompute_method="every")
    return dataclasses.replace(spec, parallel=p, train=t)


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
    spec = canonical(spec)
    payload = {
        "v": CONFIG_ID_VERSION,
        "model": {k: v for k, v in dataclasses.asdict(spec.model).items() if k != "name"},
        "parallel": _hashed("parallel", spec.parallel),
        "train": _hashed("train", spec.train),
        "device": {"name": spec.device.name, "memory_gib": float(spec.device.memory_gib)},
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hashed(section: str, part: Any) -> dict[str, Any]:
    """A section's fields as hashed: an added field is left out while it holds its default."""
    defaults = ADDED_FIELD_DEFAULTS.get(section, {})
    return {
        k: v
        for k, v in dataclasses.asdict(part).items()
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
        built[section] = cls(**given)
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
            if hasattr(value, "item"):  # numpy scalar
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
