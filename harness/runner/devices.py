"""Which CUDA devices this machine has, asked without initialising CUDA here, and which device each rank
of a point takes.

The supervisor forks its ranks from this process, and CUDA does not survive a fork: once this process
has called ``cudaGetDeviceCount`` (``torch.cuda.is_available()`` without NVML, ``get_device_name``,
``get_device_properties``, any allocation), every forked rank's first CUDA call raises "Cannot re-initialize
CUDA in forked subprocess" (torch/cuda/__init__.py ``_lazy_init``: ``_is_in_bad_fork``). So the questions a
supervisor has about its GPUs are asked by a throwaway child (:func:`probe`), whose answer is kept for the
life of the process, and a rank's device name comes back in the rank's own result.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
from typing import Any

PROBE_TIMEOUT_S = 120.0


def _probe_child(conn) -> None:
    """In the child: CUDA's answers, sent as one JSON string (the child may initialise CUDA freely)."""
    out: dict[str, Any] = {"device_count": 0}
    try:
        import torch

        out["torch_version"] = torch.__version__
        out["cuda_version"] = torch.version.cuda
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            out["device_count"] = n
            props = torch.cuda.get_device_properties(0)
            out["device_name"] = props.name
            out["total_memory_bytes"] = int(props.total_memory)
            out["fused_gqa_fp32"] = _fused_gqa_runs(torch, torch.float32)
    except Exception as exc:  # a broken driver is an answer too: no usable device
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    conn.send(json.dumps(out))
    conn.close()


def _fused_gqa_runs(torch, dtype) -> bool:
    """Whether SDPA's fused kernels (flash, memory-efficient, cuDNN: ``train.attention=flash``) run
    grouped-query attention in ``dtype`` on this torch and device. Flash and cuDNN take 16-bit inputs
    only; the memory-efficient kernel took ``enable_gqa`` in later releases than the flag itself
    (torch 2.11 on the GPU check's H200 refuses it: "No available kernel")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(1, 4, 16, 64, device="cuda", dtype=dtype)
    kv = torch.zeros(1, 2, 16, 64, device="cuda", dtype=dtype)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        with sdpa_kernel(backends):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return True
    except RuntimeError:
        return False


@functools.cache
def probe() -> dict[str, Any]:
    """This machine's CUDA devices as a forked child sees them: ``device_count`` (0 without CUDA),
    ``device_name``, ``total_memory_bytes``, ``fused_gqa_fp32``, versions; ``error`` if the child failed.
    Computed once per process; this process never initialises CUDA."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_probe_child, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        if parent.poll(PROBE_TIMEOUT_S):
            return json.loads(parent.recv())
        return {"device_count": 0, "error": f"the CUDA probe did not answer within {PROBE_TIMEOUT_S:g} s"}
    except (EOFError, OSError, ValueError) as exc:
        return {"device_count": 0, "error": f"the CUDA probe died: {exc!r}"[:300]}
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()


def visible_devices() -> int:
    """CUDA devices this process may use (``CUDA_VISIBLE_DEVICES`` applied), asked of the probe."""
    return int(probe().get("device_count") or 0)


def placement(
    *, node_world: int, task_ranks: int, first_local: int, visible: int, share: bool, pp: int
) -> tuple[int, int] | str:
    """How this task's ranks map onto the GPUs it sees: (the device index of its first rank, ranks per
    device group), or why they cannot run.

    ``node_world`` ranks run on this node, ``task_ranks`` of them in this task, the first at node-local
    index ``first_local``; ``visible`` devices are visible to this task. Every node's rank on a GPU of its
    own when the task sees all of the node's (index = node-local rank); when a job scheduler gives each
    task its own GPUs (Slurm's per-task binding) the task sees only those, and its ranks are indexed
    among them (index = rank within the task). Fewer GPUs than ranks means ranks share a GPU, over gloo,
    each capped at a share of its memory: refused unless ``run.share_gpus=true``, and never with
    pipelining (send/recv of CUDA tensors over gloo crashes)."""
    if visible >= node_world:
        return first_local, node_world
    if visible >= task_ranks:
        return 0, task_ranks
    if not share:
        return (
            f"{node_world} ranks on this node but {visible} visible CUDA device(s): ranks would share "
            "GPUs over gloo with a divided memory cap; set run.share_gpus=true to allow it, or place fewer "
            "ranks per node (sweep.ranks_per_node)"
        )
    if pp > 1:
        return (
            f"{node_world} ranks on this node share {visible} CUDA device(s), and pipelining over gloo "
            "cannot send CUDA tensors: give each rank a GPU"
        )
    return first_local, node_world


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
