"""A newcomer's CLI (issue 16): help on every command, the closest key for a misspelt one, GPU-scale
defaults for published models, a local config.json as the model, human units, and run.fail_on."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import harness_cli

from harness.cli.config import compose, known_keys
from harness.cli.help import COMMAND_HELP, MEANINGS, keys_of
from harness.cli.main import COMMANDS, fail_statuses, main
from harness.cli.render.common import human, human_bytes_in
from harness.cli.render.run import record_table

# --- 1. help -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", list(COMMAND_HELP))
def test_every_command_answers_help_with_every_key_it_reads(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"harness {command}: ")
    assert "example" in out
    cfg = keys_of(compose())
    prefixes = COMMAND_HELP[command].reads
    reads = [k for k in cfg if any(k == p or (p.endswith(".") and k.startswith(p)) for p in prefixes)]
    for key in reads:  # each with its default and its meaning on one line
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [key])
        assert MEANINGS[key] in line


def test_short_help_and_the_command_list(capsys):
    assert main(["estimate", "-h"]) == 0
    assert "parallel.tp" in capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in [*COMMANDS, "replay"]:
        assert f"\n  {command} " in out


def test_help_shows_the_values_under_the_given_overrides(capsys):
    assert main(["estimate", "model=llama3_8b", "parallel.tp=4", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert next(ln for ln in lines if ln.startswith("  parallel.tp ")).split()[1] == "4"
    assert next(ln for ln in lines if ln.startswith("  model.hidden_size ")).split()[1] == "4096"
    # the GPU-scale defaults apply to help too
    assert next(ln for ln in lines if ln.startswith("  device.name ")).split()[1] == "h100_94gb"


def test_cfg_job_prints_the_composed_config(capsys):
    assert main(["plan", "model=small", "--cfg", "job"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["name"] == "small" and cfg["plan"]["gpus"] == 8


@pytest.mark.parametrize("overrides", [[], ["+study=cpu_smoke"], ["model=llama3_70b", "device=h100_80gb"]])
def test_every_key_of_the_config_has_a_meaning(overrides):
    # The help's meanings live in one table; a key added to sweeps/ without one fails here.
    missing = sorted(set(keys_of(compose(overrides))) - set(MEANINGS))
    assert missing == []


def test_help_of_a_bad_override_is_the_one_line_error(capsys):
    assert main(["plan", "plan.gpu=8", "--help"]) == 2
    assert "unknown key 'plan.gpu' (did you mean plan.gpus?)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("train.seq_length=4096", "unknown key 'train.seq_length' (did you mean train.seq_len?)"),
        ("devic=h100_80gb", "unknown key 'devic' (did you mean device?)"),
        ("device=h100_80g", "unknown device preset 'h100_80g' (did you mean h100_80gb?)"),
        ("model=llama3-8b", "unknown model preset 'llama3-8b' (did you mean llama3_8b?)"),
        ("thresold=0.9", "unknown key 'thresold' (did you mean threshold?)"),
    ],
)
def test_misspelt_key_names_the_closest_known_one(override, suggestion, capsys):
    assert main(["estimate", override]) == 2
    err = capsys.readouterr().err
    assert suggestion in err and "+" not in err.split("error: ")[1].split(";")[0]
    assert len(err.strip().splitlines()) == 1


def test_known_keys_include_the_cli_keys():
    keys = known_keys()
    assert "model.hf_config" in keys and "parallel.tp" in keys
    assert not any(k.startswith("hydra.") for k in keys)


# --- 2. GPU-scale defaults -----------------------------------------------------------------------


def _estimate_json(capsys, *overrides: str) -> tuple[dict, str]:
    assert main(["estimate", *overrides, "format=json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_a_published_model_is_judged_on_the_paper_device_and_shape(capsys):
    # (calibration=none: the default profile's own note is another line, tested in test_default_calibration)
    implicit, note = _estimate_json(capsys, "model=llama3_8b", "parallel.tp=2", "calibration=none")
    explicit, quiet = _estimate_json(
        capsys, "model=llama3_8b", "parallel.tp=2", "device=h100_94gb", "train=paper", "calibration=none"
    )
    # the same configuration (config_id hashes model, layout, training shape and device) ...
    assert implicit["config_id"] == explicit["config_id"] and implicit["device"] == "h100_94gb"
    # ... said in one line on stderr, and not when both are named
    assert note.count("\n") == 1 and "device=h100_94gb" in note and "train=paper (seq 8192" in note
    assert quiet == ""
    # a named training key still applies on top of the paper's shape
    longer, _ = _estimate_json(capsys, "model=llama3_8b", "parallel.tp=2", "train.seq_len=16384")
    assert longer["activations_bytes"] == 2 * implicit["activations_bytes"]  # s·b·h·(...) is linear in s


def test_cpu_models_and_run_keep_the_cpu_device(capsys):
    tiny, note = _estimate_json(capsys)
    assert tiny["device"] == "cpu" and note == ""
    on_cpu, warning = _estimate_json(capsys, "model=llama2_7b", "device=cpu")
    assert on_cpu["device"] == "cpu" and "GPU-scale and device=cpu" in warning
    assert compose(["model=llama3_8b"])["device"]["name"] == "cpu"  # run/sweep compose: no defaults


def test_utilisation_is_labelled_in_json_and_table(capsys):
    record, _ = _estimate_json(capsys, "model=small")
    assert 0 < record["utilisation"] < 1 and "ratio" in record["units"]["utilisation"]
    assert main(["estimate", "model=small"]) == 0
    out = capsys.readouterr().out
    assert f"= {record['utilisation']:.1%} utilisation" in out


# --- 3. model.hf_config --------------------------------------------------------------------------

# transformers' config.json of meta-llama/Meta-Llama-3-8B (the fields that shape the model, and
# some that do not)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
}


def _config(tmp_path, **changes) -> str:
    folder = tmp_path / "Meta-Llama-3-8B"
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**LLAMA3_8B, **changes}))
    return str(path)


def test_a_local_config_json_gives_the_preset_estimate(tmp_path, capsys):
    layout = ["parallel.tp=2", "parallel.pp=2", "device=h100_80gb", "train=paper"]
    preset, _ = _estimate_json(capsys, "model=llama3_8b", *layout)
    mine, _ = _estimate_json(capsys, f"model.hf_config={_config(tmp_path)}", *layout)
    assert mine["model"] == "Meta-Llama-3-8B"
    assert mine["config_id"] == preset["config_id"]  # the name is not hashed, every field is
    assert {k: v for k, v in mine.items() if k != "model"} == {
        k: v for k, v in preset.items() if k != "model"
    }
    # a key after it still wins, and the GPU-scale defaults apply to it as to a preset
    assert (
        main(["estimate", f"model.hf_config={_config(tmp_path)}", "model.num_layers=16", "--cfg", "job"]) == 0
    )
    captured = capsys.readouterr()
    cfg = yaml.safe_load(captured.out)
    assert cfg["model"]["num_layers"] == 16 and cfg["device"]["name"] == "h100_94gb"


def test_a_mixtral_config_json_is_the_mixtral_preset(tmp_path, capsys):
    # issue 27: Mixtral's fields (num_local_experts, num_experts_per_tok, experts of intermediate_size)
    # its published config.json carries router_aux_loss_coef 0.02 with output_router_logits false, under
    # which transformers adds no load-balancing loss
    shape = dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
    mixtral = _config(tmp_path, **shape, router_aux_loss_coef=0.02, output_router_logits=False)
    assert main(["estimate", f"model.hf_config={mixtral}", "format=json"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert main(["estimate", "model=mixtral_8x7b", "format=json"]) == 0
    assert mine["config_id"] == json.loads(capsys.readouterr().out)["config_id"]
    # training with it: model.moe_aux_loss_coeff, another configuration
    trained = _config(tmp_path, **shape, router_aux_loss_coef=0.02, output_router_logits=True)
    assert main(["estimate", f"model.hf_config={trained}", "--cfg", "job"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["moe_aux_loss_coeff"] == 0.02
    assert main(["estimate", f"model.hf_config={trained}", "format=json"]) == 0
    assert json.loads(capsys.readouterr().out)["config_id"] != mine["config_id"]


def test_qwen_moe_dense_first_layers_are_read(tmp_path, capsys):
    # issue 27: mlp_only_layers 0 … k − 1 (decoder_sparse_step 1) are the first k blocks with a dense MLP
    # of intermediate_size (transformers' Qwen2MoeDecoderLayer)
    shape = dict(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    (tmp_path / "dense").mkdir()
    (tmp_path / "sparse").mkdir()
    dense = _config(tmp_path / "dense", **shape, mlp_only_layers=[0, 1])
    assert main(["estimate", f"model.hf_config={dense}", "--cfg", "job"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (cfg["moe_dense_layers"], cfg["ffn_hidden_size"], cfg["num_experts"]) == (2, 14336, 128)
    sparse = _config(tmp_path / "sparse", **shape, mlp_only_layers=[])
    assert main(["estimate", f"model.hf_config={sparse}", "format=json"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert main(["estimate", f"model.hf_config={dense}", "format=json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["config_id"] != every["config_id"]
    # two blocks' 128 experts of 3·h·768 and their router become two SwiGLUs of 3·h·14336 (FP32 params)
    h = 4096
    per_block = 128 * 3 * h * 768 + h * 128 - 3 * h * 14336
    assert every["params_bytes"] - first["params_bytes"] == 4 * 2 * per_block


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model_type": "deepseek_v3", "n_routed_experts": 256}, "model_type 'deepseek_v3'"),
        (
            {"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4, "mlp_only_layers": [1]},
            "cannot model dense layers among expert layers, only the first k of them (decoder_sparse_step 1, "
            "mlp_only_layers [1])",
        ),
        (
            dict(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, decoder_sparse_step=2),
            "(decoder_sparse_step 2, mlp_only_layers [])",
        ),
        (
            {"num_local_experts": 8, "num_experts_per_tok": 2},
            "num_local_experts (mixture of experts), num_experts_per_tok (mixture of experts)",
        ),
        ({"kv_lora_rank": 512, "q_lora_rank": 1536}, "kv_lora_rank (multi-head latent attention)"),
        ({"attention_bias": True}, "attention_bias (biases)"),
        ({"head_dim": 0}, "head_dim=0 must be a positive integer"),
    ],
)
def test_a_config_the_estimator_cannot_model_is_refused_in_one_line(tmp_path, changes, named):
    r = harness_cli("estimate", f"model.hf_config={_config(tmp_path, **changes)}", timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and named in r.stderr, r.stderr


def test_a_sliding_window_is_estimated_as_dense_attention_and_said(tmp_path):
    # Mistral v0.1: sliding_window 4096; the memory is dense attention's, the note says so (issue 31)
    window = harness_cli(
        "estimate", f"model.hf_config={_config(tmp_path, model_type='mistral', sliding_window=4096)}"
    )
    assert window.returncode == 0, window.stderr
    assert "sliding-window attention (sliding_window) is estimated as dense attention" in window.stderr
    dense = harness_cli(
        "estimate", f"model.hf_config={_config(tmp_path, model_type='mistral', sliding_window=None)}"
    )
    assert dense.stdout.split("\n", 1)[1] == window.stdout.split("\n", 1)[1]  # the same figures
    assert "sliding-window" not in dense.stderr


def test_qwen2_is_llama_with_qkv_biases(tmp_path):
    # Qwen2 carries sliding_window with use_sliding_window false: no window, no note
    qwen = {"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False}
    done = harness_cli(
        "estimate", f"model.hf_config={_config(tmp_path, **qwen)}", "format=json", "calibration=none"
    )
    llama = harness_cli("estimate", f"model.hf_config={_config(tmp_path)}", "format=json", "calibration=none")
    assert done.returncode == 0, done.stderr
    assert "sliding-window" not in done.stderr
    biases = 32 * (4096 + 2 * 1024)  # Llama-3-8B's shape: per layer h + 2·h·k/a
    assert json.loads(done.stdout)["params_bytes"] - json.loads(llama.stdout)["params_bytes"] == 4 * biases


def test_a_folder_holding_config_json_is_read(tmp_path):
    folder = tmp_path / "Meta-Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    done = harness_cli("estimate", f"model.hf_config={folder}", "format=json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "Meta-Llama-3-8B"


def test_mistral_without_a_window_and_defaults_of_transformers(tmp_path, capsys):
    # sliding_window null is a dense model; no num_key_value_heads means no GQA (kv heads = heads)
    cfg = {**LLAMA3_8B, "model_type": "mistral", "sliding_window": None}
    del cfg["num_key_value_heads"], cfg["tie_word_embeddings"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["estimate", f"model.hf_config={path}", "--cfg", "job"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert model["num_kv_heads"] == 32 and model["tie_embeddings"] is False


# --- 8. units ------------------------------------------------------------------------------------


def test_human_units():
    assert human(45.21 * 2**30) == "45.21 GiB"
    assert human(0.02 * 2**30) == "20.5 MiB"  # 0.02 · 1024 = 20.48 MiB, not "0.02"
    assert human(4096) == "4.0 KiB" and human(0) == "0"
    # the simulated OOM line: 35806396 B = 34.15 MiB, 1073741 B = 1.02 MiB
    assert (
        human_bytes_in("simulated: peak 35806396 B on rank 0 > capacity 1073741 B (0.001 GiB)")
        == "simulated: peak 34.1 MiB on rank 0 > capacity 1.0 MiB (0.001 GiB)"
    )


def test_run_table_in_human_units():
    record = {
        "model_name": "tiny",
        "device_name": "cpu",
        "config_id": "x",
        "status": "oom",
        "parallel_dp": 1,
        "parallel_tp": 1,
        "parallel_pp": 1,
        "parallel_cp": 1,
        "parallel_zero_stage": 0,
        "train_seq_len": 64,
        "train_micro_batch_size": 1,
        "train_num_microbatches": 1,
        "train_recompute": "none",
        "train_precision": "bf16",
        "error": "simulated: peak 35806396 B on rank 0 > capacity 1073741 B (0.001 GiB)",
        "peak_allocated_bytes": 35806396,
        "per_rank_peak_bytes": [35806396],
        "memory_method": "cpu_allocator",
        "worst_rank": 0,
        "mem_params_bytes": 7 * 2**20,
        "est_total_bytes": 35806396,
        "step_time_s": 1.0,
        "tokens_per_s": 64.0,
        "tflops_per_device": 0.0003,
        "mfu": None,
        "mfu_reference_tflops": 0.681,
        "losses": [8.3, 7.8],
    }
    out = record_table(record)
    assert "error: simulated: peak 34.1 MiB on rank 0 > capacity 1.0 MiB" in out
    assert "max 34.1 MiB on rank 0; per rank: 34.1 MiB" in out and "params 7.0 MiB" in out


def test_legends(capsys):
    assert main(["estimate", "explain=true"]) == 0
    out = capsys.readouterr().out
    assert "step_grads           gradients made after the peak" in out
    assert "param_copies         compute-dtype (BF16) copies" in out
    assert main(["plan", "model=small", "device.memory_gib=1", "plan.gpus=2"]) == 0
    out = capsys.readouterr().out
    assert "m micro-batches per step" in out and "int1f1b/v (interleaved 1F1B, v virtual" in out


# --- 11. run.fail_on -----------------------------------------------------------------------------


def test_fail_on_parses_statuses():
    assert fail_statuses(None) == frozenset()
    assert fail_statuses("oom,crash,timeout") == {"oom", "crash", "timeout"}
    assert fail_statuses(["oom"]) == {"oom"}
    with pytest.raises(ValueError, match=r"run\.fail_on=oom,boom: boom not among"):
        fail_statuses("oom,boom")


def test_run_exits_0_for_a_recorded_outcome_unless_fail_on_lists_it():
    # tp=3 does not divide tiny's 4 heads: an invalid record, written without launching anything
    plain = harness_cli("run", "parallel.tp=3", timeout=120)
    assert plain.returncode == 0 and "status INVALID" in plain.stdout
    listed = harness_cli("run", "parallel.tp=3", "run.fail_on=oom,invalid", timeout=120)
    assert listed.returncode == 1 and "status INVALID" in listed.stdout
    other = harness_cli("run", "parallel.tp=3", "run.fail_on=oom,crash,timeout", timeout=120)
    assert other.returncode == 0


def test_a_gpu_fake_run_prints_its_three_levels_with_the_verdict(tmp_path):
    # issue 31: a fake run printed its allocated peak only, while the replayed reserved level and the
    # device level (with the CUDA context and NCCL) are what decide a GPU run; traced, not "measured".
    from conftest import harness_cli

    r = harness_cli(
        "run",
        "run.mode=fake",
        "model=tiny",
        "device=h100_80gb",
        "parallel.dp=2",
        "parallel.zero_stage=3",
        f"results_dir={tmp_path}",
        "threshold=0.5",
    )
    assert r.returncode == 0, r.stderr
    assert "→ traced/estimate" in r.stdout and "measured" not in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("levels:"))
    assert "(traced)" in line and "(replayed)" in line and "+ CUDA context and NCCL, estimated" in line
    assert line.endswith("→ fits (threshold 50%)")
    # issue 32: and what the card's allocator does with the trace
    card = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("on the card:"))
    assert card.strip().startswith("on the card: fits (the trace replayed against the 78.")
