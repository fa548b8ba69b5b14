"""``run.trace=true`` under ``run.mode=fake`` writes each traced rank's allocation trace beside the
record, as a real run does (it was silently ignored), and the file replays to the record's figures."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import harness_cli

from harness.alloc.trace import load_trace_file, replay


def test_a_fake_run_writes_the_trace_its_figures_come_from(tmp_path):
    done = harness_cli(
        "run", "run.mode=fake", "model=tiny", "parallel.dp=2", "parallel.zero_stage=3",
        "run.trace=true", f"results_dir={tmp_path}", "format=json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    files = record["trace_files"]
    assert files == [str(tmp_path / f"{record['config_id']}.rank0.trace.json")]
    events, initial = load_trace_file(files[0])
    result = replay(events, initial_segments=initial)
    assert result.peak_reserved_bytes == record["sim_peak_reserved_bytes"]
    assert Path(files[0]).parent == tmp_path
