"""The backends with their real packages, offline, each read back with the package's own reader: TensorBoard (event
files), MLflow (a local file store), wandb (offline mode) and accel's jsonl files. A backend whose package is not
installed is skipped."""

import glob
import json
import math
import struct
import warnings

import numpy as np
import pytest
import torch

from accel import Accelerator

CONFIG = {"lr": 0.01, "batch_size": 8, "optimizer": {"name": "adamw", "eps": 1e-8}, "amp": True, "resume": None}
# What each step logs: a float, a numpy scalar, a 0-d tensor, text, and a value no scalar backend takes.
STEPS = [
    (
        step,
        {
            "loss": 1.0 / (step + 1),
            "acc": np.float32(0.5 + step / 10),
            "grad_norm": torch.tensor(2.0 * step),
            "phase": "warmup" if step < 2 else "main",
            "sample": [1, 2, 3],
        },
    )
    for step in range(4)
]


def _log_steps(accelerator):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, values in STEPS:
            accelerator.log(values, step=step)
    return [str(warning.message) for warning in caught]


def _expected(name):
    return [float(values[name]) for _, values in STEPS]


# --- TensorBoard ----------------------------------------------------------------------------------------------------


def test_tensorboard_event_files_hold_every_scalar_text_and_the_hparams(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tensorboard.plugins.hparams import plugin_data_pb2

    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run", config=CONFIG)
    messages = _log_steps(accelerator)
    accelerator.log({"eval": {"loss": 0.25, "acc": 0.75}}, step=4)
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    accelerator.end_training()

    assert type(writer).__name__ == "SummaryWriter"
    events = event_accumulator.EventAccumulator(
        str(tmp_path / "run"), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    events.Reload()
    for name in ("loss", "acc", "grad_norm"):
        logged = events.Scalars(name)
        assert [event.step for event in logged] == [0, 1, 2, 3]
        assert [event.value for event in logged] == pytest.approx(_expected(name), rel=1e-6)  # stored as float32
    assert [event.step for event in events.Tensors("phase/text_summary")] == [0, 1, 2, 3]
    assert [m for m in messages if "sample" in m] == [
        "tensorboard cannot log 'sample' (a list; it takes numbers, text or a dict of numbers): skipped, "
        "and skipped without this warning from now on"
    ]
    group = event_accumulator.EventAccumulator(str(tmp_path / "run" / "eval_loss"))
    group.Reload()
    assert [(event.step, event.value) for event in group.Scalars("eval")] == [(4, 0.25)]

    (hparams_dir,) = [path for path in (tmp_path / "run").iterdir() if (path / "hparams.yml").exists()]
    hparams_events = event_accumulator.EventAccumulator(str(hparams_dir))
    hparams_events.Reload()
    content = hparams_events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    stored = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert stored["lr"].number_value == pytest.approx(0.01) and stored["batch_size"].number_value == 8
    assert stored["optimizer/name"].string_value == "adamw" and stored["optimizer/eps"].number_value == 1e-8
    assert stored["amp"].number_value == 1 and "resume" not in stored  # torch stores bools as numbers; None not at all
    assert "optimizer/name: adamw" in (hparams_dir / "hparams.yml").read_text()


# --- MLflow ---------------------------------------------------------------------------------------------------------


def test_mlflow_run_holds_metrics_by_step_and_flattened_params(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 wants a database; a folder keeps this test fast
    accelerator = Accelerator(log_with="mlflow")
    accelerator.init_trackers("experiment", config=CONFIG, init_kwargs={"mlflow": {"run_name": "first"}})
    messages = _log_steps(accelerator)
    accelerator.end_training()

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("experiment").experiment_id])
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert run.data.params == {
        "lr": "0.01",
        "batch_size": "8",
        "optimizer/name": "adamw",
        "optimizer/eps": "1e-08",
        "amp": "True",
        "resume": "None",
    }
    for name in ("loss", "acc", "grad_norm"):
        history = client.get_metric_history(run.info.run_id, name)
        assert [m.step for m in history] == [0, 1, 2, 3]
        assert [m.value for m in history] == pytest.approx(_expected(name), rel=1e-6)
    assert sorted(m.split(" (")[0] for m in messages if "mlflow cannot log" in m) == [
        "mlflow cannot log 'phase'",
        "mlflow cannot log 'sample'",
    ]  # one warning per key, not per step


# --- wandb ----------------------------------------------------------------------------------------------------------


def _wandb_records(path):
    """The protobuf records of an offline run file (a LevelDB-style log of 32 KiB blocks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, position, payload, records = open(path, "rb").read(), 7, b"", []
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a record header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        payload += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            records.append(wandb_internal_pb2.Record.FromString(payload))
            payload = b""
    return records


def _key(item):
    return item.key or "/".join(item.nested_key)  # wandb writes some keys as a one-element path


def test_wandb_offline_run_file_holds_config_and_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
    }.items():
        monkeypatch.setenv(name, value)
    accelerator = Accelerator(log_with="wandb")
    try:
        accelerator.init_trackers("project", config=CONFIG, init_kwargs={"wandb": {"name": "first"}})
        accelerator.log({"loss": 0.5, "phase": "warmup"}, step=0)
        accelerator.log({"loss": 0.25, "grad_norm": torch.tensor(2.0)}, step=1)
        run = accelerator.get_tracker("wandb", unwrap=True)
        assert (
            run.project == "project"
            and run.name == "first"
            and run.config["optimizer"] == {"name": "adamw", "eps": 1e-8}
        )
        accelerator.end_training()
    finally:
        wandb.teardown()  # the wandb service process must not outlive the test

    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = _wandb_records(path)
    config = {
        _key(item): json.loads(item.value_json)
        for record in records
        if record.HasField("config")
        for item in record.config.update
    }
    assert config["lr"] == 0.01 and config["optimizer"] == {"name": "adamw", "eps": 1e-8}
    history = [
        {_key(item): json.loads(item.value_json) for item in record.history.item}
        for record in records
        if record.HasField("history")
    ]
    assert [(row["_step"], row["loss"]) for row in history] == [(0, 0.5), (1, 0.25)]
    assert history[0]["phase"] == "warmup" and history[1]["grad_norm"] == 2.0


# --- jsonl ----------------------------------------------------------------------------------------------------------


def test_jsonl_writes_one_flushed_line_per_log_call(tmp_path):
    accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    accelerator.init_trackers("run", config=CONFIG)
    path = tmp_path / "run" / "metrics.jsonl"
    accelerator.log({"loss": 1.5}, step=0)
    assert json.loads(path.read_text())["values"] == {"loss": 1.5}  # readable before the run ends
    messages = _log_steps(accelerator)
    with pytest.warns(UserWarning, match="jsonl cannot log 'eval/img' \\(a object"):
        accelerator.log({"loss": float("nan"), "eval": {"acc": 0.5, "img": object()}})
    accelerator.end_training()

    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [record["step"] for record in records] == [0, 0, 1, 2, 3, None]
    assert records[3]["values"] == {"loss": 1 / 3, "acc": pytest.approx(0.7), "grad_norm": 4.0, "phase": "main"}
    assert type(records[3]["values"]["acc"]) is float  # a numpy float32 became a JSON number
    assert math.isnan(records[-1]["values"]["loss"]) and records[-1]["values"]["eval"] == {"acc": 0.5}
    assert [m.split(" (")[0] for m in messages] == ["jsonl cannot log 'sample'"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["optimizer/eps"] == 1e-8


def test_jsonl_appends_when_a_run_starts_again_in_the_same_folder(tmp_path):
    for step in (1, 2):
        accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
        accelerator.init_trackers("run")
        accelerator.log({"loss": float(step)}, step=step)
        accelerator.end_training()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
