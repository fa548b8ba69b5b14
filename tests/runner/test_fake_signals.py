"""A fake run stopped from outside (SIGTERM to the sweep, to its process group, Ctrl-C) stops with no
row and leaves no tracing process behind, as a real run does (test_supervisor.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import spec
from test_supervisor import children

from harness.runner.fake import pool
from harness.runner.fake.run import run_fake
from harness.runner.procs import Terminated, _raise_terminated


@pytest.fixture
def sigterm_raises():
    """SIGTERM raises Terminated in this process, as the command line sets it (cli/main.py); the forked
    tracing processes inherit the handler."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    before = children()
    yield
    signal.signal(signal.SIGTERM, previous)
    assert children() - before == set(), "a tracing process outlived the run"


def _trace_instead(monkeypatch, action):
    def trace(*args, **kwargs):
        action()
        raise AssertionError("not reached")

    monkeypatch.setattr(pool, "trace_rank", trace)


def test_sigterm_to_the_parent_kills_the_tracing_processes(monkeypatch, sigterm_raises):
    """Before: the parent raised Terminated and its tracing processes went on, then failed writing into
    the removed temporary directory (seen in a local sweep killed with SIGTERM)."""
    _trace_instead(monkeypatch, lambda: time.sleep(10_000))
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    start = time.monotonic()
    with pytest.raises(Terminated):
        run_fake(spec("tiny", parallel_dp=2), timeout_s=120, jobs=2)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("handler", ["inherited", "default"])
def test_sigterm_to_a_tracing_process_is_no_outcome(monkeypatch, sigterm_raises, handler):
    """``kill`` of a sweep's process group reaches its tracing processes. Their Terminated (or death by
    the signal) was the rank's error, a ``crash`` row, and the sweep went on to the next point."""

    def term():
        if handler == "default":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10_000)

    _trace_instead(monkeypatch, term)
    with pytest.raises(Terminated, match="traced rank 0"):
        run_fake(spec("tiny"), timeout_s=120)


def test_ctrl_c_in_a_tracing_process_is_an_interrupt(monkeypatch, sigterm_raises):
    # Python's own Ctrl-C handler, which the forked tracing process inherits: a suite started in the
    # background (nohup, &) starts with SIGINT ignored, and Python then keeps ignoring it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    _trace_instead(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            run_fake(spec("tiny"), timeout_s=120)
    finally:
        signal.signal(signal.SIGINT, previous)


def _children_of(pid: int) -> set[int]:
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry.name))
    return out


SLEEPING_FAKE_RUN = """
import time
from conftest import spec
from harness.runner.fake import pool
from harness.runner.fake.run import run_fake
pool.trace_rank = lambda *a, **k: time.sleep(10_000)
run_fake(spec("tiny"), timeout_s=300)
"""


def test_kill_9_of_the_parent_takes_the_tracing_processes_with_it():
    """``kill -9`` of a fake sweep: its tracing processes went on (re-parented) until their trace ended."""
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", SLEEPING_FAKE_RUN], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (kids := _children_of(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert kids, "no tracing process started"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{k}") for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [k for k in kids if os.path.exists(f"/proc/{k}")]
    assert not left, f"tracing processes {left} outlived their killed parent"
