"""HF's `accelerate.utils.<module>` import paths resolve in accel, its constants have HF's values and one home."""

import importlib
import subprocess
import sys

import pytest

import accel.utils

MODULES = ["imports", "environment", "other", "versions", "tqdm", "constants", "random", "operations", "memory"]


@pytest.mark.parametrize("module", MODULES)
def test_module_path_reexports_what_it_lists(module):
    imported = importlib.import_module(f"accel.utils.{module}")
    assert [name for name in imported.__all__ if not hasattr(imported, name)] == []


def test_availability_names_resolve_without_torch():
    code = (
        "import sys; from accel.utils import is_torch_version, is_wandb_available, str_to_bool; "
        "is_wandb_available(); is_torch_version('>=', '2.0'); print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_constants_have_hf_values():
    expected = {
        "MODEL_NAME": "pytorch_model",
        "SAFE_MODEL_NAME": "model",
        "OPTIMIZER_NAME": "optimizer",
        "SCHEDULER_NAME": "scheduler",
        "SAMPLER_NAME": "sampler",
        "SCALER_NAME": "scaler.pt",
        "RNG_STATE_NAME": "random_states",
        "PROFILE_PATTERN_NAME": "profile_{suffix}.json",
        "WEIGHTS_PATTERN_NAME": "pytorch_model{suffix}.bin",
        "SAFE_WEIGHTS_PATTERN_NAME": "model{suffix}.safetensors",
        "WEIGHTS_NAME": "pytorch_model.bin",
        "SAFE_WEIGHTS_NAME": "model.safetensors",
        "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION": "2.1.0",
        "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": "2.4.0",
    }
    assert {name: getattr(accel.utils, name) for name in expected} == expected
    assert accel.utils.TORCH_DISTRIBUTED_OPERATION_TYPES[:5] == ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
    assert "MULTI_CPU" in accel.utils.TORCH_DISTRIBUTED_OPERATION_TYPES
    assert {"nproc_per_node", "rdzv_endpoint", "master_port"} <= set(accel.utils.TORCH_LAUNCH_PARAMS)


def test_checkpoint_file_names_have_one_home():
    from accel.checkpoint import training_state

    for name in (
        "MODEL_NAME",
        "SAFE_MODEL_NAME",
        "OPTIMIZER_NAME",
        "SCHEDULER_NAME",
        "SAMPLER_NAME",
        "SCALER_NAME",
        "RNG_STATE_NAME",
    ):
        assert getattr(accel.utils, name) is getattr(training_state, name)
    assert accel.utils.SAFE_WEIGHTS_PATTERN_NAME.format(suffix="") == accel.utils.SAFE_WEIGHTS_NAME
    assert accel.utils.WEIGHTS_PATTERN_NAME.format(suffix="") == accel.utils.WEIGHTS_NAME


def test_versions_module_constant():
    import torch
    from packaging.version import parse

    from accel.utils import versions

    assert versions.torch_version == parse(torch.__version__)
