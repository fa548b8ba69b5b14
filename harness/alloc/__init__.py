"""A model of PyTorch's CUDA caching allocator (``allocator``) and the allocation traces it replays
(``trace``): the reserved peak a GPU would show, computed without a GPU.

May import: the standard library and sortedcontainers; never torch.
"""

from harness.alloc.allocator import CachingAllocator, OutOfMemory, ReplayResult, round_size
from harness.alloc.trace import TraceError, load_trace, replay

__all__ = [
    "CachingAllocator",
    "OutOfMemory",
    "ReplayResult",
    "TraceError",
    "load_trace",
    "replay",
    "round_size",
]
