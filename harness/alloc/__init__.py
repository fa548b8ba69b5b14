"""A model of PyTorch's CUDA caching allocator (``allocator``), the allocation traces it replays
(``trace``) and the allocator settings it replays them under (``settings``): the reserved peak a GPU
would show, computed without a GPU.

May import: the standard library and sortedcontainers; never torch.
"""

from harness.alloc.allocator import CachingAllocator, OutOfMemory, ReplayResult, round_size
from harness.alloc.settings import ReplaySettings, alloc_conf_from_env, replay_settings
from harness.alloc.trace import CAPACITY_VERDICTS, TraceError, capacity_verdict, load_trace, replay, seed

__all__ = [
    "CAPACITY_VERDICTS",
    "CachingAllocator",
    "OutOfMemory",
    "ReplayResult",
    "ReplaySettings",
    "TraceError",
    "alloc_conf_from_env",
    "capacity_verdict",
    "load_trace",
    "replay",
    "replay_settings",
    "round_size",
    "seed",
]
