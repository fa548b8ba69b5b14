"""`harness <command> --help`: what a command does, every key it reads with its value and meaning.

The values come from the composed config tree (with the user's overrides), the meanings from
:data:`MEANINGS`, one line per key kept here and nowhere else: tests/cli/test_help.py checks that every key
of the composed config has one, so help and config cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

# One line per key. Keys other sessions' features add are here too, so that their help is complete
# once their key is in sweeps/config.yaml.
MEANINGS: dict[str, str] = {
    # model
    "model.name": "the model's label in tables and records (not part of config_id)",
    "model.hidden_size": "hidden size h",
    "model.num_layers": "transformer layers L",
    "model.num_heads": "attention heads a",
    "model.num_kv_heads": "key/value heads k (GQA; = num_heads without GQA)",
    "model.ffn_hidden_size": "SwiGLU MLP intermediate size f",
    "model.vocab_size": "vocabulary size v",
    "model.tie_embeddings": "true: the LM head shares the embedding's weights",
    "model.qkv_bias": "true: biases on the Q, K and V projections (Qwen2, Qwen2.5)",
    "model.head_dim": "one attention head's size d (null: hidden_size / num_heads; Qwen3: its own)",
    "model.qk_norm": "true: RMSNorm of each query and key head before the rotary embedding (Qwen3)",
    "model.num_experts": "experts E of each block's mixture-of-experts MLP (0: a dense model)",
    "model.experts_per_token": "experts k each token is routed to (top-k)",
    "model.moe_ffn_hidden_size": "SwiGLU intermediate size of one expert f_e",
    "model.num_shared_experts": "shared experts applied to every token (one SwiGLU of their summed width)",
    "model.moe_router": "router scores: softmax over the experts | sigmoid per expert",
    "model.moe_norm_topk": "true: the top-k gate values are normalised to sum 1",
    "model.moe_aux_loss_coeff": "the load-balancing (auxiliary) loss's coefficient; 0: none",
    "model.moe_dense_layers": "the first blocks whose MLP stays dense (ffn_hidden_size); 0: experts in all",
    "model.hf_config": "PATH of a local Hugging Face config.json (Llama family, Mixtral, Qwen MoE): "
    "sets the model.* fields",
    # parallel
    "parallel.dp": "data-parallel degree (null: derived from parallel.world_size)",
    "parallel.tp": "tensor-parallel degree (divides heads, KV heads, FFN size and vocabulary)",
    "parallel.pp": "pipeline stages (divides the layers, unless parallel.pp_layers)",
    "parallel.pp_layers": "blocks per pipeline stage, first to last, e.g. [30,32,32,32]; []: layers/pp each",
    "parallel.ep": "expert parallelism (MoE): experts split over ep of the dp·cp ranks; 1: none",
    "parallel.cp": "context-parallel degree (the sequence is split in 2·cp chunks when balanced)",
    "parallel.zero_stage": "0 DDP | 1 sharded optimizer | 2 FSDP2 without reshard | 3 FSDP2",
    "parallel.sequence_parallel": "with tp > 1: norm inputs and boundary activations split by sequence",
    "parallel.pp_schedule": "1f1b | gpipe | interleaved_1f1b",
    "parallel.virtual_stages": "model chunks per pipeline rank (>= 2 with interleaved_1f1b)",
    "parallel.cp_load_balance": "head-tail split of the sequence over cp ranks (causal load balance)",
    "parallel.world_size": "total ranks; with parallel.dp=null, dp = world_size/(tp·pp·cp)",
    "parallel.fsdp_reshard_after_forward": "ZeRO-3: default (torchtitan: not under pp, head kept) | always | "
    "never (= ZeRO-2); null: the stack's",
    # train
    "train.seq_len": "tokens per sequence s",
    "train.micro_batch_size": "sequences per micro-batch b",
    "train.num_microbatches": "micro-batches per step m (null: one per pipeline stage)",
    "train.recompute": "activation recomputation: none | selective (attention core) | op (torchtitan's "
    "op policy) | full; null: the stack's",
    "train.recompute_every": "with train.recompute=full: n, the blocks per checkpoint rule (1: every block)",
    "train.recompute_method": (
        "with full: every (every n-th block) | uniform (groups of n blocks, one checkpoint each) | "
        "block (the first n blocks); n = recompute_every, Megatron's --recompute-num-layers"
    ),
    "train.precision": "bf16 (mixed precision) | fp32",
    "train.attention": "flash (no s×s scores stored) | math (scores materialised)",
    "train.grad_sync": "with accumulation over dp: reduce after the last micro-batch | every_microbatch; "
    "null: the stack's",
    "train.loss_chunks": "the head and the loss over N slices of the rank's tokens, each slice's backward "
    "at once (torchtitan's ChunkedLossWrapper: 8); null: the stack's",
    "train.steps": "steps run: 1 warm-up, then timed steps (>= 2)",
    "train.moe_imbalance": "mixture of experts: the most-loaded expert's routed tokens over the balanced "
    "share (1.0)",
    # device
    "device.name": "the device's label (part of config_id)",
    "device.memory_gib": "capacity in GiB (2^30 B); on CPU the simulated capacity OOM is judged against",
    "device.peak_tflops": "dense BF16 peak TFLOP/s per device, for MFU (null: unknown)",
    "device.gpus_per_node": "devices per node: tensor parallel stays inside one",
    "device.intra_node_gbps": "link speed inside a node, GB/s (ranks layouts in plan; null: unknown)",
    "device.inter_node_gbps": "link speed between nodes, GB/s (null: unknown)",
    "device.cuda_context_mib": "CUDA context per process, MiB, outside the allocator (device level)",
    "device.nccl_mib_per_communicator": "NCCL buffers per communicator, MiB (device level)",
    "device.nccl_channels": "NCCL ring channels per communicator behind nccl_mib_per_communicator",
    "device.nccl_buffsize_mib": "NCCL_BUFFSIZE in MiB (null: NCCL's default 4; changes the NCCL term)",
    "device.cublas_workspace_mib": "cuBLAS workspaces, MiB, inside the caching allocator (reserved level)",
    "device.memory_gbps": "memory bandwidth, GB/s, for the step-time model (null: unknown)",
    "device.link_latency_us": "latency of one collective step inside a node, microseconds (step-time model)",
    "device.inter_node_latency_us": "the same for a group spanning nodes (null: link_latency_us)",
    "engine.name": "estimator: auto (the stack's) | paper (published closed form) | megatron | torch "
    "(this runner)",
    "stack": "the trainer whose choices fill null keys: auto (torchtitan on a GPU, harness on the CPU) | "
    "torchtitan | megatron | harness",
    # output
    "format": "table (for people) | json (for programs)",
    "threshold": "a ratio in (0, 1]: the device level at or below which a configuration fits (0.8 = 80 %)",
    "explain": "true: a glossary of the table's rows and columns under it",
    "fail_on": "nofit: estimate and plan exit 1 when nothing fits (printed all the same)",
    "results_dir": "where sweep and run write rows, and calibrate/report read them",
    "calibration": "auto (GPU devices: the committed paper-scale profile; CPU: none) | none | PATH of a "
    "profile (from calibrate): estimate/plan add the calibrated peaks; plan ranks by its fitted step time",
    # calibrate / report
    "calibrate.group_by": (
        "held-out runs are new: world (sizes) | model | layout (tp-pp-cp) | "
        "family (schedule, ZeRO, cp, recompute)"
    ),
    "calibrate.profile": "where calibrate writes the profile (null: <results_dir>/calibration.json)",
    "calibrate.also_results": "[DIR,...]: more results directories whose runs join results_dir's",
    "report.out": "where report writes report.md and figures/ (null: results_dir)",
    # run
    "run.timeout_s": "a point not finished by then is killed and recorded as status=timeout",
    "run.fail_on": "statuses that make run exit 1, e.g. oom,crash,timeout (null: exit 0 for any outcome)",
    "run.mode": "real (run the step) | fake (fake tensors, no memory used)",
    "run.fake_cache": "fake: a directory of traced ranks, reused across GPU presets (traces ignore the card)",
    "run.trace": "write each rank's allocation trace beside the record (<config_id>.rank<r>.trace.json)",
    "run.memory_snapshot": "CUDA: dump a memory snapshot per rank at the peak and on OOM",
    "run.share_gpus": "GPU: let ranks share a node's GPUs when they outnumber them (never with pp > 1)",
    # sweep
    "sweep.name": "the sweep's name (its Hydra output folder)",
    "sweep.prune_predicted_oom": "true: points estimated over prune_factor × capacity are recorded, not run",
    "sweep.prune_factor": "the estimate/capacity ratio above which a point is pruned",
    "sweep.dry_run": "true: print how many points would launch, be skipped or be invalid; run nothing",
    "sweep.ranks_per_node": "Slurm: a point asks for ceil(world/ranks_per_node) nodes (null: the launcher's)",
    "sweep.retry": "statuses whose rows are run again (e.g. timeout,crash)",
    # plan
    "plan.gpus": "devices to lay the model out on",
    "plan.global_batch_size": "sequences per step, the same for every layout (null: one per device)",
    "plan.micro_batch_sizes": "micro-batch sizes tried",
    "plan.zero_stages": "ZeRO stages tried",
    "plan.recompute": "recomputation modes tried",
    "plan.pp_schedules": "pipeline schedules tried",
    "plan.virtual_stages": "virtual stages tried with interleaved_1f1b",
    "plan.max_tp": "largest tensor-parallel degree (stays inside a node)",
    "plan.top": "rows printed (all with format=json)",
    "plan.solve": "null: rank layouts | min_gpus | max_micro_batch | max_seq_len (reverse questions)",
    "plan.max_gpus": "min_gpus: the largest device count tried",
    "plan.show": "fitting | all: also the layouts that do not fit, with the first term over the budget",
    "plan.verify": "N: trace the top N fitting layouts (run.mode=fake) against the card, rank by the traces",
    "plan.include": "your layout ('{tp:2,pp:4,zero_stage:1}': dp tp pp cp zero_stage pp_schedule "
    "virtual_stages micro_batch_size recompute): where it ranks, or what breaks the budget",
    "plan.emit": "PATH (.../study/NAME.yaml): write the top fitting layouts as a study for harness sweep",
    # replay
    "trace": "PATH of an allocator trace to replay",
    "replay.capacity_bytes": "memory the replay runs out of against, in bytes (null: unlimited)",
    "replay.expandable_segments": "replay with expandable segments (PYTORCH_CUDA_ALLOC_CONF)",
    "replay.max_split_size_mb": "replay with max_split_size_mb (null: unset)",
}

GROUPS = {
    "model": "model preset (published Llama models, tiny/small/medium for the CPU)",
    "parallel": "parallel layout preset",
    "train": "training-shape preset (paper: the published study's)",
    "device": "device preset",
    "engine": "estimator",
}


class Command(NamedTuple):
    summary: str  # one line for `harness --help`
    details: str  # the rest of what it does
    reads: tuple[str, ...]  # key prefixes ("model.") and keys ("format") it reads
    groups: tuple[str, ...]  # config groups it reads
    examples: tuple[str, ...]


# The keys estimate reads (plan reads these and plan.*).
ESTIMATE_KEYS = (
    "model.",
    "parallel.",
    "train.",
    "device.",
    "engine.",
    "stack",
    "format",
    "threshold",
    "calibration",
    "explain",
    "fail_on",
)

COMMAND_HELP: dict[str, Command] = {
    "estimate": Command(
        "analytical per-rank memory and FLOPs of one configuration, term by term, with a verdict",
        "Every memory term per pipeline stage, the most-loaded rank, its utilisation of the device and "
        "whether it fits under threshold, at three levels: allocated (the tensors), reserved (+ the "
        "caching allocator's segment rounding, the gradient-reduction stream's segments, the blocks "
        "cached and free at the loss (FSDP2's outside units, the loss's logits, full recomputation's "
        "packed inputs and working set), the segments the optimizer step opens beyond the "
        "forward/backward cache, and cuBLAS workspaces) "
        "and device (+ CUDA context and "
        "NCCL buffers, outside the allocator); the verdict is the device level's. A GPU-scale model "
        "(a published preset or model.hf_config) is "
        "judged on device=h100_94gb with train=paper (the published study's sequence; one micro-batch per "
        "pipeline stage) unless device= or train= is named, in every command alike. The second line "
        "names the stack (stack=) and the choices it filled in.",
        ESTIMATE_KEYS,
        ("model", "parallel", "train", "device", "engine"),
        (
            "harness estimate model=llama3_8b parallel.tp=2 parallel.pp=2 parallel.dp=2 train.seq_len=8192",
            "harness estimate model.hf_config=path/to/config.json format=json",
        ),
    ),
    "plan": Command(
        "every layout of plan.gpus devices that fits, ranked; or a reverse question (plan.solve=)",
        "Enumerates (dp, tp, pp, cp, ZeRO stage, micro-batch, recomputation, schedule) at a fixed global "
        "batch, estimates each and ranks those that fit; where pp does not divide the layers, the first "
        "and last stages get a block fewer (pp* in the table; not with interleaving; "
        "parallel.pp_layers=[...] with parallel.pp sets your own). plan.solve=min_gpus: the fewest "
        "devices on which some layout fits; max_micro_batch / max_seq_len: the largest micro-batch / "
        "sequence that fits the layout given by parallel.*. plan.emit=DIR/study/NAME.yaml writes the "
        "top fitting layouts as a study that harness sweep runs as it is. GPU-scale defaults as for "
        "estimate.",
        (*ESTIMATE_KEYS, "plan."),
        ("model", "parallel", "train", "device", "engine"),
        (
            "harness plan model=llama3_70b device=h100_80gb plan.gpus=64",
            "harness plan model=llama3_70b plan.solve=min_gpus",
            "harness plan model=llama3_8b parallel.tp=2 parallel.dp=4 plan.solve=max_seq_len",
            "harness plan model=llama3_70b plan.gpus=32 plan.top=5 plan.emit=plans/study/l70b_32.yaml",
        ),
    ),
    "run": Command(
        "one short real training step: peak memory per rank, step time, TFLOP/s, MFU; or how it failed",
        "Fresh worker processes run a warm-up step, then measured steps, and print one record: status "
        "ok, oom, timeout, crash or invalid. Exit status 0 for every recorded outcome, 1 when the status "
        "is listed in run.fail_on, 2 for bad input, 143 when SIGTERM ends it mid-point (no record). The "
        "device stays cpu unless device= is named or the model is GPU-scale (as for estimate). "
        "stack=megatron is refused: the megatron engine judges it.",
        ("model.", "parallel.", "train.", "device.", "stack", "format", "threshold", "results_dir", "run."),
        ("model", "parallel", "train", "device"),
        ("harness run parallel.dp=2 parallel.tp=2 parallel.zero_stage=3 run.fail_on=oom,crash,timeout",),
    ),
    "sweep": Command(
        "a Hydra multirun: every point one run, one parquet row in results_dir; resumable",
        "Points come from a study (+study=NAME) and key=v1,v2 overrides; impossible and finished points "
        "are not launched, so a rerun resumes. Hydra's launcher keys (hydra.launcher.*) and several grids "
        "(hydra.sweeper.grids) apply. A study written by plan.emit is run with the command plan prints.",
        ("model.", "parallel.", "train.", "device.", "stack", "results_dir", "run.", "sweep."),
        ("model", "parallel", "train", "device", "study"),
        (
            "harness sweep +study=cpu_smoke",
            "harness sweep parallel.dp=1,2 parallel.tp=1,2 sweep.dry_run=true",
        ),
    ),
    "results": Command(
        "status | compact: the runs in results_dir counted by status, or merged into one file",
        "compact writes results_dir/dataset.parquet.",
        ("results_dir",),
        (),
        ("harness results status results_dir=results/cpu_smoke",),
    ),
    "calibrate": Command(
        "fit coefficients on the estimator's terms to the runs in results_dir; judge every estimator",
        "Cross-validated on held-out runs (calibrate.group_by): median and p95 error, worst "
        "under-prediction and safe utilisation threshold of every estimator; the fragmentation term "
        "(reserved - allocated) where runs report reserved memory; the step-time model, judged by its "
        "held-out error, the rank correlation within each (model, world size) group and the measured "
        "throughput of the layout it ranks first. Writes a profile that estimate and plan take as "
        "calibration=PATH.",
        ("results_dir", "engine.", "format", "calibrate."),
        ("engine",),
        ("harness calibrate results_dir=results/cpu_study calibrate.group_by=layout",),
    ),
    "report": Command(
        "results_dir/report.md with figures, every number from the runs",
        "Memory accuracy of every estimator, safe threshold, out-of-memory map, fragmentation, "
        "TFLOP/s by layout, and which layout is fastest: predicted vs measured.",
        ("results_dir", "engine.", "calibrate.group_by", "report."),
        ("engine",),
        ("harness report results_dir=results/cpu_study",),
    ),
    "replay": Command(
        "replay an allocator trace through a model of PyTorch's CUDA caching allocator",
        "Peak allocated and reserved bytes, allocation retries and out-of-memory events of the trace "
        "against replay.capacity_bytes, with or without expandable segments.",
        ("trace", "replay.", "format"),
        (),
        ("harness replay trace=PATH replay.capacity_bytes=85899345920 format=json",),
    ),
}


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


def _reads(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def keys_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """Dotted key -> value of a composed config, Hydra's own ``hydra.*`` left out."""
    out: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk({k: v for k, v in cfg.items() if k != "hydra"}, "")
    return out


def usage(commands: Sequence[str], version: str) -> str:
    """``harness --help``: the commands, one line each, and where to read more."""
    lines = [
        f"harness {version}: which 4D-parallel training configuration fits in memory, and which runs "
        "fastest.",
        "",
        "usage: harness <command> [key=value ...]      (or: python -m harness <command> ...)",
        "       harness <command> --help               (what it does, every key it reads, an example)",
        "",
        "commands:",
    ]
    for name in commands:
        lines.append(f"  {name:<10} {COMMAND_HELP[name].summary}")
    lines += [
        "",
        "overrides are Hydra's: group=preset (model=llama3_8b device=h100_94gb engine=paper) and dotted keys",
        "(parallel.tp=2 train.seq_len=8192 format=json). A misspelt key names the closest known one.",
    ]
    return "\n".join(lines)


def command_help(command: str, cfg: dict[str, Any] | None, presets: dict[str, list[str]]) -> str:
    """``harness COMMAND --help``: what it does, its groups and presets, every key it reads with its
    value under the given overrides and its meaning, and an example."""
    import textwrap

    c = COMMAND_HELP[command]
    prefixes, group_names = c.reads, c.groups
    lines = [f"harness {command}: {c.summary}", "", *textwrap.wrap(c.details, 100), ""]
    if command == "results":
        lines.append("usage: harness results status|compact [results_dir=DIR]")
    else:
        groups_part = "[group=preset ...] " if group_names else ""
        lines.append(f"usage: harness {command} {groups_part}[key=value ...]")
    if group_names:
        lines += ["", "groups (group=preset):"]
        for g in group_names:
            names = " ".join(presets.get(g, []))
            lines.append(f"  {g:<9} {GROUPS.get(g, 'study file: a sweep recipe (+study=NAME)')}: {names}")
    values = {"results_dir": "results"} if command == "results" else keys_of(cfg or {})
    shown: dict[str, Any] = {}
    for k, v in values.items():
        if _reads(k, prefixes):
            shown[k] = v
            if k == "model.tie_embeddings":  # the one model key that is in no YAML file
                shown["model.hf_config"] = None
    if shown:
        width = max(len(k) for k in shown)
        vwidth = min(24, max(len(_fmt(v)) for v in shown.values()))
        lines += ["", f"keys ({'value':<{vwidth}} meaning):"]
        for k, v in shown.items():
            lines.append(f"  {k:<{width}} {_fmt(v):<{vwidth}} {MEANINGS.get(k, '')}".rstrip())
    lines += ["", "examples:" if len(c.examples) > 1 else "example:", *(f"  {e}" for e in c.examples)]
    return "\n".join(lines)
