"""What accel keeps DeepSpeed from JIT-building (each build takes a minute or two), and the line a build that does
run prints first."""

import importlib.util
import subprocess
import sys
import textwrap

import pytest

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

SCRIPT = textwrap.dedent(
    """
    import torch
    from accel.strategies.deepspeed import import_deepspeed

    deepspeed = import_deepspeed(torch.device("cpu"))
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    print("accelerator", get_accelerator()._name)
    print("shm comm buildable", deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"])

    class Unbuildable(OpBuilder):  # an op whose build fails at once, after the notice
        NAME = "accel_test_op"

        def __init__(self):
            super().__init__(name=self.NAME)

        def absolute_name(self):
            return "accel_test_op"

        def sources(self):
            return []

        def is_compatible(self, verbose=False):
            return False

    try:
        Unbuildable().jit_load()
    except RuntimeError as error:
        print("build failed:", "not being compatible" in str(error))
    """
)


def test_cpu_processes_skip_the_shared_memory_op_and_a_build_announces_itself():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "accelerator cpu" in lines and "shm comm buildable False" in lines and "build failed: True" in lines
    assert "accel: DeepSpeed is building its 'accel_test_op' op (once, cached in" in result.stderr
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr  # named, not guessed
