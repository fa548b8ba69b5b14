"""The one validation (each rule explains its arithmetic), canonical form and config_id."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import SWEEPS, model, spec

from harness.spec import (
    DeviceSpec,
    InvalidSpec,
    ParallelSpec,
    RunSpec,
    TrainSpec,
    canonical,
    config_id,
    flat,
    from_dict,
    from_flat,
    problems,
    spec_id,
)


def raw(model_name="tiny", **kw) -> RunSpec:
    """A spec that is not validated (so impossible layouts can be built)."""
    par = {k[9:]: v for k, v in kw.items() if k.startswith("parallel_")}
    train = {k[6:]: v for k, v in kw.items() if k.startswith("train_")}
    return RunSpec(model(model_name), ParallelSpec(**par), TrainSpec(**train), DeviceSpec("cpu", 1.0))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        # tiny: 4 heads, 2 KV heads, 4 layers, ffn 352, vocab 4096.
        (
            dict(parallel_dp=2, parallel_tp=2, parallel_world_size=8),
            "dp·tp·pp·cp = 2·2·1·1 = 4 ≠ world_size 8",
        ),
        (
            dict(parallel_dp=None, parallel_tp=4, parallel_world_size=6),
            "world_size 6 is not divisible by tp·pp·cp = 4·1·1 = 4",
        ),
        (dict(parallel_tp=3), "num_heads 4 % tp 3 = 1 ≠ 0"),
        (dict(parallel_tp=4), "num_kv_heads 2 % tp 4 = 2 ≠ 0"),
        (
            dict(parallel_pp=3, train_num_microbatches=3),
            "num_layers 4 % (pp·virtual_stages = 3·1 = 3) = 1 ≠ 0",
        ),
        (
            dict(
                parallel_pp=2,
                parallel_pp_schedule="interleaved_1f1b",
                parallel_virtual_stages=4,
                train_num_microbatches=2,
            ),
            "num_layers 4 % (pp·virtual_stages = 2·4 = 8) = 4 ≠ 0",
        ),
        (dict(parallel_pp=4, train_num_microbatches=2), "1f1b needs num_microbatches >= pp: 2 < 4"),
        (
            dict(
                parallel_pp=2,
                parallel_pp_schedule="interleaved_1f1b",
                parallel_virtual_stages=2,
                train_num_microbatches=3,
            ),
            "interleaved_1f1b needs num_microbatches % pp = 0: 3 % 2 = 1",
        ),
        (dict(parallel_virtual_stages=2), "virtual_stages 2 > 1 needs pp_schedule=interleaved_1f1b"),
        (dict(parallel_cp=2, train_seq_len=258), "seq_len 258 % (2·cp = 4) = 2 ≠ 0"),
        (
            dict(parallel_cp=3, parallel_cp_load_balance=False, train_seq_len=256),
            "seq_len 256 % (cp = 3) = 1 ≠ 0",
        ),
        (dict(parallel_tp=2, train_seq_len=255), "(seq_len/cp) % tp = 0: (255/1) % 2 = 1"),
        (dict(parallel_zero_stage=4), "parallel.zero_stage=4 must be 0, 1, 2 or 3"),
        (dict(train_seq_len=-8), "train.seq_len=-8 must be >= 1"),
        (dict(train_recompute_every=0), "train.recompute_every=0 must be >= 1"),
        (dict(train_recompute="some"), "train.recompute='some' must be one of none, selective, op, full"),
        (dict(parallel_tp="2"), "parallel.tp='2' must be int"),
        (dict(parallel_sequence_parallel=1), "parallel.sequence_parallel=1 must be bool"),
    ],
)
def test_each_rule_explains_its_arithmetic(kw, message):
    reasons = problems(raw(**kw))
    assert any(message in r for r in reasons), reasons
    with pytest.raises(InvalidSpec) as info:
        canonical(raw(**kw))
    assert message in str(info.value)


def test_all_reasons_are_reported_together():
    reasons = problems(raw(parallel_tp=3, parallel_pp=3, train_num_microbatches=3))
    assert len(reasons) >= 2


def test_valid_spec_has_no_problems():
    assert problems(raw(parallel_dp=2, parallel_tp=2, parallel_pp=2, train_num_microbatches=2)) == []


def test_canonical_resolves_dp_and_microbatches_and_resets_fields_without_effect():
    s = canonical(
        raw(
            parallel_dp=None,
            parallel_world_size=8,
            parallel_tp=2,
            parallel_pp=2,
            parallel_sequence_parallel=True,
        )
    )
    assert (s.parallel.dp, s.parallel.world_size, s.train.num_microbatches) == (2, 8, 2)
    single = canonical(raw(parallel_sequence_parallel=True, parallel_cp_load_balance=True))
    assert single.parallel.sequence_parallel is False  # tp = 1
    assert single.parallel.cp_load_balance is False  # cp = 1


def test_config_id_is_stable_and_ignores_spelling():
    a = raw(parallel_dp=2, parallel_tp=2)
    b = raw(parallel_dp=None, parallel_world_size=4, parallel_tp=2)
    assert config_id(a) == config_id(b)
    # Sequence parallel has no effect without tp: same run, same id.
    assert config_id(raw(parallel_sequence_parallel=True)) == config_id(raw(parallel_sequence_parallel=False))
    # Preset names are not hashed, the shapes are.
    renamed = dataclasses.replace(a, model=dataclasses.replace(a.model, name="other"))
    assert config_id(renamed) == config_id(a)
    # Anything that changes the run changes the id.
    assert config_id(raw(parallel_dp=2, parallel_tp=2, parallel_zero_stage=1)) != config_id(a)
    assert config_id(raw(parallel_dp=2, parallel_tp=2, train_seq_len=512)) != config_id(a)
    # Pinned: existing results are found by this id. If this changes, bump CONFIG_ID_VERSION.
    assert config_id(raw()) == PINNED_TINY_ID


PINNED_TINY_ID = "e87f72fa4b36e12f"


def test_flat_names_are_the_record_columns():
    row = flat(spec("tiny"))
    for col in (
        "model_hidden_size",
        "parallel_tp",
        "parallel_zero_stage",
        "train_seq_len",
        "device_memory_gib",
    ):
        assert col in row


def test_from_dict_rejects_unknown_and_missing_keys():
    with pytest.raises(InvalidSpec, match=r"unknown key parallel\.tpp"):
        from_dict(
            {
                "model": dataclasses.asdict(model("tiny")),
                "parallel": {"tpp": 2},
                "train": {},
                "device": {"name": "cpu", "memory_gib": 1.0},
            }
        )
    with pytest.raises(InvalidSpec, match=r"missing key model\.hidden_size"):
        from_dict(
            {"model": {"name": "x"}, "parallel": {}, "train": {}, "device": {"name": "cpu", "memory_gib": 1}}
        )


def test_from_flat_inverts_flat_also_through_a_parquet_table(tmp_path):
    """A record's spec columns give back the spec; a float column with nulls (how parquet/pandas store
    an int column that some rows leave null) comes back as int or None."""
    import pandas as pd

    a = spec("tiny", parallel_dp=2, parallel_tp=2, train_micro_batch_size=4)
    b = dataclasses.replace(a, device=dataclasses.replace(a.device, peak_tflops=None))
    assert from_flat(flat(a)) == a
    pd.DataFrame([flat(a), flat(b)]).to_parquet(tmp_path / "t.parquet")
    rows = pd.read_parquet(tmp_path / "t.parquet").to_dict("records")
    assert [from_flat(r) for r in rows] == [a, b]


def test_one_step_is_refused():
    assert any("train.steps=1 must be >= 2" in p for p in problems(raw(train_steps=1)))


def test_recompute_every_is_reset_without_full_and_hashed_only_when_not_1():
    # issue 15: recompute_every (torchtitan's layer option) acts only with recompute=full.
    assert canonical(raw(train_recompute="op", train_recompute_every=2)).train.recompute_every == 1
    assert config_id(raw(train_recompute="op", train_recompute_every=2)) == config_id(
        raw(train_recompute="op")
    )
    full = raw(train_recompute="full")
    assert config_id(dataclasses.replace(full, train=dataclasses.replace(full.train, recompute_every=1))) == (
        config_id(full)
    )
    assert config_id(raw(train_recompute="full", train_recompute_every=2)) != config_id(full)
    # A row written before the field existed has no column for it: it reads back as the default.
    row = {k: v for k, v in flat(spec("tiny")).items() if k != "train_recompute_every"}
    assert from_flat(row).train.recompute_every == 1


def test_recompute_method_is_hashed_only_when_not_every_and_reset_where_it_changes_nothing():
    # Megatron's --recompute-method (train.recompute_method): the default leaves every id as it was.
    full = raw(train_recompute="full", train_recompute_every=2)
    every = dataclasses.replace(full, train=dataclasses.replace(full.train, recompute_method="every"))
    assert config_id(every) == config_id(full)
    uniform = raw(train_recompute="full", train_recompute_every=2, train_recompute_method="uniform")
    block = raw(train_recompute="full", train_recompute_every=2, train_recompute_method="block")
    assert len({config_id(full), config_id(uniform), config_id(block)}) == 3
    # Without full the method does nothing: reset with N.
    op = canonical(raw(train_recompute="op", train_recompute_every=2, train_recompute_method="block")).train
    assert (op.recompute_method, op.recompute_every) == ("every", 1)
    # uniform with N = 1 and block with N >= the chunk's layers (tiny: 4; pp 2: 2) checkpoint every
    # block alone, as full does: one id.
    plain = config_id(raw(train_recompute="full"))
    assert config_id(raw(train_recompute="full", train_recompute_method="uniform")) == plain
    assert (
        config_id(raw(train_recompute="full", train_recompute_every=4, train_recompute_method="block"))
        == plain
    )
    pp = dict(train_recompute="full", parallel_pp=2)
    assert config_id(raw(**pp, train_recompute_every=2, train_recompute_method="block")) == config_id(
        raw(**pp)
    )
    assert (
        config_id(raw(train_recompute="full", train_recompute_every=3, train_recompute_method="block"))
        != plain
    )
    # Round trip, and a row without the column (written before it existed) or null in it (beside newer
    # rows in one table) reads back as the default.
    assert from_flat(flat(canonical(uniform))) == canonical(uniform)
    row = {k: v for k, v in flat(spec("tiny")).items() if k != "train_recompute_method"}
    assert from_flat(row).train.recompute_method == "every"
    assert from_flat({**row, "train_recompute_method": None}).train.recompute_method == "every"
    assert from_flat({**row, "train_recompute_every": float("nan")}).train.recompute_every == 1


def test_recompute_method_is_validated():
    assert problems(raw(train_recompute="full", train_recompute_method="blocks")) == [
        "train.recompute_method='blocks' must be one of every, uniform, block"
    ]
    assert problems(
        raw(train_recompute="full", train_recompute_every=0, train_recompute_method="uniform")
    ) == ["train.recompute_every=0 must be >= 1"]


def test_committed_study_rows_keep_their_ids():
    """Every row of the committed CPU study is found again by the id of its spec, as read back from its
    columns (a new spec field left in the hash at its default would change them all)."""
    import pandas as pd

    path = SWEEPS.parent / "results" / "cpu_study" / "dataset.parquet"
    if not path.exists():
        pytest.skip("no committed study")
    rows = pd.read_parquet(path).to_dict("records")
    assert rows
    assert [spec_id(from_flat(r)) for r in rows] == [r["config_id"] for r in rows]


def test_every_committed_row_keeps_its_config_id():
    # A field added to a spec (model.qkv_bias, issue 31) must leave every existing point's id alone:
    # the committed studies' rows are found again by id on resume, and their reports by it.
    import pandas as pd

    root = Path(__file__).resolve().parents[2] / "results"
    checked = 0
    for path in sorted(root.glob("**/dataset.parquet")):
        frame = pd.read_parquet(path)
        for _, row in frame[frame["status"].isin(["ok", "oom"])].head(40).iterrows():
            assert config_id(from_flat(row.to_dict())) == row["config_id"], (path, row["config_id"])
            checked += 1
    assert checked >= 100
