"""A local Hugging Face ``config.json`` of the Llama family as ModelSpec fields (no network, no hub).

``model.hf_config=PATH`` on the command line reads one: the fields map one to one onto ModelSpec's, and
a config whose architecture the estimator cannot model (mixture of experts, multi-head latent attention,
sliding-window attention, biases, a head size other than hidden/heads) is refused in one line naming
the fields, rather than estimated as if it were a dense Llama.
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
MODEL_TYPES = ("llama", "mistral")  # Mistral is Llama plus an optional sliding window (refused below)
# Keys whose presence (with a value that switches the feature on) means another architecture.
UNSUPPORTED = {
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
    "sliding-window attention": ("sliding_window", "use_sliding_window", "layer_types"),
    "biases": ("attention_bias", "mlp_bias"),
}


MAX_BYTES = 16 * 2**20  # a config.json is a few KiB; a file larger than this is not one


class HFConfigError(ValueError):
    """A config.json that cannot be read or modelled, with a one-line message."""


def _switched_on(value: Any) -> bool:
    """``sliding_window: null``, ``attention_bias: false`` and ``num_experts: 0`` leave the feature off."""
    return value not in (None, False, 0, [], "")


def model_fields(path: str | Path) -> dict[str, Any]:
    """ModelSpec fields (and ``name``: the config's folder) from a Llama-family ``config.json``."""
    where = f"model.hf_config={path}"
    path = Path(path).expanduser()
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
        and not (
            key == "layer_types"
            and isinstance(cfg[key], list)
            and set(map(str, cfg[key])) <= {"full_attention"}
        )
    ]
    if refused:
        raise HFConfigError(f"{where}: cannot model {', '.join(refused)}: only dense Llama-family models")

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
    # transformers' defaults: no GQA (kv heads = heads), untied embeddings (LlamaConfig).
    if out["num_kv_heads"] is None:
        out["num_kv_heads"] = out["num_heads"]
    if out["tie_embeddings"] is None:
        out["tie_embeddings"] = False
    wrong = [
        f"{FIELDS[f]}={v!r}"
        for f, v in out.items()
        if f != "name" and f != "tie_embeddings" and (not isinstance(v, int) or isinstance(v, bool))
    ]
    if wrong or not isinstance(out["tie_embeddings"], bool):
        raise HFConfigError(
            f"{where}: {', '.join(wrong) or 'tie_word_embeddings'} must be an integer/boolean"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is not None and out["num_heads"] and head_dim * out["num_heads"] != out["hidden_size"]:
        raise HFConfigError(
            f"{where}: cannot model head_dim {head_dim} ≠ hidden_size/num_attention_heads = "
            f"{out['hidden_size']}/{out['num_heads']}"
        )
    return out
