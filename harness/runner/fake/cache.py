"""Traced ranks of `run.mode=fake` kept on disk (``run.fake_cache=DIR``), so that a rank already traced
for the same layout on another GPU preset is not traced again.

Why it is sound: a fake trace reads the device preset only to choose CUDA's kernels or the CPU's
(``fake.gpu_kernels``); the card's capacity enters after the trace, in the record's out-of-memory
verdict (``fake.fake_record``) and in the replay of the step against what the allocator may reserve
(``sim_capacity_*``). The entry keeps the step's allocation events (compressed), and a rank taken
for another card is replayed against that card's capacity again, as its own trace would have been
(``TraceCache.load``). So the published grids, which trace the same 7B-70B layouts on an
A100 40 GB and on an H100 94 GB, need each rank traced once. An entry is found again only by the
same key: the spec without its device section, the kernels, the rank's mesh coordinates, torch's
version and a hash of every source file of the ``harness`` package — any change to the code traces
afresh, so a cached rank is always what this code would trace now.

Without ZeRO (``zero_stage=0``) a rank's trace does not depend on how many data-parallel replicas
there are, once there are two or more: every replica holds the whole model and optimizer, its
micro-batches have the same shapes, and DDP's buckets and ``replicate``'s all-reduced gradients are
the size of the model, not of dp. Their key counts dp only as "one" or "more than one" (the
data-parallel wrapper exists or not), so the 70B grid's 16, 32 and 64-GPU points of one layout
trace each rank once. ``test_without_zero_a_rank_traces_the_same_for_any_data_parallel_size``
checks it to the byte (peaks, categories, replayed allocator, every event's size and stream) and
that with ZeRO-1 it does not hold. Only completed traces are kept (never an error or a
timeout). Each entry is one JSON file, written whole (temporary file, then rename), so a sweep killed
mid-write leaves no half entry.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

from harness.spec import RunSpec, canonical


@functools.cache
def code_hash() -> str:
    """SHA-256 over the ``harness`` package's Python sources (paths and contents, in path order)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def trace_key(spec: RunSpec, rank: int, kernels: str) -> str:
    """The cache key of ``rank``'s trace of ``spec`` with ``kernels`` ("cuda" or "cpu")."""
    import torch

    spec = canonical(spec)
    parallel = dataclasses.asdict(spec.parallel)
    coords = mesh_coords(spec, rank)
    if spec.parallel.zero_stage == 0 and spec.parallel.dp > 1:
        parallel.update(dp="2 or more", world_size=None)  # (the module's docstring says why)
    payload = {
        "model": dataclasses.asdict(spec.model),
        "parallel": parallel,
        "train": dataclasses.asdict(spec.train),
        "coords": coords,
        "kernels": kernels,
        "torch": torch.__version__,
        "code": code_hash(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


def mesh_coords(spec: RunSpec, rank: int) -> dict[str, int]:
    """``rank``'s coordinates on the (pp, dp, cp, tp) mesh, innermost tp (inverse of fake.rank_of)."""
    p = spec.parallel
    rest, tp = divmod(rank, p.tp)
    rest, cp = divmod(rest, p.cp)
    pp, dp = divmod(rest, p.dp)
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}


class TraceCache:
    """Completed rank traces under ``root``, one ``<key>.json`` each."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def _path(self, spec: RunSpec, rank: int, kernels: str) -> Path:
        return self.root / f"{trace_key(spec, rank, kernels)}.json"

    def load(self, spec: RunSpec, rank: int, kernels: str) -> dict[str, Any] | None:
        """The stored result of ``rank``, its ``sim_capacity_*`` fields replayed against ``spec``'s card
        when it was traced for another; None when absent or unreadable (traced again)."""
        from harness.runner.fake.trace import card_capacity_bytes
        from harness.runner.measure.trace import capacity_fields

        try:
            entry = json.loads(self._path(spec, rank, kernels).read_text())
            result, packed = entry["result"], entry.get("events")
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if not isinstance(result, dict) or "peak_allocated_bytes" not in result:
            return None
        capacity = card_capacity_bytes(spec)
        if "sim_capacity_bytes" in result and result["sim_capacity_bytes"] != capacity:
            if packed is None:
                return None
            events = unpack_events(packed)
            peak = result["sim_peak_allocated_bytes"]
            result = {**result, **capacity_fields(events, capacity, peak_allocated_bytes=peak)}
        return result

    def store(
        self, spec: RunSpec, rank: int, kernels: str, result: dict[str, Any], events: list | None = None
    ) -> None:
        """Keep a completed trace (results without a peak are not kept) and the step's allocation
        ``events`` (what a replay against another card's capacity needs)."""
        if "peak_allocated_bytes" not in result:
            return
        entry = {"result": result, "events": pack_events(events) if events is not None else None}
        path = self._path(spec, rank, kernels)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# What the allocator model reads of an event (harness.alloc.replay); the rest is not kept.
EVENT_FIELDS = ("action", "addr", "size", "stream")


def pack_events(events: list[dict[str, Any]]) -> str:
    """``events`` as compressed text (a 70B rank's step, ~10^4 events, is a few hundred KB)."""
    rows = [[ev.get(k) for k in EVENT_FIELDS] for ev in events]
    return base64.b64encode(zlib.compress(json.dumps(rows).encode(), 6)).decode()


def unpack_events(packed: str) -> list[dict[str, Any]]:
    return [
        dict(zip(EVENT_FIELDS, row, strict=True))
        for row in json.loads(zlib.decompress(base64.b64decode(packed)))
    ]
