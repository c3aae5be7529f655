"""The hosted-service trackers (trackio, SwanLab, Comet, Aim, ClearML, DVCLive) call their package's API as HF
Accelerate's trackers do. Their packages need accounts or servers, so each is replaced by a recorder module that
logs every call; the real packages are imported only when a run starts, never at `import accel.tracking`."""

import sys
import types

import pytest

import accel.availability
from accel import Accelerator
from accel.tracking import MissingTrackerPackageError

CONFIG = {"lr": 0.1, "opt": {"name": "adam"}}


class Recorder:
    """Any attribute is a callable that records `(path, args, kwargs)` and returns another Recorder."""

    def __init__(self, calls, path):
        self._calls, self._path = calls, path

    def __getattr__(self, name):
        return Recorder(self._calls, f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        self._calls.append((self._path, args, kwargs))
        return Recorder(self._calls, f"{self._path}()")

    def __setitem__(self, key, value):
        self._calls.append((f"{self._path}[{key!r}]=", (value,), {}))


def fake_package(monkeypatch, kind, *modules):
    calls = []
    for name in (kind, *modules):
        module = types.ModuleType(name)
        module.__getattr__ = lambda attribute, name=name: Recorder(calls, f"{name}.{attribute}")
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(accel.availability, f"is_{kind}_available", lambda: True)
    return calls


def run_through_accelerator(kind, tmp_path, init_kwargs=None):
    accelerator = Accelerator(log_with=kind, project_dir=str(tmp_path))
    accelerator.init_trackers("proj", config=CONFIG, init_kwargs={kind: init_kwargs or {}})
    accelerator.log({"loss": 0.5, "eval_acc": 0.75}, step=3)
    accelerator.end_training()


def paths(calls):
    return [path for path, _, _ in calls]


@pytest.mark.parametrize("kind", ["trackio", "swanlab"])
def test_wandb_like_services(kind, monkeypatch, tmp_path):
    calls = fake_package(monkeypatch, kind)
    run_through_accelerator(kind, tmp_path, {"mode": "local"})
    assert calls[0] == (f"{kind}.init", (), {"project": "proj", "mode": "local"})
    assert calls[1] == (f"{kind}.config.update", (CONFIG,), {"allow_val_change": True})
    assert calls[2] == (f"{kind}.init().log", ({"loss": 0.5, "eval_acc": 0.75},), {"step": 3})
    assert paths(calls[3:]) == [f"{kind}.init().finish"]


def test_comet(monkeypatch, tmp_path):
    calls = fake_package(monkeypatch, "comet_ml")
    sys.modules["comet_ml"].__version__ = "3.45.0"
    run_through_accelerator("comet_ml", tmp_path, {"online": False})
    assert calls[0] == ("comet_ml.start", (), {"project_name": "proj", "online": False})
    assert calls[1] == ("comet_ml.start().log_parameters", ({"lr": 0.1, "opt/name": "adam"},), {})
    assert calls[2:5] == [
        ("comet_ml.start().set_step", (3,), {}),
        ("comet_ml.start().log_metric", ("loss", 0.5), {"step": 3}),
        ("comet_ml.start().log_metric", ("eval_acc", 0.75), {"step": 3}),
    ]
    assert paths(calls[5:]) == ["comet_ml.start().end"]


def test_aim_tracks_in_the_project_dir(monkeypatch, tmp_path):
    calls = fake_package(monkeypatch, "aim")
    run_through_accelerator("aim", tmp_path)
    assert calls[0] == ("aim.Run", (), {"repo": str(tmp_path)})
    assert calls[1] == ("aim.Run()['hparams']=", (CONFIG,), {})
    assert calls[2:4] == [
        ("aim.Run().track", (0.5,), {"name": "loss", "step": 3}),
        ("aim.Run().track", (0.75,), {"name": "eval_acc", "step": 3}),
    ]
    assert paths(calls[4:]) == ["aim.Run().close"]


def test_clearml_reports_series_from_key_prefixes(monkeypatch, tmp_path):
    calls = fake_package(monkeypatch, "clearml")
    # No task started by the user: current_task() is None, so the tracker starts (and later closes) its own.
    sys.modules["clearml"].Task = types.SimpleNamespace(
        current_task=lambda: None, init=Recorder(calls, "clearml.Task.init")
    )
    run_through_accelerator("clearml", tmp_path)
    assert calls[0] == ("clearml.Task.init", (), {"project_name": "proj", "task_name": "proj"})
    assert calls[1] == ("clearml.Task.init().connect_configuration", (CONFIG,), {})
    scalars = [kwargs for path, _, kwargs in calls if path.endswith("report_scalar")]
    assert scalars == [
        {"title": "loss", "series": "train", "value": 0.5, "iteration": 3},
        {"title": "acc", "series": "eval", "value": 0.75, "iteration": 3},
    ]
    assert paths(calls)[-1] == "clearml.Task.init().close"


def test_dvclive(monkeypatch, tmp_path):
    calls = fake_package(monkeypatch, "dvclive", "dvclive.plots")
    sys.modules["dvclive.plots"].Metric = types.SimpleNamespace(could_log=lambda value: isinstance(value, float))
    run_through_accelerator("dvclive", tmp_path, {"dir": str(tmp_path / "live")})
    assert calls[0] == ("dvclive.Live", (), {"dir": str(tmp_path / "live")})
    assert calls[1] == ("dvclive.Live().log_params", (CONFIG,), {})
    assert calls[2:] == [
        ("dvclive.Live().log_metric", ("loss", 0.5), {}),
        ("dvclive.Live().log_metric", ("eval_acc", 0.75), {}),
        ("dvclive.Live().next_step", (), {}),
        ("dvclive.Live().end", (), {}),
    ]


@pytest.mark.parametrize(
    "kind, command",
    [
        ("aim", 'pip install "aim<4"'),
        ("comet_ml", "pip install comet-ml"),
        ("clearml", "pip install clearml"),
        ("dvclive", "pip install dvclive"),
        ("swanlab", "pip install swanlab"),
        ("trackio", "pip install trackio"),
    ],
)
def test_a_missing_service_package_names_its_install_command(kind, command, monkeypatch):
    monkeypatch.setattr(accel.availability, f"is_{kind}_available", lambda: False)
    with pytest.raises(
        MissingTrackerPackageError, match=f"needs the `{kind}` package, which is not installed: {command}"
    ):
        Accelerator(log_with=kind, project_dir="unused")
