"""accel.environment: reading settings, changing os.environ temporarily, and the machine (GPUs via nvidia-smi,
kernel, ports) with HF Accelerate's semantics."""

import logging
import os
import platform
import socket
import subprocess

import pytest

from accel import environment
from accel.availability import get_current_device_type
from accel.environment import (
    are_libraries_initialized,
    check_cuda_fp8_capability,
    check_cuda_p2p_ib_support,
    clear_environment,
    convert_dict_to_env_variables,
    get_cpu_distributed_information,
    get_gpu_info,
    get_int_from_env,
    is_port_in_use,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    purge_accelerate_environment,
    str_to_bool,
)


def test_str_to_bool():
    assert [str_to_bool(v) for v in ("y", "YES", "t", "True", "on", "1")] == [1] * 6
    assert [str_to_bool(v) for v in ("n", "No", "f", "FALSE", "off", "0")] == [0] * 6
    assert str_to_bool("yes", to_bool=True) is True and str_to_bool("0", to_bool=True) is False
    with pytest.raises(ValueError, match="invalid truth value 'maybe'"):
        str_to_bool("maybe")


def test_reading_variables(monkeypatch):
    monkeypatch.setenv("H1_FIRST", "-1")
    monkeypatch.setenv("H1_SECOND", "7")
    assert get_int_from_env(["H1_UNSET", "H1_FIRST", "H1_SECOND"], 3) == 7
    assert get_int_from_env(["H1_UNSET"], 3) == 3
    monkeypatch.setenv("H1_BAD", "seven")
    with pytest.raises(ValueError, match="H1_BAD='seven' is not an integer"):
        get_int_from_env(["H1_BAD"], 0)
    monkeypatch.setenv("H1_FLAG", "on")
    assert parse_flag_from_env("H1_FLAG") is True and parse_flag_from_env("H1_UNSET", default=True) is True
    monkeypatch.setenv("H1_FLAG", "sometimes")
    with pytest.raises(ValueError, match="H1_FLAG"):
        parse_flag_from_env("H1_FLAG")
    assert parse_choice_from_env("H1_SECOND") == "7" and parse_choice_from_env("H1_UNSET") == "no"


def test_cpu_distributed_information(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    info = get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 8, 0, 4)


def test_are_libraries_initialized():
    assert are_libraries_initialized("os", "surely_not_a_module_h1") == ["os"]


def test_convert_dict_to_env_variables(caplog):
    with caplog.at_level(logging.WARNING):
        lines = convert_dict_to_env_variables({"ACCEL_DEBUG_MODE": "1", "BAD": "<x", "EMPTY": "", "OTHER": "2"})
    assert lines == ["ACCEL_DEBUG_MODE=1\n", "OTHER=2\n"]
    assert "BAD" in caplog.text and "EMPTY" in caplog.text


def test_patch_environment_restores_previous_values(monkeypatch):
    monkeypatch.setenv("H1_KEPT", "old")
    monkeypatch.delenv("H1_NEW", raising=False)
    with patch_environment(h1_kept=1, H1_NEW="x"):
        assert os.environ["H1_KEPT"] == "1" and os.environ["H1_NEW"] == "x"
    assert os.environ["H1_KEPT"] == "old" and "H1_NEW" not in os.environ


def test_clear_environment_restores_everything(monkeypatch):
    monkeypatch.setenv("H1_KEPT", "old")
    before = dict(os.environ)
    with clear_environment():
        assert dict(os.environ) == {}
        os.environ["H1_INSIDE"] = "1"
    assert dict(os.environ) == before


def test_purge_a_function(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")

    @purge_accelerate_environment
    def sets_settings():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["ACCEL_DEBUG_MODE"] = "1"
        os.environ["H1_OTHER"] = "kept"
        return "done"

    try:
        assert sets_settings() == "done"
        assert os.environ["ACCELERATE_MIXED_PRECISION"] == "no"
        assert "ACCEL_DEBUG_MODE" not in os.environ
        assert os.environ["H1_OTHER"] == "kept"  # only accel's settings are purged
    finally:
        os.environ.pop("H1_OTHER", None)


def test_purge_a_class_and_its_subclasses():
    @purge_accelerate_environment
    class Base:
        def test_one(self):
            os.environ["ACCEL_H1_A"] = "1"

        def helper(self):
            os.environ["ACCEL_H1_B"] = "1"

    class Child(Base):
        def test_two(self):
            os.environ["ACCELERATE_H1_C"] = "1"

    Child().test_one()
    Child().test_two()
    assert "ACCEL_H1_A" not in os.environ and "ACCELERATE_H1_C" not in os.environ
    try:
        Base().helper()  # not a test method: not wrapped
        assert os.environ["ACCEL_H1_B"] == "1"
    finally:
        os.environ.pop("ACCEL_H1_B", None)


def test_port_in_use():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("localhost", 0))
        server.listen()
        assert is_port_in_use(server.getsockname()[1]) is True
    assert is_port_in_use(environment.get_free_port()) is False


def _fake_gpus(monkeypatch, rows=None, error=None):
    def query(*fields):
        if error is not None:
            raise error
        return [[row[field] for field in fields] for row in rows]

    monkeypatch.setattr(environment, "query_gpus", query)


def test_gpu_info_from_nvidia_smi(monkeypatch):
    _fake_gpus(monkeypatch, [{"count": "2", "name": "NVIDIA H100"}, {"count": "2", "name": "NVIDIA H100"}])
    assert get_gpu_info() == (["NVIDIA H100", "NVIDIA H100"], 2)


@pytest.mark.parametrize(
    "names, driver, expected",
    [
        (["NVIDIA GeForce RTX 4090"] * 2, "535.1", False),
        (["NVIDIA GeForce RTX 4090"] * 2, "550.54.14", True),
        (["NVIDIA GeForce RTX 4090"], "535.1", True),
        (["NVIDIA A100"] * 2, "535.1", True),
    ],
)
def test_p2p_ib_support(monkeypatch, names, driver, expected):
    _fake_gpus(monkeypatch, [{"count": str(len(names)), "name": name, "driver_version": driver} for name in names])
    assert check_cuda_p2p_ib_support() is expected


def test_p2p_ib_support_without_nvidia_smi(monkeypatch):
    _fake_gpus(monkeypatch, error=FileNotFoundError("nvidia-smi"))
    assert check_cuda_p2p_ib_support() is True


@pytest.mark.parametrize("capability, expected", [("8.0", False), ("8.9", True), ("9.0", True)])
def test_fp8_capability(monkeypatch, capability, expected):
    _fake_gpus(monkeypatch, [{"compute_capability": capability}])
    check_cuda_fp8_capability.cache_clear()
    try:
        assert check_cuda_fp8_capability() is expected
    finally:
        check_cuda_fp8_capability.cache_clear()


def test_fp8_capability_without_a_gpu(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("answers for a machine without a GPU")
    _fake_gpus(monkeypatch, error=subprocess.CalledProcessError(9, "nvidia-smi"))
    check_cuda_fp8_capability.cache_clear()
    try:
        assert check_cuda_fp8_capability() is False
    finally:
        check_cuda_fp8_capability.cache_clear()


def test_current_device_type_defaults_to_cuda():
    from accel import availability

    if availability.is_xpu_available() or availability.is_npu_available() or availability.is_hpu_available():
        pytest.skip("another accelerator is present")
    assert get_current_device_type() == ("cuda", "MULTI_GPU")


@pytest.mark.parametrize("release, warns", [("4.19.0-25-amd64", True), ("5.15.0-1057-azure", False), ("6.1", False)])
def test_check_os_kernel(monkeypatch, caplog, release, warns):
    uname = platform.uname()
    monkeypatch.setattr(platform, "uname", lambda: uname._replace(system="Linux", release=release))
    with caplog.at_level(logging.WARNING, logger="accel.environment"):
        environment.check_os_kernel()
    assert ("below the recommended minimum of 5.5.0" in caplog.text) is warns


@pytest.mark.gpu
def test_gpu_facts_from_nvidia_smi_agree_with_torch(monkeypatch):
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    names, count = get_gpu_info()
    assert count >= torch.cuda.device_count() and names[0]
    check_cuda_fp8_capability.cache_clear()
    try:
        assert check_cuda_fp8_capability() is (torch.cuda.get_device_capability(0) >= (8, 9))
    finally:
        check_cuda_fp8_capability.cache_clear()
