"""ZeRO-1's partitions, rank by rank (issue 30 item 3): ``ZeroRedundancyOptimizer`` gives each rank of
its group whole parameters, largest first, so the ranks of one stage hold different AdamW states; the
engine's stage figure is the most-loaded partition's (params.zero1_partitions) and each rank is judged
against its own (analysis/stages.partition_errors)."""

from __future__ import annotations

import dataclasses

import pandas as pd
from conftest import in_fresh_process, spec

from harness.analysis.calibrate import prepare
from harness.analysis.stages import partition_errors
from harness.estimate.params import param_numels, zero1_partitions
from harness.runner.supervisor import run_point


def _model_numels(m, pp: int) -> list[list[int]]:
    import torch

    from harness.runner.model import Llama
    from harness.runner.parallel.pipeline import split_stage
    from harness.spec import chunk_layer_ranges

    with torch.device("meta"):
        model = Llama(m, seq_len=64)
    if pp == 1:
        return [sorted(p.numel() for p in model.parameters())]
    s = dataclasses.replace(spec("tiny", parallel_pp=pp, train_num_microbatches=pp), model=m)
    blocks = chunk_layer_ranges(s)
    stages = [split_stage(model, stage=i, num_stages=pp, blocks=blocks[i]) for i in range(pp)]
    return [sorted(p.numel() for p in stage.parameters()) for stage in stages]


def _every_model_numels(cases) -> list:
    return [_model_numels(m, pp) for m, pp in cases]


def test_the_engine_lists_the_runner_models_parameter_tensors():
    models = [
        dataclasses.replace(spec("tiny").model, **kw)
        for kw in ({}, {"tie_embeddings": True}, {"qkv_bias": True})
    ]
    # a mixture of experts: the router, every expert's three matrices and the shared experts' (issue 27)
    models.append(dataclasses.replace(spec("tiny_moe").model, num_shared_experts=2))
    cases = [(m, pp) for m in models for pp in (1, 2)]
    for (m, pp), model in zip(cases, in_fresh_process(_every_model_numels, cases), strict=True):
        engine = [sorted(g for g, _ in param_numels(m, stage=i, pp=pp)) for i in range(pp)]
        assert engine == model, (m, pp)


def test_each_zero1_rank_measures_its_own_partition():
    # tiny over 4 ranks: ranks 0 and 1 take the embedding and the head (524,288 elements each), ranks 2
    # and 3 the rest (369,216 each, within a norm vector): their peaks differ by 8 B per element of
    # AdamW state, 1,241,088 B, and each rank is within 0.5 % of the engine's figure for its partition.
    s = spec("tiny", parallel_dp=4, parallel_zero_stage=1, train_seq_len=256, train_precision="fp32")
    parts = zero1_partitions(param_numels(s.model, stage=0, pp=1), 4)
    assert parts[:2] == [524_288, 524_288] and abs(parts[2] - parts[3]) == 128
    real = run_point(s, timeout_s=240)
    assert real["status"] == "ok", real["error"]
    peaks = real["per_rank_peak_bytes"]
    assert abs((peaks[0] - peaks[3]) - 8 * (parts[0] - parts[3])) <= 1024, (peaks, parts)
    errors = partition_errors(prepare(pd.DataFrame([real])))
    assert list(errors["partition"]) == [0, 1, 2, 3]
    assert errors["error"].abs().max() <= 0.005, errors
