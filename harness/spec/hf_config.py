"""A local Hugging Face ``config.json`` of the Llama family as ModelSpec fields (no network, no hub).

``model.hf_config=PATH`` on the command line reads one: the fields map one to one onto ModelSpec's, and
a config whose architecture the estimator cannot model (multi-head latent attention, biases other than
Qwen2's on Q, K and V, dense layers among expert layers but the first) is refused
in one line naming the fields, rather than estimated as if it were a dense Llama. Sliding-window
attention is estimated as dense, with a note. ``PATH`` may be the file or a folder holding it.

Qwen3 (``qwen3``, ``qwen3_moe``): a head size of its own (``head_dim``, model.head_dim) and norms of
each query and key head (model.qk_norm).

Mixtures of experts (issue 27; docs/mixture-of-experts.md §3): Mixtral (``num_local_experts``,
``num_experts_per_tok``, experts of ``intermediate_size``, softmax over the top-k, no shared expert),
Qwen2-MoE and Qwen3-MoE (``num_experts``, ``moe_intermediate_size``, ``norm_topk_prob``; Qwen2-MoE's
shared expert of ``shared_expert_intermediate_size``, a whole number of experts' width). Every layer
is an expert layer (``decoder_sparse_step`` 1) but the first k where ``mlp_only_layers`` is 0 … k − 1
(model.moe_dense_layers, a dense MLP of ``intermediate_size``).
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Any

# ModelSpec field <- config.json key (transformers' LlamaConfig names).
FIELDS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "tie_embeddings": "tie_word_embeddings",
}
# Mistral is Llama plus an optional sliding window (see WINDOW_KEYS); Qwen2 (and Qwen2.5, the same
# model_type) is Llama with biases on the Q, K and V projections (transformers' Qwen2Attention:
# q_proj, k_proj, v_proj with bias=True, o_proj without), ModelSpec.qkv_bias.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # RMSNorm of each query and key head (Qwen3Attention's q_norm, k_norm)
# Keys whose presence (with a value that switches the feature on) means another architecture.
UNSUPPORTED = {
    # (a mixture of experts of another model_type: its routing and layer pattern are not known here)
    "mixture of experts": (
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "moe_layer_freq",
    ),
    "multi-head latent attention": ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim"),
    "biases": ("attention_bias", "mlp_bias"),
}
# Sliding-window attention (Mistral v0.1's sliding_window: 4096) is modelled as dense attention: under a
# fused kernel the window only masks, so what a layer keeps for backward is the same (the queries,
# keys, values and output, and the kernel's log-sum-exp), and so is every other term; only attention's
# FLOPs are fewer, and the FLOPs count does not know it. Said in a note.
WINDOW_KEYS = ("sliding_window", "use_sliding_window", "layer_types")
WINDOW_NOTE = (
    "{where}: sliding-window attention ({keys}) is estimated as dense attention: the same memory under "
    "the fused kernels (the window only masks), but its FLOPs and step time are over-counted"
)


MAX_BYTES = 16 * 2**20  # a config.json is a few KiB; a file larger than this is not one


class HFConfigError(ValueError):
    """A config.json that cannot be read or modelled, with a one-line message."""


def _switched_on(value: Any) -> bool:
    """``sliding_window: null``, ``attention_bias: false`` and ``num_experts: 0`` leave the feature off."""
    return value not in (None, False, 0, [], "")


def _dense_layers(key: str, value: Any) -> bool:
    """``layer_types`` of full attention only: no window."""
    return key == "layer_types" and isinstance(value, list) and set(map(str, value)) <= {"full_attention"}


def model_fields(path: str | Path, notes: list[str] | None = None) -> dict[str, Any]:
    """ModelSpec fields (and ``name``: the config's folder) from a Llama-family ``config.json``, or from
    a folder holding one (a model's download folder). ``notes``: where to add what the reader should
    know about how the model is estimated (sliding-window attention as dense)."""
    where = f"model.hf_config={path}"
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        # A regular file of at most MAX_BYTES, checked before reading (issue 29: /dev/zero was read until
        # the process was killed, a FIFO blocked for ever).
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise HFConfigError(f"{where}: not a regular file")
        if info.st_size > MAX_BYTES:
            raise HFConfigError(f"{where}: {info.st_size:,} bytes, over the {MAX_BYTES:,} a config.json has")
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise HFConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFConfigError(f"{where}: not JSON ({getattr(exc, 'msg', exc)})") from None
    except RecursionError:
        raise HFConfigError(f"{where}: JSON nested too deeply to be a config.json") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{where}: not a config.json object")

    model_type = cfg.get("model_type")
    if model_type is not None and model_type not in MODEL_TYPES:
        raise HFConfigError(
            f"{where}: model_type {model_type!r} is not of the Llama family ({', '.join(MODEL_TYPES)})"
        )
    refused = [
        f"{key} ({what})"
        for what, keys in UNSUPPORTED.items()
        for key in keys
        if key in cfg
        and _switched_on(cfg[key])
        and not (what == "mixture of experts" and model_type in MOE_TYPES)
    ]
    if refused:
        raise HFConfigError(f"{where}: cannot model {', '.join(refused)}: only dense Llama-family models")
    kinds = cfg.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise HFConfigError(
                f"{where}: cannot model layer_types {kinds!r:.60}: not a list of attention types"
            )
        other = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if other:
            raise HFConfigError(
                f"{where}: cannot model layer_types {', '.join(other)}: only dense or sliding attention"
            )
    window = [k for k in WINDOW_KEYS if k in cfg and _switched_on(cfg[k]) and not _dense_layers(k, cfg[k])]
    if "use_sliding_window" in cfg and not _switched_on(cfg["use_sliding_window"]):
        window = []  # Qwen2 carries sliding_window with use_sliding_window false: no window
    if window and notes is not None:
        notes.append(WINDOW_NOTE.format(where=where, keys=", ".join(window)))

    missing = [
        key
        for field, key in FIELDS.items()
        if key not in cfg and field not in ("num_kv_heads", "tie_embeddings")
    ]
    if missing:
        raise HFConfigError(f"{where}: missing {', '.join(missing)}")
    # The name: the model's folder (…/Meta-Llama-3-8B/config.json), else the file's stem; only
    # characters a Hydra override takes as they are.
    label = path.resolve().parent.name if path.name == "config.json" else path.stem
    out: dict[str, Any] = {"name": re.sub(r"[^A-Za-z0-9_.-]", "_", label) or "hf_model"}
    for field, key in FIELDS.items():
        out[field] = cfg.get(key)
    out["qkv_bias"] = model_type in QKV_BIAS_TYPES
    # transformers' defaults: no GQA (kv heads = heads), untied embeddings (LlamaConfig).
    if out["num_kv_heads"] is None:
        out["num_kv_heads"] = out["num_heads"]
    if out["tie_embeddings"] is None:
        out["tie_embeddings"] = False
    wrong = [
        f"{FIELDS[f]}={v!r}"
        for f, v in out.items()
        if f not in ("name", "tie_embeddings", "qkv_bias") and (not isinstance(v, int) or isinstance(v, bool))
    ]
    if wrong or not isinstance(out["tie_embeddings"], bool):
        raise HFConfigError(
            f"{where}: {', '.join(wrong) or 'tie_word_embeddings'} must be an integer/boolean"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is not None:  # a head size of its own (Qwen3, Mistral-Nemo): model.head_dim
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            raise HFConfigError(f"{where}: head_dim={head_dim!r} must be a positive integer")
        if head_dim * out["num_heads"] != out["hidden_size"]:
            out["head_dim"] = head_dim
    out["qk_norm"] = model_type in QK_NORM_TYPES
    if model_type in MOE_TYPES:
        out.update(_moe_fields(cfg, model_type, where))
    return out


def _moe_fields(cfg: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """ModelSpec's mixture-of-experts fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json."""
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if model_type == "mixtral":
        ffn, shared_width, norm, dense = cfg.get("intermediate_size"), 0, True, 0
    else:
        ffn = cfg.get("moe_intermediate_size")
        shared_width = cfg.get("shared_expert_intermediate_size") or 0
        norm = bool(cfg.get("norm_topk_prob", model_type == "qwen3_moe"))
        dense = _dense_first_layers(cfg, where)
    top_k = cfg.get("num_experts_per_tok")
    wrong = [
        f"{k}={v!r}" for k, v in (("experts", experts), ("num_experts_per_tok", top_k), ("expert size", ffn))
    ]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (experts, top_k, ffn)):
        raise HFConfigError(f"{where}: {', '.join(wrong)}: a mixture of experts needs positive integers")
    if not isinstance(shared_width, int) or shared_width % ffn:
        raise HFConfigError(
            f"{where}: cannot model shared_expert_intermediate_size {shared_width!r}: not a whole number of "
            f"experts of {ffn}"
        )
    # transformers adds the load-balancing loss (router_aux_loss_coef x its load_balancing_loss_func)
    # only where output_router_logits is true; the published configs say false
    coeff = cfg.get("router_aux_loss_coef", 0.0) if cfg.get("output_router_logits") is True else 0.0
    if not isinstance(coeff, (int, float)) or isinstance(coeff, bool) or not coeff >= 0:
        raise HFConfigError(f"{where}: router_aux_loss_coef={coeff!r} must be a number >= 0")
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "moe_ffn_hidden_size": ffn,
        "num_shared_experts": shared_width // ffn,
        "moe_router": "softmax",
        "moe_norm_topk": norm,
        "moe_aux_loss_coeff": float(coeff),
        "moe_dense_layers": dense,
    }


def _dense_first_layers(cfg: dict[str, Any], where: str) -> int:
    """Qwen2-MoE's and Qwen3-MoE's dense layers (``mlp_only_layers``, an MLP of ``intermediate_size``;
    transformers makes layer i sparse where i is not among them and (i + 1) % ``decoder_sparse_step`` is
    0) as ``moe_dense_layers``: the first k layers only, every later one sparse."""
    step, listed = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    first = list(range(len(listed))) if isinstance(listed, list) else None
    layers = cfg.get("num_hidden_layers")
    every = isinstance(layers, int) and listed and len(listed) >= layers  # every layer dense
    if step != 1 or listed != first or every:
        raise HFConfigError(
            f"{where}: cannot model dense layers among expert layers, only the first k of them "
            f"(decoder_sparse_step {step}, mlp_only_layers {listed})"
        )
    return len(listed)
