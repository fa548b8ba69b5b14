"""What every command's rendering shares: byte units (GiB = 2^30 bytes, MiB = 2^20, only in cli/render), a
layout's one-line description, the terms' meanings."""

from __future__ import annotations

import re
from typing import Any

from harness.spec import RunSpec

GIB = 2**30
MIB = 2**20

# What each row of the estimate table holds (explain=true prints it under the table).
TERM_MEANINGS = {
    "params": (
        "the rank's weights as stored (its shard under ZeRO-3/FSDP, its tp/pp slice);"
        " torch: and each layer's rotary tables"
    ),
    "grads": "gradients alive at the forward/backward peak",
    "optimizer": "AdamW state (two moments, and FP32 master weights where the engine keeps them)",
    "activations": "what the layers save for backward, for every micro-batch in flight",
    "token_ids": "the input token ids of the micro-batches in flight (stage 0)",
    "output_activations": "the final norm's output (last stage)",
    "logits": "the LM head's output (last stage)",
    "param_copies": "compute-dtype (BF16) copies of the weights kept from forward to backward",
    "fsdp_allgather": "ZeRO-3: unsharded layers gathered for the current and the prefetched layer",
    "grad_reduce": "ZeRO-2/3: one layer's unsharded gradients before their reduce-scatter",
    "tp_allgather": "sequence parallel: the full-sequence buffer at a layer boundary",
    "pp_p2p": "pipeline send/receive buffers of a stage-boundary activation",
    "cp_kv_allgather": "context parallel: one layer's gathered K and V",
    "loss": "the cross-entropy's FP32 logits and their gradient (last stage)",
    "step_grads": "gradients made after the peak, alive during the optimizer step instead",
    "optimizer_step": "the foreach AdamW step's temporaries",
}
# format=json's units, said in the JSON itself (the table prints utilisation as a percentage).
JSON_UNITS = {
    "*_bytes": "bytes",
    "*_utilisation": "ratio of that level (allocated, reserved, device) to capacity_bytes (0.8 = 80 %)",
    "utilisation": "estimate: the allocated level's ratio; plan: the level the verdict is on (device)",
    "threshold": "ratio (0.8 = 80 %)",
}
# Bumped when a JSON field is renamed or changes meaning (fields are only ever added within a version).
SCHEMA_VERSION = 1


def json_envelope(record: dict) -> dict:
    """Every command's JSON closes with the same fields: ``notes`` (what it said on stderr, added to
    any of its own), ``units`` and ``schema_version`` (issue 31 item 6)."""
    from harness.cli.config import SAID

    record["notes"] = [*record.get("notes", []), *SAID]
    record["units"] = JSON_UNITS
    record["schema_version"] = SCHEMA_VERSION
    return record


def human(n_bytes: float) -> str:
    """Bytes for people: GiB (2^30) from 1 GiB up, MiB (2^20) below, KiB under 1 MiB."""
    if abs(n_bytes) >= GIB:
        return f"{n_bytes / GIB:.2f} GiB"
    if abs(n_bytes) >= MIB:
        return f"{n_bytes / MIB:.1f} MiB"
    if n_bytes == 0:
        return "0"
    return f"{n_bytes / 1024:.1f} KiB"


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f}"


def _legend(text: str, width: int = 110) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def human_bytes_in(text: str) -> str:
    """A message with byte counts (``peak 35806396 B``) in human units (``peak 34.1 MiB``)."""
    return re.sub(r"\b(\d{4,}) ?B\b", lambda m: human(int(m.group(1))), text)


def layout_line(spec: RunSpec) -> str:
    p = spec.parallel
    parts = [f"dp={p.dp}", f"tp={p.tp}", f"pp={p.pp}", f"cp={p.cp}", f"zero={p.zero_stage}"]
    if p.tp > 1:
        parts.append(f"sp={'on' if p.sequence_parallel else 'off'}")
    if p.pp > 1:
        parts.append(p.pp_schedule + (f"(v={p.virtual_stages})" if p.virtual_stages > 1 else ""))
        if p.pp_layers:
            parts.append("layers=" + "+".join(map(str, p.pp_layers)))
    if p.cp > 1:
        parts.append(f"cp_balance={'on' if p.cp_load_balance else 'off'}")
    if p.ep > 1:
        parts.append(f"ep={p.ep}")
    return " ".join(parts) + f"  (world {p.world})"


def recompute_label(recompute: str, every: Any = 1, method: Any = "every") -> str:
    """``full``, ``full/2`` (every 2nd block), ``full/uniform2`` or ``full/block2`` (Megatron's
    ``--recompute-method`` with ``--recompute-num-layers 2``): the recomputation as tables print it."""
    if recompute != "full" or every is None or every != every:
        return str(recompute)
    if method in ("uniform", "block"):
        return f"full/{method}{int(every)}"
    return f"full/{int(every)}" if int(every) > 1 else "full"


def train_line(spec: RunSpec) -> str:
    t = spec.train
    rc = recompute_label(t.recompute, t.recompute_every, t.recompute_method)
    return (
        f"seq {t.seq_len} × micro-batch {t.micro_batch_size} × {t.num_microbatches} micro-batches "
        f"(global batch {spec.global_batch_size}), recompute {rc}, {t.precision}, "
        f"{t.attention} attention"
    )


def verdict(
    device_bytes: float, capacity_bytes: float, threshold: float, allocated_bytes: float | None = None
) -> str:
    """The verdict on a device level: ``fits`` within the safety margin (``threshold``, a ratio of the
    capacity), ``over the safety margin`` between it and the card (with the headroom left), ``does NOT
    fit`` over the card (by how much). Never "fits" above 100 % (issue 31). ``allocated_bytes``: the
    same level without the allocator's reserve (the tensors and what lives outside the allocator);
    where it fits and the device level does not, the card's allocator decides (issue 32): it fits
    after flushing its cache, or runs out by fragmentation, which only a replay against the card
    (``run.mode=fake``) tells apart."""
    if device_bytes <= threshold * capacity_bytes:
        return "fits"
    if device_bytes <= capacity_bytes:
        return f"over the safety margin ({human(capacity_bytes - device_bytes)} of headroom left)"
    over = human(device_bytes - capacity_bytes)
    if allocated_bytes is not None and allocated_bytes <= capacity_bytes:
        return (
            f"does NOT fit at the reserved level ({over} over the card; the tensors fit: only after "
            "cache flushes, or out of memory by fragmentation)"
        )
    return f"does NOT fit ({over} over the card)"


# The words for harness.alloc.CAPACITY_VERDICTS (a trace replayed against the card's capacity).
CAPACITY_WORDS = {
    "fits": "fits",
    "fits_after_flush": "fits only after {n} cache flush(es): the allocator released its cache and "
    "retried (slower)",
    "oom_fragmentation": "out of memory by fragmentation: the tensors fit, the allocator's reserve does not",
    "oom_allocated": "out of memory: the tensors alone exceed the card",
}


def capacity_words(verdict_name: str, retries: int | None) -> str:
    """``sim_capacity_verdict`` in words."""
    return CAPACITY_WORDS.get(verdict_name, verdict_name).format(n=retries or 0)


def with_stack(text: str, stack: Any) -> str:
    """A table with the stack it assumed (``harness.spec.ResolvedStack``) as its second line."""
    title, _, rest = text.partition("\n")
    return f"{title}\n{stack.line()}\n{rest}" if rest else f"{title}\n{stack.line()}"
