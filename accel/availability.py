"""What this machine has: installed packages (at the versions HF Accelerate requires), devices torch sees, and
the precisions they support. HF Accelerate's `is_*_available` names with its keyword arguments.

Every answer is checked, never assumed: a package counts when it can be imported *and* its distribution is
installed (a stray folder named like it does not count); a device counts when torch (or its plug-in) sees one.
Unlike HF, each function returns a bool (HF returns None for some missing packages).

Torch-free at import, so the CLI can ask without importing torch; the device checks import torch when called.
Device checks that HF caches (`lru_cache`: `is_xpu_available`, `is_npu_available`, `is_torch_xla_available`, ...)
are cached here too, with the same `cache_clear()`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import operator
import sys
import warnings
from typing import Any, Callable

from packaging.version import Version, parse

from accel import env_vars
from accel.environment import parse_flag_from_env, patch_environment

STR_OPERATION_TO_FUNC = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}
# Minimum torch versions of profiler activities (ProfileKwargs), as HF Accelerate names them.
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"


# --- versions ----------------------------------------------------------------------------------------------------


def _distribution_version(name: str) -> Version:
    import importlib.metadata  # imported when first needed: it costs the CLI's start ~20 ms

    return parse(importlib.metadata.version(name))


@functools.cache
def _torch_version() -> Version:
    return _distribution_version("torch")


def __getattr__(name: str) -> Any:
    if name == "torch_version":  # HF's module constant, read from the metadata only when asked for
        return _torch_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """Compares a version, or an installed distribution's version, with `requirement_version`.

    Args:
        library_or_version: A `packaging` Version, or the name of an installed distribution.
        operation: One of ">", ">=", "==", "!=", "<=", "<".
        requirement_version: The version to compare with.

    Raises:
        ValueError: an unknown operation.
        importlib.metadata.PackageNotFoundError: the named distribution is not installed.

    Example::

        compare_versions("numpy", ">=", "1.25")    # True with numpy 2.x installed
    """
    if operation not in STR_OPERATION_TO_FUNC:
        raise ValueError(f"`operation` must be one of {list(STR_OPERATION_TO_FUNC)}, received {operation}")
    if isinstance(library_or_version, str):
        library_or_version = _distribution_version(library_or_version)
    return STR_OPERATION_TO_FUNC[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compares the installed torch's version with `version` (e.g. `is_torch_version(">=", "2.4")`)."""
    return compare_versions(_torch_version(), operation, version)


# --- packages ----------------------------------------------------------------------------------------------------


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec (e.g. __main__)
        return False


def _installed(module: str, *distributions: str) -> bool:
    """Whether `module` can be imported and one of `distributions` (default: `module`) is installed."""
    if not _importable(module):
        return False
    import importlib.metadata

    for distribution in distributions or (module,):
        try:
            importlib.metadata.metadata(distribution)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def _installed_at(module: str, operation: str, version: str, distribution: str | None = None) -> bool:
    """`_installed(module)` with the distribution's version satisfying `operation version`."""
    distribution = distribution or module
    return _installed(module, distribution) and compare_versions(distribution, operation, version)


def is_import_timer_available() -> bool:
    return _installed("import_timer")


def is_pynvml_available() -> bool:
    return _installed("pynvml", "pynvml", "nvidia-ml-py")


def is_amdsmi_available() -> bool:
    return _installed("amdsmi")


def is_pytest_available() -> bool:
    return _installed("pytest")


def is_msamp_available() -> bool:
    return _installed("msamp", "ms-amp")


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")


def is_lomo_available() -> bool:
    return _installed("lomo_optim", "lomo-optim")


def is_ipex_available() -> bool:
    """Whether Intel Extension for PyTorch is installed (`accel launch --ipex`; HF 1.x dropped its own check)."""
    return _installed("intel_extension_for_pytorch", "intel_extension_for_pytorch", "intel-extension-for-pytorch")


def is_deepspeed_available() -> bool:
    return _installed("deepspeed")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_peft_available() -> bool:
    return _installed("peft")


def is_timm_available() -> bool:
    return _installed("timm")


def is_torchvision_available() -> bool:
    return _installed("torchvision")


def is_boto3_available() -> bool:
    return _installed("boto3")


def is_sagemaker_available() -> bool:
    return _installed("sagemaker")


def is_tqdm_available() -> bool:
    return _installed("tqdm")


def is_pandas_available() -> bool:
    return _installed("pandas")


def is_matplotlib_available() -> bool:
    return _installed("matplotlib")


def is_torchdata_available() -> bool:
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    """torchdata 0.8.0 or newer (the version with `StatefulDataLoader`)."""
    return _installed_at("torchdata", ">=", "0.8.0")


def is_torchao_available() -> bool:
    """torchao 0.6.1 or newer."""
    return _installed_at("torchao", ">=", "0.6.1")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    """numpy at `min_version` or newer."""
    return _installed_at("numpy", ">=", min_version)


def is_bnb_available(min_version: str | None = None) -> bool:
    """bitsandbytes (at `min_version` or newer when given)."""
    if min_version is None:
        return _installed("bitsandbytes")
    return _installed_at("bitsandbytes", ">=", min_version)


def is_4bit_bnb_available() -> bool:
    """bitsandbytes 0.39.0 or newer."""
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    """bitsandbytes 0.37.2 or newer."""
    return is_bnb_available("0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    """bitsandbytes built with its multi-backend feature (imports bitsandbytes)."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_transformer_engine_available() -> bool:
    """NVIDIA's TransformerEngine (Intel's on a Habana Gaudi)."""
    if is_hpu_available():
        return _installed("intel_transformer_engine", "intel-transformer-engine")
    return _installed("transformer_engine", "transformer-engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """TransformerEngine installed and reporting MXFP8 support on this GPU (imports it)."""
    if not _installed("transformer_engine", "transformer-engine"):
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_triton_available() -> bool:
    if is_xpu_available():
        return _installed("triton", "triton-xpu")
    return _installed("triton")


def is_megatron_lm_available() -> bool:
    """Megatron-LM asked for (ACCEL_USE_MEGATRON_LM / ACCELERATE_USE_MEGATRON_LM) and megatron-core 0.8.0 or newer
    installed with `megatron.training`."""
    if not env_vars.get_flag("USE_MEGATRON_LM"):
        return False
    if not _importable("megatron"):
        return False
    try:
        if not compare_versions("megatron-core", ">=", "0.8.0"):
            return False
    except Exception as error:  # HF's behaviour: a version that cannot be read means "not available", with a warning
        warnings.warn(f"Parse Megatron version failed. Exception:{error}")
        return False
    return _importable("megatron.training")


# --- trackers (accel.tracking imports these) ---------------------------------------------------------------------


def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_comet_ml_available() -> bool:
    return _installed("comet_ml", "comet_ml", "comet-ml")


def is_aim_available() -> bool:
    """aim older than 4.0.0 (the API HF's tracker uses)."""
    return _installed_at("aim", "<", "4.0.0")


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_mlflow_available() -> bool:
    """mlflow, or its client-only distribution mlflow-skinny."""
    return _installed("mlflow", "mlflow", "mlflow-skinny")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_swanlab_available() -> bool:
    return _installed("swanlab")


def is_trackio_available() -> bool:
    return sys.version_info >= (3, 10) and _installed("trackio")


def is_rich_available() -> bool:
    """rich installed and asked for (ACCEL_ENABLE_RICH / ACCELERATE_ENABLE_RICH true)."""
    return _installed("rich") and env_vars.get_flag("ENABLE_RICH")


# --- torch features ----------------------------------------------------------------------------------------------


@functools.cache
def is_torch_distributed_available() -> bool:
    """Whether this torch build has torch.distributed (cached: it is a call into C)."""
    import torch

    return torch.distributed.is_available()


def is_xccl_available() -> bool:
    """Whether torch.distributed has Intel's XCCL backend (torch 2.7+)."""
    if not (is_torch_version(">=", "2.7.0") and is_torch_distributed_available()):
        return False
    import torch

    return torch.distributed.distributed_c10d.is_xccl_available()


def is_weights_only_available() -> bool:
    """`torch.load(weights_only=True)` with an allow-list of safe globals (torch 2.4+)."""
    return is_torch_version(">=", "2.4.0")


def is_pippy_available() -> bool:
    """torch.distributed.pipelining (torch 2.4+)."""
    return is_torch_version(">=", "2.4.0")


# --- devices -----------------------------------------------------------------------------------------------------


def is_cuda_available() -> bool:
    """Whether torch sees a CUDA (or ROCm) GPU, asked through NVML so that CUDA is not initialized and the process
    can still fork (`notebook_launcher`, dataloader workers) afterwards."""
    import torch

    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """A ROCm build of torch with a GPU present."""
    import torch

    return torch.version.hip is not None and is_cuda_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Apple's Metal (MPS) device, with torch at `min_version` or newer."""
    import torch

    return is_torch_version(">=", min_version) and torch.backends.mps.is_available() and torch.backends.mps.is_built()


def _plugin_device_available(plugin: str, device: str, check_device: bool) -> bool:
    """A device that an out-of-tree torch plug-in (`plugin`, e.g. torch_npu) registers as `torch.<device>`.

    With `check_device`, a device that raises when counted (the plug-in installed without hardware) is absent.
    """
    if not _importable(plugin):
        return False
    try:
        importlib.import_module(plugin)
    except Exception:  # e.g. torch_npu in a CPU-only container raises on import
        return False
    import torch

    module = getattr(torch, device, None)
    if module is None:
        return False
    if check_device:
        try:
            module.device_count()
        except RuntimeError:
            return False
    return module.is_available()


@functools.lru_cache
def is_mlu_available(check_device: bool = False) -> bool:
    """A Cambricon MLU (torch_mlu), asked through CNDev so that the device is not initialized."""
    if not _importable("torch_mlu"):
        return False
    with patch_environment(PYTORCH_CNDEV_BASED_MLU_CHECK="1"):
        return _plugin_device_available("torch_mlu", "mlu", check_device=False)


@functools.lru_cache
def is_musa_available(check_device: bool = False) -> bool:
    """A Moore Threads MUSA GPU (torch_musa)."""
    return _plugin_device_available("torch_musa", "musa", check_device)


@functools.lru_cache
def is_npu_available(check_device: bool = False) -> bool:
    """A Huawei Ascend NPU (torch_npu)."""
    return _plugin_device_available("torch_npu", "npu", check_device)


@functools.lru_cache
def is_sdaa_available(check_device: bool = False) -> bool:
    """A Tecorigin SDAA (torch_sdaa)."""
    return _plugin_device_available("torch_sdaa", "sdaa", check_device)


@functools.lru_cache
def is_neuron_available(check_device: bool = False) -> bool:
    """An AWS Neuron device (torch_neuronx)."""
    return _plugin_device_available("torch_neuronx", "neuron", check_device)


@functools.lru_cache
def is_hpu_available(init_hccl: bool = False) -> bool:
    """A Habana Gaudi (habana_frameworks.torch); `init_hccl` also loads its collective backend."""
    if not (_importable("habana_frameworks") and _importable("habana_frameworks.torch")):
        return False
    import habana_frameworks.torch  # noqa: F401  (registers torch.hpu)

    if init_hccl:
        import habana_frameworks.torch.distributed.hccl  # noqa: F401
    import torch

    return hasattr(torch, "hpu") and torch.hpu.is_available()


def is_habana_gaudi1() -> bool:
    """Whether the HPU present is a first-generation Gaudi (which has no fp16)."""
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp

    return htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi


@functools.lru_cache
def is_xpu_available(check_device: bool = False) -> bool:
    """An Intel GPU through stock torch (2.7+, as HF Accelerate requires)."""
    if is_torch_version("<=", "2.6"):
        return False
    import torch

    if not hasattr(torch, "xpu"):
        return False
    if check_device:
        try:
            torch.xpu.device_count()
        except RuntimeError:
            return False
    return torch.xpu.is_available()


@functools.lru_cache
def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla installed and importable (USE_TORCH_XLA=0 turns the check off); with `check_is_tpu` /
    `check_is_gpu`, also whether its device is a TPU / a GPU.

    Raises:
        ValueError: both `check_is_tpu` and `check_is_gpu` (HF asserts).
    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("The check_is_tpu and check_is_gpu cannot both be true.")
    if not parse_flag_from_env("USE_TORCH_XLA", default=True) or not _importable("torch_xla"):
        return False
    try:
        import torch_xla.core.xla_model  # noqa: F401
        import torch_xla.runtime
    except ImportError:
        return False
    if check_is_gpu:
        return torch_xla.runtime.device_type() in ("GPU", "CUDA")
    if check_is_tpu:
        return torch_xla.runtime.device_type() == "TPU"
    return True


def get_current_device_type() -> tuple[str, str]:
    """(device type, distributed type) of the accelerator present, found without initializing any device.

    Checked in HF Accelerate's order: MLU, SDAA, MUSA, NPU, HPU, XPU, Neuron; otherwise ("cuda", "MULTI_GPU"),
    whether or not a CUDA device is present (as in HF).
    """
    accelerators = (
        (is_mlu_available, "mlu", "MULTI_MLU"),
        (is_sdaa_available, "sdaa", "MULTI_SDAA"),
        (is_musa_available, "musa", "MULTI_MUSA"),
        (is_npu_available, "npu", "MULTI_NPU"),
        (is_hpu_available, "hpu", "MULTI_HPU"),
        (is_xpu_available, "xpu", "MULTI_XPU"),
        (is_neuron_available, "neuron", "MULTI_NEURON"),
    )
    for available, name, distributed_type in accelerators:
        if available():
            return name, distributed_type
    return "cuda", "MULTI_GPU"


# --- precisions --------------------------------------------------------------------------------------------------


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether the accelerator present (else the CPU) computes in bfloat16.

    A TPU answers `not ignore_tpu`; CUDA, MLU and XPU ask the device (which initializes it); MPS needs macOS 14;
    the CPU always can (torch emulates it where the hardware lacks it).
    """
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    import torch

    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_mlu_available():
        return torch.mlu.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_fp16_available() -> bool:
    """Whether float16 can be used: everywhere but a first-generation Gaudi."""
    return not is_habana_gaudi1()


def is_fp8_available() -> bool:
    """Whether an FP8 engine is installed (MS-AMP, TransformerEngine or torchao). accel does not run them: asking
    for FP8 training raises `accel.unsupported.UnsupportedFeatureError`."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


# --- decorators --------------------------------------------------------------------------------------------------


def torchao_required(func: Callable) -> Callable:
    """Decorator: calling `func` without torchao (0.6.1+) installed raises ImportError."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if not is_torchao_available():
            raise ImportError(
                "`torchao` is not available, please install it before calling this function via `pip install torchao`."
            )
        return func(*args, **kwargs)

    return wrapper
