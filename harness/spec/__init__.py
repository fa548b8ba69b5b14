"""The one description of a training configuration: frozen specs (``types``), their single validation
(``validate``), their canonical form and ``config_id`` (``identity``), the named training stacks that
fill a config's choices (``stacks``), and Hugging Face config.json reading (``hf_config``).

May import: the standard library only. Everything else in harness imports from here.
"""

from harness.spec.identity import (
    canonical,
    canonical_config_id,
    canonical_form,
    config_id,
    flat,
    from_dict,
    from_flat,
    raw_id,
    spec_id,
)
from harness.spec.stacks import STACKS, ResolvedStack, apply_stack, config_spec
from harness.spec.types import (
    ADDED_FIELD_DEFAULTS,
    ATTENTION,
    CONFIG_ID_VERSION,
    PP_SCHEDULES,
    PRECISIONS,
    RECOMPUTE,
    RECOMPUTE_METHODS,
    DeviceSpec,
    InvalidSpec,
    ModelSpec,
    ParallelSpec,
    RunSpec,
    TrainSpec,
    balanced_pp_layers,
    busiest_stage_view,
    chunk_layer_ranges,
    dense_mlp_model,
    stage_kinds,
    stage_layers,
    stage_view,
    stage_views,
)
from harness.spec.validate import layout_problems, problems, type_problems

__all__ = [
    "ADDED_FIELD_DEFAULTS",
    "ATTENTION",
    "CONFIG_ID_VERSION",
    "PP_SCHEDULES",
    "PRECISIONS",
    "RECOMPUTE",
    "RECOMPUTE_METHODS",
    "STACKS",
    "DeviceSpec",
    "InvalidSpec",
    "ModelSpec",
    "ParallelSpec",
    "ResolvedStack",
    "RunSpec",
    "TrainSpec",
    "apply_stack",
    "balanced_pp_layers",
    "busiest_stage_view",
    "canonical",
    "canonical_config_id",
    "canonical_form",
    "chunk_layer_ranges",
    "config_id",
    "config_spec",
    "dense_mlp_model",
    "flat",
    "from_dict",
    "from_flat",
    "layout_problems",
    "problems",
    "raw_id",
    "spec_id",
    "stage_kinds",
    "stage_layers",
    "stage_view",
    "stage_views",
    "type_problems",
]
