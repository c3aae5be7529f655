"""The tracking API HF Accelerate scripts use: log_with resolution, init_trackers / log / get_tracker / end_training,
custom GeneralTrackers, bad input, where trackers run on 2 ranks, and resuming a run from a checkpoint."""

import json
import warnings

import pytest
import torch
from spawn_pool import run_on_ranks

import accel.availability
import accel.utils
from accel import Accelerator
from accel.tracking import (
    LOGGER_TYPE_TO_CLASS,
    GeneralTracker,
    InactiveTracker,
    JSONLTracker,
    LoggerType,
    MissingTrackerPackageError,
    TensorBoardTracker,
    filter_trackers,
    get_available_trackers,
    on_main_process,
    register_tracker_class,
)


class RecordingTracker(GeneralTracker):
    """A custom tracker written as for HF Accelerate: it records every call."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self, run_name=None, main_process_only=True, fail_on=None):
        super().__init__()
        self.run_name = run_name
        self.main_process_only = main_process_only
        self.fail_on = fail_on
        self.calls = []

    @property
    def tracker(self):
        return self.calls

    def _record(self, call, *args):
        if call == self.fail_on:
            raise RuntimeError(f"{call} failed on purpose")
        self.calls.append((call, *args))

    def start(self):
        self._record("start")

    def store_init_configuration(self, values):
        self._record("config", values)

    def log(self, values, step=None, **kwargs):
        self._record("log", values, step, kwargs)

    def finish(self):
        self._record("finish")


class OtherTracker(RecordingTracker):
    name = "other"


# --- what log_with asks for -----------------------------------------------------------------------------------------


def test_logger_type_has_hf_members_and_jsonl():
    assert {member.value for member in LoggerType} == {
        "all",
        "aim",
        "tensorboard",
        "wandb",
        "trackio",
        "comet_ml",
        "mlflow",
        "clearml",
        "dvclive",
        "swanlab",
        "jsonl",
    }
    assert "wandb" in LoggerType and "wandbb" not in LoggerType
    assert str(LoggerType.TENSORBOARD) == "tensorboard"
    assert accel.utils.LoggerType is LoggerType


def test_filter_trackers_names_types_instances_and_duplicates(tmp_path):
    custom = RecordingTracker()
    chosen = filter_trackers(["jsonl", LoggerType.JSONL, custom, "jsonl"], tmp_path)
    assert chosen == [LoggerType.JSONL, custom]
    assert filter_trackers(None) == []
    assert filter_trackers(custom) == [custom]


def test_unknown_tracker_name_lists_the_valid_ones_and_the_closest():
    with pytest.raises(ValueError, match="Unsupported logging capability: 'tensorbord'") as error:
        Accelerator(log_with="tensorbord")
    assert "'tensorboard'" in str(error.value) and "Did you mean 'tensorboard'?" in str(error.value)
    assert "'jsonl'" in str(error.value) and "'mlflow'" in str(error.value)


def test_a_tracker_class_instead_of_an_instance_says_how_to_pass_it():
    with pytest.raises(
        ValueError, match=r"Pass an instance \(RecordingTracker\(...\)\) or call register_tracker_class"
    ):
        filter_trackers([RecordingTracker])


def test_a_named_tracker_whose_package_is_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(accel.availability, "is_wandb_available", lambda: False)
    with pytest.raises(MissingTrackerPackageError, match=r"needs the `wandb` package.*pip install wandb"):
        Accelerator(log_with=["wandb"])
    monkeypatch.setattr(accel.availability, "is_tensorboard_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install tensorboard \(or pip install 'accel\[tracking\]'\)"):
        filter_trackers("tensorboard", "logs")


def test_a_tracker_that_writes_files_needs_a_directory(monkeypatch):
    with pytest.raises(ValueError, match="Logging with `jsonl` requires a `logging_dir`"):
        Accelerator(log_with="jsonl")


def test_all_is_every_installed_tracker_plus_instances(monkeypatch, tmp_path):
    for kind in ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio"):
        monkeypatch.setattr(
            accel.availability, f"is_{kind}_available", lambda kind=kind: kind in ("mlflow", "tensorboard")
        )
    assert get_available_trackers() == [LoggerType.TENSORBOARD, LoggerType.MLFLOW, LoggerType.JSONL]
    custom = RecordingTracker()
    assert filter_trackers(["all", custom], tmp_path) == [
        custom,
        LoggerType.TENSORBOARD,
        LoggerType.MLFLOW,
        LoggerType.JSONL,
    ]
    # Without a directory, the file-writing trackers are left out, with a warning naming those HF users know.
    with pytest.warns(UserWarning, match=r"log_with='all' leaves out tensorboard: they write files"):
        assert filter_trackers(LoggerType.ALL) == [LoggerType.MLFLOW]


def test_log_with_and_nothing_installed_warns_as_hf(monkeypatch):
    monkeypatch.setattr("accel.tracking.registry.get_available_trackers", lambda: [])
    with pytest.warns(
        UserWarning, match=r"`log_with=all` was passed but no supported trackers are currently installed"
    ):
        accelerator = Accelerator(log_with="all")
    assert accelerator.log_with == [] and accelerator.trackers == []


def test_general_tracker_names_what_a_custom_tracker_misses():
    class Incomplete(GeneralTracker):
        name = "incomplete"

    with pytest.raises(NotImplementedError, match="`requires_logging_directory`, `tracker`"):
        Incomplete()
    GeneralTracker(_blank=True)  # HF's inert placeholder stays constructible


def test_register_tracker_class_lets_log_with_name_it():
    register_tracker_class(OtherTracker)
    try:
        accelerator = Accelerator(log_with="other")
        accelerator.init_trackers("proj", init_kwargs={"other": {"fail_on": "never"}})
        tracker = accelerator.get_tracker("other")
        assert isinstance(tracker, OtherTracker) and tracker.run_name == "proj" and tracker.fail_on == "never"
        assert tracker.calls == [("start",)]
        with pytest.warns(UserWarning, match="A tracker named 'other' is already registered"):
            register_tracker_class(OtherTracker)
    finally:
        LOGGER_TYPE_TO_CLASS.pop("other")
    with pytest.raises(ValueError, match="must be a subclass of `GeneralTracker`"):
        register_tracker_class(object)


# --- init_trackers / log / get_tracker / end_training ---------------------------------------------------------------


def test_custom_tracker_receives_config_logs_and_finish():
    custom = RecordingTracker()
    accelerator = Accelerator(log_with=custom)
    accelerator.init_trackers("proj", config={"lr": 0.1})
    accelerator.log({"loss": 0.5}, step=3, log_kwargs={"recording": {"commit": False}, "other": {"x": 1}})
    assert accelerator.trackers == [custom]
    assert accelerator.get_tracker("recording") is custom
    assert accelerator.get_tracker("recording", unwrap=True) is custom.calls
    accelerator.end_training()
    assert custom.calls == [
        ("start",),
        ("config", {"lr": 0.1}),
        ("log", {"loss": 0.5}, 3, {"commit": False}),
        ("finish",),
    ]
    accelerator.end_training()  # a second end_training does not finish twice
    assert custom.calls[-2:] == [("log", {"loss": 0.5}, 3, {"commit": False}), ("finish",)]


def test_init_kwargs_reach_the_constructor(tmp_path):
    accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    accelerator.init_trackers("run", init_kwargs={"jsonl": {"fsync": True}, "wandb": {"ignored": 1}})
    assert accelerator.get_tracker("jsonl").fsync is True
    accelerator.end_training()


def test_log_before_init_trackers_logs_nothing_and_warns_once():
    custom = RecordingTracker()
    accelerator = Accelerator(log_with=custom)
    with pytest.warns(UserWarning, match=r"nothing was logged \(call Accelerator.init_trackers") as caught:
        accelerator.log({"loss": 1.0})
        accelerator.log({"loss": 2.0})
    assert len([w for w in caught if "nothing was logged" in str(w.message)]) == 1
    assert caught[0].filename == __file__  # points at the user's log call
    assert custom.calls == []


def test_get_tracker_unknown_name_and_placeholders():
    accelerator = Accelerator(log_with=RecordingTracker())
    assert isinstance(accelerator.get_tracker("wandb"), InactiveTracker)  # no tracker yet: inert, as HF's blank one
    accelerator.init_trackers("proj")
    with pytest.raises(
        ValueError, match=r"wandb is not an available tracker stored inside the `Accelerator`; it has \['recording'\]"
    ):
        accelerator.get_tracker("wandb")
    placeholder = InactiveTracker("wandb")
    assert placeholder.log_images({"a": []}) is None and placeholder.tracker.add_scalar("x", 1) is None
    assert isinstance(placeholder, GeneralTracker)
    accelerator.end_training()


def test_end_training_finishes_every_tracker_even_if_one_fails():
    failing, healthy = RecordingTracker(fail_on="finish"), OtherTracker()
    accelerator = Accelerator(log_with=[failing, healthy])
    accelerator.init_trackers("proj")
    with pytest.raises(RuntimeError, match="finish failed on purpose"):
        accelerator.end_training()
    assert healthy.calls[-1] == ("finish",)


def test_a_failed_start_finishes_the_trackers_already_started():
    started, failing = OtherTracker(), RecordingTracker(fail_on="start")
    accelerator = Accelerator(log_with=[started, failing])
    with pytest.raises(RuntimeError, match="start failed on purpose"):
        accelerator.init_trackers("proj")
    assert started.calls == [("start",), ("finish",)]


def test_on_main_process_decorator_reads_the_attribute_when_called():
    class Counter:
        main_process_only = True
        count = 0

        @on_main_process
        def bump(self):
            self.count += 1
            return self.count

    counter = Counter()
    assert counter.bump() == 1  # one process: the main one
    assert Counter.bump.__name__ == "bump"


def test_config_values_a_backend_cannot_store_are_flattened_and_stringified(tmp_path):
    accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    config = {
        "lr": 0.1,
        "optimizer": {"name": "adamw", "betas": [0.9, 0.99]},
        "path": tmp_path,
        "dtype": LoggerType.WANDB,
    }
    accelerator.init_trackers("run", config=config)
    accelerator.end_training()
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored == {
        "lr": 0.1,
        "optimizer/name": "adamw",
        "optimizer/betas": "[0.9, 0.99]",
        "path": str(tmp_path),
        "dtype": "wandb",
    }


# --- two ranks --------------------------------------------------------------------------------------------------------


def _track_on_ranks(project_dir):
    everywhere = RecordingTracker(main_process_only=False)
    main_only = OtherTracker()
    accelerator = Accelerator(log_with=[everywhere, main_only, "jsonl"], project_dir=project_dir)
    accelerator.init_trackers("run", config={"lr": 0.1})
    for step in range(3):
        accelerator.log({"loss": float(step), "rank": accelerator.process_index}, step=step)
    names = [tracker.name for tracker in accelerator.trackers]
    placeholder = accelerator.get_tracker("jsonl")
    placeholder.log({"x": 1})  # on rank 1: the inert placeholder
    accelerator.wait_for_everyone()  # nobody destroys the group while a peer still uses it
    accelerator.end_training()
    return names, type(placeholder).__name__, everywhere.calls, main_only.calls


def test_main_process_only_trackers_run_on_rank_0_and_the_others_everywhere(tmp_path):
    (names0, kind0, everywhere0, main0), (names1, kind1, everywhere1, main1) = run_on_ranks(
        _track_on_ranks, 2, str(tmp_path)
    )
    assert names0 == ["recording", "other", "jsonl"] and names1 == ["recording"]
    assert kind0 == "JSONLTracker" and kind1 == "InactiveTracker"
    assert (
        [call[0] for call in everywhere0]
        == [call[0] for call in everywhere1]
        == ["start", "config", "log", "log", "log", "finish"]
    )
    assert everywhere1[2] == ("log", {"loss": 0.0, "rank": 1}, 0, {})
    assert [call[0] for call in main0] == ["start", "config", "log", "log", "log", "finish"] and main1 == []
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["values"] for line in lines] == [{"loss": float(s), "rank": 0} for s in range(3)] + [
        {"x": 1}
    ]


# --- resuming from a checkpoint continues the step count -------------------------------------------------------------


def _train_and_log(project_dir, steps, resume):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(log_with="jsonl", project_dir=project_dir)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers("run")
    step = 0
    if resume:
        accelerator.load_state(f"{project_dir}/checkpoint")
        step = int(open(f"{project_dir}/step.txt").read())
    for step in range(step + 1, step + 1 + steps):
        loss = model(torch.ones(4, 2)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
        if step == 2 and not resume:
            accelerator.save_state(f"{project_dir}/checkpoint")
            if accelerator.is_main_process:
                open(f"{project_dir}/step.txt", "w").write(str(step))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def test_a_resumed_run_continues_its_steps_and_non_main_ranks_log_nothing(tmp_path):
    from accel.tracking import read_runs

    run_on_ranks(_train_and_log, 2, str(tmp_path), 4, False)  # steps 1-4, checkpoint at step 2
    run_on_ranks(_train_and_log, 2, str(tmp_path), 3, True)  # resumes from step 2: steps 3-5
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 3, 4, 5]  # one writer: rank 0
    (run,) = read_runs([tmp_path / "run"])
    steps = [step for step, _ in run.series["loss"]]
    assert steps == [1, 2, 3, 4, 5]  # the resumed run's values win from its first step on
    assert run.series["loss"][2][1] == records[4]["values"]["loss"]
    # The resumed run restarted from the checkpoint's weights: step 3 logs the same loss in both runs.
    assert records[2]["values"]["loss"] == pytest.approx(records[4]["values"]["loss"])


def test_tensorboard_tracker_class_contract():
    assert TensorBoardTracker.requires_logging_directory and JSONLTracker.requires_logging_directory
    assert LOGGER_TYPE_TO_CLASS["tensorboard"] is TensorBoardTracker
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TensorBoardTracker("run", "logs")  # building one writes nothing: start() does
