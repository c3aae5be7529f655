"""accel.availability: true answers about installed packages (distribution metadata, versions), devices and
precisions; HF's keyword arguments; a torch-free import."""

import importlib
import subprocess
import sys
import types

import pytest
import torch

from accel import availability
from accel.utils import imports
from accel.utils.imports import deepspeed_required


def _fake_package(root, module, distribution=None, version=None, body=""):
    """A module folder `module` under `root`, with an installed distribution's metadata when `version` is given."""
    package = root / module
    package.mkdir()
    (package / "__init__.py").write_text(body)
    if version is not None:
        info = root / f"{distribution or module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution or module}\nVersion: {version}\n")
    importlib.invalidate_caches()


def test_importing_it_does_not_import_torch():
    code = "import sys, accel.availability, accel.environment, accel.cpu_affinity; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_folder_without_an_installed_distribution_is_not_a_package(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "import_timer")
    assert importlib.util.find_spec("import_timer") is not None
    assert availability.is_import_timer_available() is False


def test_an_installed_distribution_is_a_package(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "dvclive", version="3.0")
    assert availability.is_dvclive_available() is True


@pytest.mark.parametrize("version, expected", [("3.17.0", True), ("4.0.0", False)])
def test_aim_must_be_older_than_4(tmp_path, monkeypatch, version, expected):
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "aim", version=version)
    assert availability.is_aim_available() is expected


@pytest.mark.parametrize("version, expected", [("0.6.0", False), ("0.6.1", True)])
def test_torchao_needs_0_6_1_and_gates_fp8(tmp_path, monkeypatch, version, expected):
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "torchao", version=version)
    assert availability.is_torchao_available() is expected
    assert availability.is_fp8_available() is (
        expected or availability.is_msamp_available() or availability.is_transformer_engine_available()
    )


def test_mlflow_counts_its_client_only_distribution(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "mlflow", distribution="mlflow_skinny", version="2.0")
    assert availability.is_mlflow_available() is True


def test_bitsandbytes_minimum_versions(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "bitsandbytes", version="0.38.0")
    assert availability.is_bnb_available() and availability.is_8bit_bnb_available()
    assert not availability.is_4bit_bnb_available()
    assert not availability.is_bnb_available(min_version="0.40")


def test_installed_packages_and_versions():
    assert availability.is_numpy_available() is True
    assert availability.is_numpy_available(min_version="999.0") is False
    assert availability.is_pytest_available() is True
    assert availability.is_deepspeed_available() is (importlib.util.find_spec("deepspeed") is not None)
    assert availability.compare_versions("numpy", ">=", "1.0") is True
    assert availability.compare_versions(availability.torch_version, "==", torch.__version__) is True
    assert availability.is_torch_version("<", "999") and not availability.is_torch_version(">", "999")
    with pytest.raises(ValueError, match="must be one of"):
        availability.compare_versions("numpy", "=>", "1.0")


def test_rich_needs_the_package_and_the_flag(monkeypatch):
    monkeypatch.delenv("ACCEL_ENABLE_RICH", raising=False)
    monkeypatch.delenv("ACCELERATE_ENABLE_RICH", raising=False)
    assert availability.is_rich_available() is False
    monkeypatch.setenv("ACCELERATE_ENABLE_RICH", "1")
    assert availability.is_rich_available() is availability._installed("rich")


def test_megatron_needs_the_flag(monkeypatch):
    monkeypatch.setenv("ACCEL_USE_MEGATRON_LM", "false")
    assert availability.is_megatron_lm_available() is False


def test_cuda_check_leaves_cuda_uninitialized_and_the_environment_unchanged():
    assert availability.is_cuda_available() is torch.cuda.is_available()
    assert not torch.cuda.is_initialized()


def test_cpu_precisions():
    if availability.is_cuda_available():
        pytest.skip("answers for the CPU")
    assert availability.is_bf16_available() is True
    assert availability.is_fp16_available() is True


def test_xla_keyword_arguments(monkeypatch):
    with pytest.raises(ValueError, match="cannot both be true"):
        availability.is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)
    assert availability.is_torch_xla_available() is availability._importable("torch_xla")


def test_a_plugin_device_is_asked_and_cached(tmp_path, monkeypatch):
    """A fake torch_npu that registers torch.npu: found, cached like HF's, and absent when counting raises."""
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "torch_npu", body="")
    counted = {"raises": False}

    def device_count():
        if counted["raises"]:
            raise RuntimeError("no NPU")
        return 1

    monkeypatch.setattr(
        torch, "npu", types.SimpleNamespace(is_available=lambda: True, device_count=device_count), raising=False
    )
    availability.is_npu_available.cache_clear()
    try:
        assert availability.is_npu_available() is True
        counted["raises"] = True
        assert availability.is_npu_available(check_device=True) is False
        assert availability.is_npu_available() is True  # cached per arguments, as HF
    finally:
        availability.is_npu_available.cache_clear()
        sys.modules.pop("torch_npu", None)


def test_decorators():
    @availability.torchao_required
    def needs_torchao():
        return "ran"

    @deepspeed_required
    def needs_deepspeed():
        return "ran"

    if not availability.is_torchao_available():
        with pytest.raises(ImportError, match="torchao"):
            needs_torchao()
    assert needs_deepspeed() == "ran"  # no Accelerator yet: HF calls through
    from accel import Accelerator

    Accelerator(cpu=True)
    with pytest.raises(ValueError, match="DeepSpeed is not enabled"):
        needs_deepspeed()


def test_every_check_answers_a_bool():
    names = [name for name in imports.__all__ if name.startswith("is_") and name != "is_torch_version"]
    checks = [getattr(imports, name) for name in names]
    answers = {check.__name__: check() for check in checks}
    assert {name: type(answer) for name, answer in answers.items() if type(answer) is not bool} == {}


@pytest.mark.gpu
def test_cuda_check_leaves_a_fresh_process_able_to_fork():
    code = (
        "import torch; from accel.availability import is_cuda_available, is_bf16_available; "
        "print(is_cuda_available(), torch.cuda.is_initialized())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "False"]
    assert availability.is_bf16_available() is torch.cuda.is_bf16_supported()
