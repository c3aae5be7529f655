"""`accelerate.utils.fsdp_utils` import path (see accel.backends.fsdp; merge_fsdp_weights lives with the checkpoint
code).
"""

from accel.backends.fsdp import (
    disable_fsdp_ram_efficient_loading,
    enable_fsdp_ram_efficient_loading,
    ensure_weights_retied,
    fsdp2_apply_ac,
    fsdp2_canonicalize_names,
    fsdp2_load_full_state_dict,
    fsdp2_prepare_model,
    fsdp2_switch_optimizer_parameters,
    get_fsdp2_grad_scaler,
    get_module_class_from_name,
    get_parameters_from_modules,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)

__all__ = [
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
    "get_module_class_from_name",
    "get_parameters_from_modules",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]


def __getattr__(name: str):
    # merge_fsdp_weights only reads checkpoint files: it lives with the launch/checkpoint helpers, found through
    # accel.utils' name map.
    if name == "merge_fsdp_weights":
        import accel.utils

        return accel.utils.merge_fsdp_weights
    raise AttributeError(f"module 'accel.utils.fsdp_utils' has no attribute {name!r}")
