"""accel.test_utils: what HF-style test suites import (decorators, subprocess helpers, the regression task)."""

import importlib.util
import os
import pathlib
import re
import sys
import time
import unittest

import psutil
import pytest
import torch

import accel
from accel.test_utils import (
    DEFAULT_LAUNCH_COMMAND,
    RegressionDataset,
    RegressionModel,
    are_the_same_tensors,
    assert_exception,
    capture_call_output,
    execute_subprocess_async,
    get_launch_command,
    get_torch_dist_unique_port,
    path_in_accelerate_package,
    pytest_xdist_worker_id,
    require_cpu,
    require_cuda,
    require_torch_min_version,
    torch_device,
)
from accel.test_utils.examples import compare_against_test, get_function_contents_by_name
from accel.test_utils.testing import (
    AccelerateTestCase,
    SubprocessCallException,
    TempDirTestCase,
    mockenv,
    mockenv_context,
    require_bnb,
    run_command,
)


def test_execute_subprocess_async_returns_the_output():
    result = execute_subprocess_async(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], quiet=True, echo=False
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, ["out"], ["err"])


def test_execute_subprocess_async_raises_with_the_output_on_failure():
    script = "import sys; print('progress'); print('boom', file=sys.stderr); sys.exit(3)"
    with pytest.raises(RuntimeError, match="returncode 3") as caught:
        execute_subprocess_async([sys.executable, "-c", script], quiet=True, echo=False)
    assert "boom" in str(caught.value) and "progress" in str(caught.value)


def test_execute_subprocess_async_kills_a_command_past_its_timeout_with_its_children():
    script = (
        "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(60)']); print('child', child.pid, flush=True); time.sleep(60)"
    )
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 2") as caught:
        execute_subprocess_async([sys.executable, "-c", script], timeout=2, quiet=True, echo=False)
    assert time.monotonic() - start < 15
    child = int(re.search(r"child (\d+)", str(caught.value)).group(1))
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the command's child survived the timeout"
        time.sleep(0.05)


def test_run_command():
    assert run_command([sys.executable, "-c", "print('hi')"], return_stdout=True) == "hi\n"
    with pytest.raises(SubprocessCallException, match="nope"):
        run_command([sys.executable, "-c", "raise SystemExit('nope')"])


def test_launch_command_and_environment_helpers():
    assert get_launch_command(num_processes=2, cpu=True, debug=False, config_file=None) == [
        "accel",
        "launch",
        "--num_processes=2",
        "--cpu",
    ]
    assert DEFAULT_LAUNCH_COMMAND[:2] == ["accel", "launch"] and "--monitor_interval=0.1" in DEFAULT_LAUNCH_COMMAND
    assert torch_device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert path_in_accelerate_package("commands") == pathlib.Path(accel.__file__).parent / "commands"
    with mockenv_context("HOME", PYTEST_XDIST_WORKER="gw3"):
        assert "HOME" not in os.environ and pytest_xdist_worker_id() == 3 and get_torch_dist_unique_port() == 29503
    assert "HOME" in os.environ and "PYTEST_XDIST_WORKER" not in os.environ


def test_checks():
    with assert_exception(ValueError, "bad"):
        raise ValueError("a bad value")
    with pytest.raises(AssertionError, match="ran without issue"):
        with assert_exception(ValueError):
            pass
    with pytest.raises(AssertionError, match="Expected exception of type"):
        with assert_exception(ValueError):
            raise KeyError("x")
    assert capture_call_output(print, "hello") == "hello\n"
    assert are_the_same_tensors(torch.arange(3))


def test_regression_task():
    dataset = RegressionDataset(length=8, seed=0)
    assert len(dataset) == 8 and dataset[0]["x"].dtype.name == "float32"
    assert abs(float(dataset[0]["y"]) - (2 * float(dataset[0]["x"]) + 3)) < 0.5
    model = RegressionModel(a=1, b=2)
    assert capture_call_output(model, torch.tensor([1.0])).startswith("Model dtype: torch.float32")
    assert model(torch.tensor([1.0])).item() == 3.0


def test_require_decorators_skip_by_what_is_present():
    class Decorated(unittest.TestCase):
        @require_cpu
        def test_cpu(self):
            pass

        @require_cuda
        def test_cuda(self):
            pass

        @require_torch_min_version(version="1.0")
        def test_old_torch(self):
            pass

        @require_torch_min_version(version="99.0")
        def test_future_torch(self):
            pass

        @require_bnb
        def test_bnb(self):
            pass

    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(Decorated).run(result)
    skipped = {test.id().rsplit(".", 1)[1] for test, _ in result.skipped}
    expected = {"test_future_torch", "test_bnb"} | ({"test_cuda"} if not torch.cuda.is_available() else {"test_cpu"})
    bnb_installed = importlib.util.find_spec("bitsandbytes") is not None
    assert skipped == expected - ({"test_bnb"} if bnb_installed else set())
    assert result.errors == [] and result.failures == []


def test_test_case_classes(tmp_path):
    class Folder(TempDirTestCase):
        def test_empty_at_start(self):
            assert list(self.tmpdir.iterdir()) == []
            (self.tmpdir / "sub").mkdir()
            (self.tmpdir / "file").write_text("x")

        def test_empty_again(self):
            assert list(self.tmpdir.iterdir()) == []

    class Reset(AccelerateTestCase):
        @mockenv(ACCEL_TEST_UTILS_PROBE="1")
        def test_state(self):
            assert os.environ["ACCEL_TEST_UTILS_PROBE"] == "1"
            from accel.state import PartialState

            PartialState()

    result = unittest.TestResult()
    unittest.TestSuite(
        [
            unittest.defaultTestLoader.loadTestsFromTestCase(Folder),
            unittest.defaultTestLoader.loadTestsFromTestCase(Reset),
        ]
    ).run(result)
    assert result.errors == [] and result.failures == [] and result.testsRun == 3
    from accel.state import PartialState

    assert PartialState._shared_state == {} and "ACCEL_TEST_UTILS_PROBE" not in os.environ


def _script(training_lines, main_lines):
    indent = lambda lines: "".join(f"    {line}\n" for line in lines)  # noqa: E731
    return (
        f"import os\ndef training_function(config, args):\n{indent(training_lines)}def main():\n{indent(main_lines)}"
        'if __name__ == "__main__":\n    main()\n'
    )


def test_compare_against_test_reports_what_the_complete_example_lacks(tmp_path, monkeypatch):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "nlp_example.py").write_text(_script(["model = build()", "train(model)"], ["parse()"]))
    feature = _script(
        ["model = build()", "# a comment", "checkpoint(model)", "train(model)"], ["parse()", "parse_ckpt()"]
    )
    (tmp_path / "feature.py").write_text(feature)
    (tmp_path / "complete.py").write_text(_script(["model = build()", "train(model)"], ["parse()", "parse_ckpt()"]))
    monkeypatch.chdir(tmp_path)
    assert compare_against_test("complete.py", "feature.py", parser_only=True) == []
    assert compare_against_test("complete.py", "feature.py", parser_only=False) == ["    checkpoint(model)\n"]
    assert get_function_contents_by_name(["x = 1\n"], "main") is None
    with pytest.raises(ValueError, match="Incorrect function name"):
        get_function_contents_by_name([], "helper")
