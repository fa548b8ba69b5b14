"""Shared fixtures: specs built the way the CLI builds them (from the committed presets)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import yaml

from harness.spec import DeviceSpec, ModelSpec, ParallelSpec, RunSpec, TrainSpec, canonical

SWEEPS = Path(__file__).resolve().parents[1] / "sweeps"


def _single_threaded_test_process() -> None:
    """The test process runs torch on one thread. Most tests fork ranks from it, and GNU OpenMP is not
    fork-safe: once an operator here has started libgomp's thread pool (a 32 x 16 matmul does), every
    rank forked later that runs a parallel region waits in it forever. Seen: after one in-process
    test of the tracker, every later one-rank point of the suite hung in ``materialize`` (a copy's
    parallel region, libgomp's barrier) until its timeout. The ranks set their own thread count."""
    import torch

    torch.set_num_threads(1)


_single_threaded_test_process()


def preset(group: str, name: str) -> dict:
    return yaml.safe_load((SWEEPS / group / f"{name}.yaml").read_text())


def model(name: str) -> ModelSpec:
    return ModelSpec(**preset("model", name))


def device(name: str) -> DeviceSpec:
    return DeviceSpec(**preset("device", name))


def spec(model_name: str = "tiny", device_name: str = "cpu", **overrides) -> RunSpec:
    """A canonical RunSpec from presets; overrides are ``parallel_tp=2``, ``train_seq_len=512``, …"""
    par, train = {}, {}
    for key, value in overrides.items():
        section, field = key.split("_", 1)
        {"parallel": par, "train": train}[section][field] = value
    return canonical(RunSpec(model(model_name), ParallelSpec(**par), TrainSpec(**train), device(device_name)))


def replace(s: RunSpec, **overrides) -> RunSpec:
    """``replace(s, parallel_tp=4)``: a canonical copy with some parallel/train fields changed."""
    par = {"world_size": None}  # re-derived from the degrees by canonical()
    par.update({k.split("_", 1)[1]: v for k, v in overrides.items() if k.startswith("parallel_")})
    train = {k.split("_", 1)[1]: v for k, v in overrides.items() if k.startswith("train_")}
    return canonical(
        dataclasses.replace(
            s, parallel=dataclasses.replace(s.parallel, **par), train=dataclasses.replace(s.train, **train)
        )
    )


def fast_few(names, fast) -> list:
    """Parametrize over ``names`` (a dict's keys, say), marking every name not in ``fast`` slow: the
    default run keeps a few of a family, ``-m slow`` runs the rest (CI's time budget)."""
    names = list(names)
    unknown = set(fast) - set(names)
    assert not unknown, f"fast_few names cases that are not there: {sorted(unknown)}"
    return [pytest.param(n, id=n, marks=() if n in fast else pytest.mark.slow) for n in names]


@pytest.fixture
def tiny() -> RunSpec:
    return spec("tiny")


# Hypothesis: deterministic by default (a property that fails, fails on every run, never by chance:
# CI sets no variable, and a random draw once failed a CI run on a bug older than the change it
# judged), and a random "deep" profile to search harder by hand before a change lands:
# HYPOTHESIS_PROFILE=deep pytest tests/estimate/test_properties.py
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("deep", max_examples=3000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a freshly spawned interpreter. Tests that run torch work (or a process group) in
    the test process would leave OpenMP threads or a group behind for the later tests that fork ranks,
    and fake-mode work leaves state that a later fake run forked from it inherits. The worker is not
    daemonic (concurrent.futures), so ``fn`` may fork processes of its own (``run_fake``'s pool)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def trace_one(s, rank: int) -> dict:
    """One rank of ``s`` traced in fake mode (``trace_rank``), with its rank: what run_fake collects."""
    from harness.runner.fake.trace import trace_rank

    return {"rank": rank, **trace_rank(s, rank)}


def trace_all(s):
    """The record run_fake makes and its ranks, each rank traced in a spawned process of its own (as
    run_fake forks one: a fake mode's tensors must not meet another's)."""
    from harness.runner.fake.ranks import traced_ranks
    from harness.runner.fake.run import fake_record

    ranks = [in_fresh_process(trace_one, s, r) for r in traced_ranks(s)]
    return fake_record(s, ranks, wall_s=0.0, timeout_s=60), ranks


def harness_cli(*args: str, timeout: float = 600):
    """``python -m harness ARGS`` as a user runs it: its exit code, stdout and stderr."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "harness", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def scripted_tracing(monkeypatch, finishes, results):
    """``_trace_ranks`` (harness.runner.fake.pool) without processes: ``finishes`` says which running
    ranks end at each wait, in turn; ``results[rank]`` is what each returns (``extra``: the ZeRO-1
    rank it names). Returns the started and the killed ranks, in order."""
    from harness.runner.fake import pool

    started, killed, turns = [], [], iter(finishes)

    def start(spec, rank, out, kernels, trace_dir=None, *, keep_events=False):
        started.append(rank)
        return rank, out

    def wait_any(running, deadline):
        ended = next(turns)
        assert set(ended) <= set(running), (ended, sorted(running))
        for rank in ended:
            del running[rank]
        return {rank: {"rank": rank, **results[rank]} for rank in ended}

    monkeypatch.setattr(pool, "_start_child", start)
    monkeypatch.setattr(pool, "_wait_any", wait_any)
    monkeypatch.setattr(pool, "_kill", lambda proc: killed.append(proc))
    monkeypatch.setattr(pool, "_zero1_worst_rank", lambda spec, result: result.get("extra"))
    return started, killed


def ok_trace(peak, extra=None):
    return {"peak_allocated_bytes": peak, "extra": extra}


def cut(model_name: str, layers: int, device_name: str = "cpu", **overrides) -> RunSpec:
    """``spec(model_name, device_name, **overrides)`` with the model cut to ``layers`` blocks (its widths
    kept: a paper-scale mechanism traced in seconds)."""
    s = spec(model_name, device_name, **overrides)
    return dataclasses.replace(s, model=dataclasses.replace(s.model, num_layers=layers))


def stage_peaks(s: RunSpec, record: dict) -> list[tuple[int, int, int]]:
    """(stage, its most-loaded rank's measured peak, the stage's estimate) of a real run's record (the
    ranks of a stage are consecutive in ``per_rank_peak_bytes``)."""
    from harness.estimate import estimate

    stages = estimate(s).stages
    per = len(record["per_rank_peak_bytes"]) // len(stages)
    peaks = record["per_rank_peak_bytes"]
    return [(st.stage, max(peaks[st.stage * per : (st.stage + 1) * per]), st.total_bytes) for st in stages]
