"""The CUDA allocator settings a trace was made under, and which of them the model replays.

The settings come from three places, most trusted first: ``torch.cuda.memory._snapshot()
["allocator_settings"]`` (what the allocator parsed: ``max_split_size`` in bytes, ``expandable_segments``,
``garbage_collection_threshold``, ``roundup_power2_divisions`` and the string itself under the key
``PYTORCH_CUDA_ALLOC_CONF`` whichever variable it came from — torch/csrc/cuda/Module.cpp, the snapshot's
``allocator_settings``), the allocator backend (``torch.cuda.get_allocator_backend()``), and the
environment (:func:`alloc_conf_from_env`). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The environment variables torch reads its allocator settings from, the one that wins first. torch 2.13
# (the wheel's include/c10/cuda/CUDAAllocatorConfig.h ``CUDAAllocatorConfig::instance``, and
# c10/core/AllocatorConfig.cpp ``AcceleratorAllocatorConfig::instance``, whose list is
# {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}, first set one parsed;
# libc10.so holds the three strings in that order) lets the older name win, "to keep the parsing order
# stable", although include/c10/core/AllocatorConfig.h's comment calls PYTORCH_ALLOC_CONF the primary
# one. Some releases between (c10/core/AllocatorConfig.cpp with C10_ALLOCATOR_CONFIG_PARSE_ENV) read
# PYTORCH_ALLOC_CONF first: where the snapshot says what was parsed, it is what counts.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# Keys that change where blocks go and that the model replays.
MODELLED = ("expandable_segments", "max_split_size_mb", "backend")
# Keys that leave the layout of a trace's blocks alone: host (pinned) memory, locking, CUDA graphs,
# how an out-of-memory is raised. ``per_process_memory_fraction`` is the capacity, which the replay
# takes separately.
NEUTRAL = (
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold",
    "pinned_max_cached_size",
    "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom",
    "per_process_memory_fraction",
)
ASYNC_BACKEND = "cudaMallocAsync"


def alloc_conf_from_env(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(variable, value) of the allocator settings torch 2.13 parses from ``environ`` (see
    ``ALLOC_CONF_VARS``); (None, None) when neither is set."""
    for name in ALLOC_CONF_VARS:
        value = environ.get(name)
        if value is not None:
            return name, value
    return None, None


def parse_conf(conf: str) -> dict[str, str]:
    """``"expandable_segments:True,roundup_power2_divisions:[256:1,>:4]"`` as {key: value}; a bracketed
    list stays one value (the allocator's ConfigTokenizer keeps ``[...]`` together)."""
    out: dict[str, str] = {}
    depth, item = 0, ""
    for ch in conf + ",":
        if ch == "," and depth == 0:
            key, _, value = item.partition(":")
            if key.strip():
                out[key.strip()] = value.strip()
            item = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        item += ch
    return out


@dataclass(frozen=True)
class ReplaySettings:
    """What the replay is run with, and why it cannot be (``skipped``, None when it can)."""

    expandable_segments: bool = False
    max_split_size_mb: float | None = None
    skipped: str | None = None


def replay_settings(
    *, backend: str | None, snapshot_settings: Mapping[str, Any] | None, conf: str | None
) -> ReplaySettings:
    """The replay's settings from the allocator ``backend``, the snapshot's ``allocator_settings`` and
    the settings string (``conf``: the snapshot's, else the environment's); ``skipped`` names what the
    model lacks (the cudaMallocAsync backend keeps no history; roundup_power2_divisions,
    garbage_collection_threshold, max_non_split_rounding_mb, large_segment_size_mb and any key not known
    here change where blocks go in ways it does not model)."""
    keys = parse_conf(conf or "")
    if backend == ASYNC_BACKEND or keys.get("backend") == ASYNC_BACKEND:
        return ReplaySettings(skipped="allocator backend cudaMallocAsync: no caching allocator, no history")
    lacking = sorted(k for k in keys if k not in MODELLED and k not in NEUTRAL)
    snap = dict(snapshot_settings or {})
    if float(snap.get("garbage_collection_threshold") or 0) > 0:
        lacking.append("garbage_collection_threshold")
    roundup = snap.get("roundup_power2_divisions")
    if isinstance(roundup, Mapping) and any(int(v) for v in roundup.values()):
        lacking.append("roundup_power2_divisions")
    if lacking:
        names = ", ".join(sorted(set(lacking)))
        return ReplaySettings(skipped=f"allocator settings the model lacks: {names}")
    if "expandable_segments" in snap:
        expandable = bool(snap["expandable_segments"])
    else:
        expandable = keys.get("expandable_segments", "False") == "True"
    max_split_mb: float | None = None
    split = snap.get("max_split_size")
    # The snapshot writes the unset value (SIZE_MAX) as int64: -1; treat anything of 2**62 B and up
    # as unset too.
    if isinstance(split, int) and 0 < split < 2**62:
        max_split_mb = split / 2**20
    elif split is None and "max_split_size_mb" in keys:
        max_split_mb = float(keys["max_split_size_mb"])
    return ReplaySettings(expandable_segments=expandable, max_split_size_mb=max_split_mb)
