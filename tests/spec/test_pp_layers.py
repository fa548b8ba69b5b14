"""Uneven pipeline stages, ``parallel.pp_layers`` (issue 31 item 4): validation with the arithmetic,
one config_id for the even split however spelled, the blocks each chunk runs, and plan's split of a
model whose layers pp does not divide (Llama 3.1 405B: 126 layers)."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
from conftest import harness_cli, spec

from harness.spec import (
    InvalidSpec,
    balanced_pp_layers,
    canonical,
    chunk_layer_ranges,
    config_id,
    flat,
    from_dict,
    from_flat,
    stage_layers,
)


def layers(s, counts, **par):
    return dataclasses.replace(s, parallel=dataclasses.replace(s.parallel, pp_layers=tuple(counts), **par))


def test_bad_counts_are_refused_with_the_arithmetic():
    s = spec("tiny", parallel_pp=2, train_num_microbatches=2)  # 4 layers
    cases = {
        (1, 2): "parallel.pp_layers sum 1+2 = 3 ≠ num_layers 4",
        (0, 4): "parallel.pp_layers=[0,4]: every stage needs at least 1 block",
        (1, 1, 2): "parallel.pp_layers=[1,1,2] has 3 counts for pp = 2 stages (one per stage)",
    }
    for counts, message in cases.items():
        with pytest.raises(InvalidSpec) as e:
            canonical(layers(s, counts))
        assert e.value.reasons == [message]
    interleaved = layers(s, (1, 3), pp_schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(
        InvalidSpec, match=r"split evenly over its virtual_stages 2 chunks \(1 % 2, 3 % 2 ≠ 0\)"
    ):
        canonical(interleaved)
    zero_chunks = layers(s, (1, 3), pp_schedule="interleaved_1f1b", virtual_stages=0)
    with pytest.raises(
        InvalidSpec, match=r"parallel.virtual_stages=0 must be >= 1"
    ):  # (no ZeroDivisionError)
        canonical(zero_chunks)
    with pytest.raises(InvalidSpec, match=r"must be tuple\[int, \.\.\.\]"):
        canonical(layers(s, (1.5, 2.5)))
    # Without pp_layers, a pp that does not divide the layers says where the way out is.
    with pytest.raises(InvalidSpec, match=r"num_layers 4 % .* ≠ 0 \(uneven stages: parallel.pp_layers"):
        canonical(spec("tiny", parallel_pp=3, train_num_microbatches=3))


def test_the_even_split_is_one_config_id_however_spelled():
    s = spec("tiny", parallel_pp=2, train_num_microbatches=2)
    even = layers(s, (2, 2))
    assert canonical(even).parallel.pp_layers == ()
    assert config_id(even) == config_id(s)
    assert config_id(layers(s, (1, 3))) not in (config_id(s), config_id(layers(s, (3, 1))))


def test_a_record_and_a_command_line_list_give_back_the_spec():
    s = canonical(layers(spec("tiny", parallel_pp=2, train_num_microbatches=2), (1, 3)))
    # A parquet row holds the counts as an array; JSON and Hydra hand over a list.
    row = pd.DataFrame([flat(s)]).to_parquet()
    import io

    back = pd.read_parquet(io.BytesIO(row)).iloc[0].to_dict()
    assert from_flat(back) == s
    sections = {k: dataclasses.asdict(getattr(s, k)) for k in ("model", "parallel", "train", "device")}
    sections["parallel"]["pp_layers"] = [1, 3]
    assert from_dict(sections) == s
    # A row written before the field existed (no column, or a null beside newer rows) is the even split.
    old = {k: v for k, v in flat(canonical(spec("tiny"))).items() if k != "parallel_pp_layers"}
    assert from_flat(old).parallel.pp_layers == ()
    assert from_flat({**old, "parallel_pp_layers": None}).parallel.pp_layers == ()


def test_each_chunk_runs_its_own_blocks_in_model_order():
    s = canonical(layers(spec("small", parallel_pp=2, train_num_microbatches=4), (2, 6)))  # 8 layers
    assert stage_layers(s) == (2, 6)
    assert chunk_layer_ranges(s) == [range(0, 2), range(2, 8)]
    inter = canonical(
        layers(
            spec("small", parallel_pp=2, train_num_microbatches=4),
            (2, 6),
            pp_schedule="interleaved_1f1b",
            virtual_stages=2,
        )
    )
    # loop placement: chunk k on pipeline rank k mod 2; rank 0's 2 blocks are chunks 0 and 2, one each
    assert chunk_layer_ranges(inter) == [range(0, 1), range(1, 4), range(4, 5), range(5, 8)]
    assert chunk_layer_ranges(canonical(spec("small", parallel_pp=4, train_num_microbatches=4))) == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]


def test_plan_splits_the_layers_as_llama_3_did_where_pp_does_not_divide_them():
    # 126 layers on 8 and 16 stages: one fewer on the first and the last (Dubey et al. 2024 §3.3.2).
    assert balanced_pp_layers(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert balanced_pp_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    assert balanced_pp_layers(126, 4) == (31, 32, 32, 31)
    assert balanced_pp_layers(80, 3) == (26, 27, 27)  # one block fewer: the first stage
    assert balanced_pp_layers(126, 8, 2) == (14,) + (16,) * 7  # whole chunks: 63 units of 2
    assert balanced_pp_layers(128, 8) == ()  # even
    assert balanced_pp_layers(2, 4) is None  # a stage with no block
    assert balanced_pp_layers(5, 2, 2) is None  # a chunk cannot hold half a block
    for n, pp in ((126, 8), (80, 3), (127, 16), (61, 7)):
        counts = balanced_pp_layers(n, pp)
        assert sum(counts) == n and max(counts) - min(counts) == 1


def test_plan_of_a_126_layer_model_lists_pipelines_with_the_ends_a_block_short():
    r = harness_cli(
        "plan", "model=llama31_405b", "plan.gpus=256", "plan.micro_batch_sizes=[1]", "format=json"
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["layouts"]
    piped = [x for x in rows if x["parallel_pp"] > 1]
    assert piped, "no pipeline layout of 126 layers fits on 256 GPUs"  # none was even considered before
    for x in piped:  # (plan offers uneven splits without interleaving only: parallel.pp_layers for those)
        v = x["parallel_virtual_stages"]
        assert x["parallel_pp_layers"] == (
            list(balanced_pp_layers(126, x["parallel_pp"]) or ()) if v == 1 else []
        )
    # The split is part of the layout: run with the counts plan printed, it is the same config_id.
    x = piped[0]
    text = harness_cli(
        "estimate",
        "model=llama31_405b",
        f"parallel.dp={x['parallel_dp']}",
        f"parallel.tp={x['parallel_tp']}",
        f"parallel.pp={x['parallel_pp']}",
        f"parallel.cp={x['parallel_cp']}",
        f"parallel.zero_stage={x['parallel_zero_stage']}",
        f"parallel.pp_layers=[{','.join(map(str, x['parallel_pp_layers']))}]",
        f"train.micro_batch_size={x['train_micro_batch_size']}",
        f"train.num_microbatches={x['train_num_microbatches']}",
        f"train.recompute={x['train_recompute']}",
        "format=json",
    )
    assert text.returncode == 0, text.stderr
    assert json.loads(text.stdout)["config_id"] == x["config_id"]
