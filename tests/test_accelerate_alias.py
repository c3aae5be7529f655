"""The opt-in switch that makes `import accelerate` resolve to accel (issue 20, point 1): every way to turn it on,
what a library sees (module, version, distribution metadata, transformers' checks), and that none of HF
Accelerate's code runs."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# What a child reports: which modules named accelerate[.X] exist and where their code lives, the version answers
# a library gets, and transformers' own availability check.
REPORT = textwrap.dedent(
    """
    import importlib.metadata, json, sys
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import gather, set_seed
    import accelerate.utils.operations
    from transformers.utils import is_accelerate_available
    modules = {name: getattr(module, "__name__", None) for name, module in sys.modules.items()
               if name == "accelerate" or name.startswith("accelerate.")}
    print(json.dumps({
        "modules": modules,
        "files": sorted({getattr(m, "__file__", None) or "" for n, m in sys.modules.items() if n in modules}),
        "version": accelerate.__version__,
        "distribution": importlib.metadata.version("accelerate"),
        "summary": importlib.metadata.metadata("accelerate")["Summary"],
        "accelerator": Accelerator.__module__,
        "transformers_sees_it": is_accelerate_available(),
        "env": __import__("os").environ.get("ACCEL_AS_ACCELERATE"),
    }))
    """
)


def run_python(code, env_extra=None, args=(), cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("ACCEL_AS_ACCELERATE", "ACCELERATE_AS_ACCELERATE")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=180, cwd=cwd
    )


def report_of(done):
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_served_by_accel(report):
    assert report["modules"] and all(name.startswith("accel") for name in report["modules"].values()), report
    assert report["modules"]["accelerate.utils.operations"] == "accel.utils.operations"
    assert not any(os.sep + "accelerate" + os.sep in path for path in report["files"]), report["files"]
    assert report["version"] == report["distribution"] == "1.15.0"
    assert report["summary"].startswith("accel ") and "standing in for HF Accelerate 1.15.0" in report["summary"]
    assert report["accelerator"] == "accel.accelerator" and report["transformers_sees_it"] is True
    assert report["env"] == "1"  # processes it starts are served too


def test_the_environment_variable_alone_serves_every_interpreter(tmp_path):
    """Through the installed .pth: the child never imports accel itself."""
    assert_served_by_accel(report_of(run_python(REPORT, {"ACCEL_AS_ACCELERATE": "1"})))


def test_the_notebook_one_liner(tmp_path):
    assert_served_by_accel(report_of(run_python("import accel; accel.as_accelerate()\n" + REPORT)))


def test_hf_accelerates_code_never_runs_even_where_it_comes_first_on_the_path(tmp_path):
    """A package named accelerate that raises on import, first on sys.path, with a newer distribution beside it:
    accel still answers every import and the version question."""
    poisoned = tmp_path / "accelerate"
    poisoned.mkdir()
    (poisoned / "__init__.py").write_text("raise RuntimeError('HF Accelerate code ran')\n")
    info = tmp_path / "accelerate-99.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: accelerate\nVersion: 99.0.0\n")
    report = report_of(run_python(REPORT, {"ACCEL_AS_ACCELERATE": "1", "PYTHONPATH": str(tmp_path)}))
    assert_served_by_accel(report)


def test_off_by_default():
    done = run_python(
        "import sys, accel.accelerate_alias as a; import accelerate; print(a.installed(), accelerate.__file__)"
    )
    assert done.returncode == 0, done.stderr
    installed, path = done.stdout.split()
    assert installed == "False" and os.sep + "accelerate" + os.sep in path  # HF's own, untouched


def test_switching_on_after_hf_accelerate_was_imported_is_refused():
    done = run_python(
        "import accelerate, accel\ntry:\n    accel.as_accelerate()\nexcept RuntimeError as e:\n    print('refused:', e)"
    )
    assert "refused: HF Accelerate is imported already (accelerate" in done.stdout, done.stderr


def test_a_module_accel_lacks_is_pythons_own_error():
    done = run_python("import accel; accel.as_accelerate()\nimport accelerate.no_such_module")
    assert "ModuleNotFoundError: No module named 'accelerate.no_such_module'" in done.stderr


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.multiprocessing as mp

    def child(queue):
        import accelerate
        queue.put(accelerate.Accelerator.__module__)

    if __name__ == "__main__":
        from transformers.utils import is_accelerate_available
        import accelerate
        state = accelerate.PartialState()
        context = mp.get_context("spawn")  # a DataLoader worker started by spawn imports this file again
        queue = context.Queue()
        worker = context.Process(target=child, args=(queue,))
        worker.start()
        spawned = queue.get(timeout=120)
        worker.join(timeout=60)
        print("RANK", json.dumps([state.process_index, accelerate.__version__, accelerate.Accelerator.__module__,
                                  spawned, is_accelerate_available()]), flush=True)
    """
)


def _launch(tmp_path, flags, env_extra=None):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("ACCEL_AS_ACCELERATE", "ACCELERATE_AS_ACCELERATE")}
    env.update(env_extra or {})
    command = [sys.executable, "-m", "accel", "launch", "--cpu", "--num_processes", "2", *flags, str(script)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def _ranks(done):
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(json.loads(line.split("RANK ", 1)[1]) for line in done.stdout.splitlines() if "RANK " in line)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flag", "config"])
def test_every_rank_and_its_spawned_workers_are_served(tmp_path, how):
    if how == "flag":
        done = _launch(tmp_path, ["--as_accelerate"])
    else:
        config = tmp_path / "config.yaml"
        config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nas_accelerate: true\n")
        done = _launch(tmp_path, ["--config_file", str(config)])
    served = ["1.15.0", "accel.accelerator", "accel.accelerator", True]
    assert _ranks(done) == [[0, *served], [1, *served]]
    assert done.stderr.startswith("accel launch: `import accelerate` resolves to accel in every rank"), done.stderr


def test_accel_env_says_whether_it_is_on():
    off = subprocess.run(
        [sys.executable, "-m", "accel", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "ACCEL_AS_ACCELERATE"},
    )
    on = subprocess.run(
        [sys.executable, "-m", "accel", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, ACCEL_AS_ACCELERATE="1"),
    )
    assert "- accel as accelerate: off" in off.stdout
    assert "- accel as accelerate: on: `import accelerate` resolves to accel (accel " in on.stdout
