"""Per-point claims: at most one sweep runs a point at a time, on one host or on many sharing
``results_dir`` over NFS (issue 12: two sweeps on one directory ran every point twice, at once).

A claim is ``<results_dir>/.claims/<config_id>.claim``, created with ``O_CREAT | O_EXCL`` (atomic on
NFS v3 and later, unlike ``fcntl`` locks), holding the claimer's host, pid and sweep token. Its holder
touches it every ``HEARTBEAT_S``: a claim whose holder is dead (same host: its pid is gone) or whose
heartbeat is older than ``EXPIRE_S`` (another host) is taken over. The jobs of the sweep that claimed
a point carry its token and run under that claim.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

CLAIM_DIR = ".claims"
HEARTBEAT_S = 15.0
EXPIRE_S = 120.0  # eight missed heartbeats, and room for the clocks of two hosts to differ
GUARD_EXPIRE_S = 30.0  # a takeover is two file operations: a guard older than this is a dead taker's

_held: dict[Path, str] = {}  # claim file -> token, touched by the heartbeat thread
_lock = threading.Lock()
_thread: threading.Thread | None = None


def new_token() -> str:
    return uuid.uuid4().hex


def claim_path(results_dir: str | Path, cid: str) -> Path:
    return Path(results_dir) / CLAIM_DIR / f"{cid}.claim"


def _host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def read_claim(path: Path) -> tuple[dict[str, Any] | None, float | None]:
    """The claim's content (None: unreadable, e.g. still being written) and its age in seconds (None:
    there is no claim)."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None, None
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        info = None
    return (info if isinstance(info, dict) else None), age


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22): with the pid it
    names one process, even after the pid is reused. None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # (the command name may hold spaces)
    return fields[19] if len(fields) > 19 else None


def is_live(info: dict[str, Any] | None, age: float) -> bool:
    """A claim still held. On this host: its process exists — the same process, by its start time —
    whatever the claim's age (a sweep stopped with Ctrl-Z sends no heartbeat and still holds its points:
    issue 29, where its expired claims were taken and the point ran twice). On another host: its
    heartbeat is recent — and not dated more than ``EXPIRE_S`` ahead of this host's clock: such a
    claim (a clock far ahead, or a file touched by hand) would otherwise block its point until that
    date (issue 29), and a heartbeat that far off cannot be told from a dead one."""
    if info and info.get("host") == _host() and isinstance(info.get("pid"), int):
        if not _pid_alive(info["pid"]):
            return False
        started = info.get("pid_start")
        return started is None or started == process_start(info["pid"])
    return -EXPIRE_S <= age <= EXPIRE_S


def describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "a claim being written"
    return f"{info.get('host')} pid {info.get('pid')}"


def _write(path: Path, token: str, *, exclusive: bool) -> bool:
    data = json.dumps(
        {
            "host": _host(),
            "pid": os.getpid(),
            "pid_start": process_start(os.getpid()),
            "token": token,
            "since": time.time(),
        }
    )
    if not exclusive:  # our own sweep's claim, now held by this job: replace its content atomically
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(data)
        os.replace(tmp, path)
        return True
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(data)
    return True


def _take_over(path: Path, token: str) -> bool:
    """Replace a dead or expired claim, one taker at a time (a guard file, itself O_EXCL)."""
    guard = path.with_name(f"{path.name}.takeover")
    try:
        if time.time() - guard.stat().st_mtime > GUARD_EXPIRE_S:
            guard.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False  # someone else is taking it over
    try:
        info, age = read_claim(path)
        if age is not None and is_live(info, age):  # it came back to life meanwhile
            return False
        path.unlink(missing_ok=True)
        return _write(path, token, exclusive=True)
    finally:
        guard.unlink(missing_ok=True)


def try_claim(results_dir: str | Path, cid: str, token: str) -> tuple[bool, dict[str, Any] | None]:
    """Claim point ``cid`` for the sweep ``token``: (True, None) when this process holds it now (a
    new claim, a dead one taken over, or its own sweep's), else (False, the live holder's claim)."""
    path = claim_path(results_dir, cid)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        if _write(path, token, exclusive=True):
            _hold(path, token)
            return True, None
        info, age = read_claim(path)
        if age is None:  # released meanwhile: try again
            continue
        if info and info.get("token") == token:
            _write(path, token, exclusive=False)  # this job now holds its sweep's claim
            _hold(path, token)
            return True, None
        if is_live(info, age):
            return False, info
        if _take_over(path, token):
            _hold(path, token)
            return True, None
    return False, read_claim(path)[0]


def holder(results_dir: str | Path, cid: str, token: str) -> dict[str, Any] | None:
    """Another sweep's live claim on ``cid`` (None when there is none, or it is this sweep's)."""
    info, age = read_claim(claim_path(results_dir, cid))
    if age is None or (info and info.get("token") == token) or not is_live(info, age):
        return None
    return info or {}


def still_mine(results_dir: str | Path, cid: str, token: str) -> bool:
    """Whether the claim on ``cid`` is still this sweep's (checked before its row is written)."""
    info, age = read_claim(claim_path(results_dir, cid))
    return age is not None and bool(info) and info.get("token") == token


def release(results_dir: str | Path, cid: str, token: str) -> None:
    """Drop this sweep's claim on ``cid`` (another sweep's, taken over meanwhile, is left alone)."""
    path = claim_path(results_dir, cid)
    with _lock:
        _held.pop(path, None)
    info, _ = read_claim(path)
    if info and info.get("token") == token:
        # On a results_dir gone read-only the claim stays: it names this process, which is ending, and the
        # next sweep takes a dead process's claim over (is_live). The error that stopped the sweep is the
        # one to report, not this one.
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def release_all(token: str) -> None:
    with _lock:
        mine = [p for p, t in _held.items() if t == token]
    for path in mine:
        release(path.parent.parent, path.name[: -len(".claim")], token)


def _hold(path: Path, token: str) -> None:
    global _thread
    with _lock:
        _held[path] = token
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_heartbeat, name="harness-claims", daemon=True)
            _thread.start()


def _heartbeat() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        beat()


def beat() -> None:
    """Touch every claim this process holds (and forget those that are no longer its own)."""
    with _lock:
        held = list(_held.items())
    for path, token in held:
        info, _ = read_claim(path)
        try:
            if not info or info.get("token") != token:  # released, or another sweep's now
                raise FileNotFoundError(path)
            os.utime(path)  # NFS: the server's clock sets the time
        except OSError:
            with _lock:
                _held.pop(path, None)
