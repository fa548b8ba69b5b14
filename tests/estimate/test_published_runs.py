"""The published GPU runs of scripts/published_runs.py still compose to valid estimates, and the
engine's reserved level stays where those runs put it (torchtitan's own max reserved memory of Llama
3.1 8B with FSDP2 on H100 96 GB: the engine within 2 %, the default profile at most 1 % under and 4 %
over)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "published_runs.py"
GIB = 1 << 30


def _script():
    spec = importlib.util.spec_from_file_location("published_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PUBLISHED = _script()


@pytest.mark.parametrize("run", PUBLISHED.RUNS, ids=[r["name"] for r in PUBLISHED.RUNS])
def test_the_engine_reserved_level_against_a_published_run(run):
    row = PUBLISHED.measure(run, trace=False)
    published = run["published_gib"] * GIB
    # recorded 2026-12-07: engine -1.6 % and +0.3 % (-4.7 % and -3.5 % before op recomputation's
    # packing and working set), calibrated +0.9 % and +3.1 % (the default profile, fitted on the H100
    # grid's points without recomputation, adds its fragmentation on top: on the safe side). It was
    # +0.6 % and +2.5 % before the accumulated gradients' remainders (a term these runs, reduced after
    # every micro-batch, lack) left the profile's fit: its constant went from 713 to 1,196 MiB.
    assert abs(row["engine reserved"] / published - 1) < 0.02
    assert 0.99 * published < row["calibrated reserved"] < 1.04 * published
