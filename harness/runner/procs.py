"""The processes of a point: forked ranks tied to their supervisor's life, rank 0's store on loopback,
atomic result files, SIGTERM as an exception, and the leftovers of supervisors that died.

Shared by the supervisor, its workers and the fake-run pool (none of them imports another for these)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any

POINT_DIR_PREFIX = "harness-point-"  # + the supervisor's pid: a leftover's owner is known (issue 12)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Terminated(BaseException):
    """SIGTERM reached the supervisor or one of its ranks (``kill``, a job scheduler): the point's ranks
    are reaped, no record is written (the point did not run to an outcome; a resumed sweep runs it
    again), and the exception goes on up. A BaseException so that handlers of ordinary errors let it
    through; the command line turns it into one line and exit status 143 (128 + SIGTERM)."""


class SlurmSignal(BaseException):
    """Slurm signalled the job (submitit's ``--signal=USR2@…`` before the time limit, TERM at the limit or
    a preemption) and reached the supervisor or one of its ranks: the point is cut short, its ranks are
    reaped and its row says ``timeout`` (harness.sweep.launch.run_job). A BaseException, as
    :class:`Terminated`: no handler of ordinary errors on the way (a file read that tolerates a broken
    report) may swallow it and let the point end as a rank's ``crash`` (CI, stop 39: a time-limited
    point's row said ``crash``)."""


def raise_slurm_signal(signum, frame):
    raise SlurmSignal(f"Slurm sent {signal.Signals(signum).name}: the job's time limit (or a preemption)")


# The machine's fault, not the point's: no room or no write access where the supervisor or a rank keeps
# its files (TMPDIR, results_dir), too many open files. Issue 29: a full TMPDIR turned 6 of 8 points into
# `crash` rows that counted as done. Such a point has no outcome: no record, and the sweep stops.
HOST_FAULT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EMFILE, errno.ENFILE})
HOST_FAULT_EXIT = 75  # a rank's exit status for one (BSD's EX_TEMPFAIL): the supervisor raises HostFault


class HostFault(OSError):
    """The machine failed a point (:data:`HOST_FAULT_ERRNOS`, from the supervisor or a rank): no record."""


def host_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is the machine's fault rather than the point's."""
    return isinstance(exc, HostFault) or (isinstance(exc, OSError) and exc.errno in HOST_FAULT_ERRNOS)


def _raise_terminated(signum, frame):
    raise Terminated("SIGTERM")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic: a reader (another rank, another node's task) sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def write_trace_file(trace_dir: Path, stem: str, trace: dict[str, Any]) -> str:
    """``run.trace``: a rank's allocation trace (a snapshot-shaped dict) as ``<stem>.trace.json`` in
    ``trace_dir``, written whole (temporary name, then rename); its path."""
    path = Path(trace_dir) / f"{stem}.trace.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(trace))
    os.replace(tmp, path)
    return str(path)


def die_with_parent(parent_pid: int) -> None:
    """In a forked rank: ask the kernel to SIGKILL this process when its supervisor dies, however it
    dies (``kill -9`` of a sweep left its ranks running for hours, re-parented to init: issue 12).
    The supervisor may have died between the fork and this call: then the parent is already another
    process, and the rank ends at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's own reaping still holds
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_leftover_point_dirs(root: str | None = None) -> list[str]:
    """Remove the temporary point directories (``harness-point-<pid>-*``) whose supervisor is dead: a
    supervisor killed with SIGKILL cannot remove its own. Those of live supervisors (another sweep on
    this host) are left alone. Returns the directories removed."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for path in root.glob(f"{POINT_DIR_PREFIX}*"):
        owner = path.name[len(POINT_DIR_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def host_oom_kills() -> int | None:
    """The kernel's count of processes its OOM killer ended (``oom_kill`` of /proc/vmstat, or of this
    cgroup's memory.events under cgroup v2); None where neither says."""
    total = None
    for path in ("/proc/vmstat", "/sys/fs/cgroup/memory.events"):
        try:
            for line in Path(path).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    total = (total or 0) + int(value)
        except (OSError, ValueError):
            continue
    return total


_STORE = None  # rank 0's TCPStore server bound to the loopback interface (kept alive for the rank)


def _bind_store_to_loopback(port: int, world: int, timeout_s: float) -> None:
    """Rank 0 of a point whose ranks are all on this host: start the TCPStore server on 127.0.0.1
    only (torch's own listens on every interface, issue 12). ``init_process_group`` then finds it:
    its store is multi-tenant and reuses this process's server on the same port."""
    global _STORE
    from datetime import timedelta

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError:  # the port was taken meanwhile: torch's own bind will say so
        sock.close()
        return
    _STORE = dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


def _rank_main(rank_fn, parent_pid: int, loopback: bool, rank: int, spec, **kwargs) -> None:
    """A forked rank: tied to its supervisor's life, its store on loopback when every rank is local."""
    die_with_parent(parent_pid)
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay local too
        if rank == 0:
            _bind_store_to_loopback(kwargs["port"], spec.parallel.world, kwargs["timeout_s"])
    rank_fn(rank, spec, **kwargs)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
