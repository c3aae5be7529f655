"""Reading runs back (jsonl, TensorBoard), `accel plot` and its parser, and the HF-style tracking example under a real
`accel launch --cpu --num_processes 2`."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel.cli import plot as plot_command
from accel.tracking import Run, plot_runs, read_runs
from accel.tracking.plot import smoothed

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(folder, records, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, values in records:
            f.write(json.dumps({"step": step, "time": 0.0, "values": values}) + "\n")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def parse(*argv):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    plot_command.register(parser.add_subparsers())
    return parser.parse_args(["plot", *argv])


# --- reading runs ---------------------------------------------------------------------------------------------------


def test_read_jsonl_run_flattens_groups_and_keeps_numbers_only(tmp_path):
    write_run(
        tmp_path / "run",
        [(0, {"loss": 2.0, "note": "x", "eval": {"acc": 0.5}, "flag": True}), (1, {"loss": 1.0})],
        config={"lr": 0.1},
    )
    (run,) = read_runs([tmp_path / "run"])
    assert run.name == "run" and run.config == {"lr": 0.1} and run.torn_lines == 0
    assert run.series == {"loss": [(0.0, 2.0), (1.0, 1.0)], "eval/acc": [(0.0, 0.5)]}


def test_a_torn_last_line_is_skipped_and_counted(tmp_path):
    folder = write_run(tmp_path / "run", [(0, {"loss": 2.0}), (1, {"loss": 1.0})])
    with open(folder / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "time": 0.0, "values": {"lo')  # the process was killed mid-line
    (run,) = read_runs([folder])
    assert run.series["loss"] == [(0.0, 2.0), (1.0, 1.0)] and run.torn_lines == 1


def test_steps_going_back_mean_a_resumed_run_whose_values_win(tmp_path):
    folder = write_run(
        tmp_path / "run",
        [
            (1, {"loss": 4.0}),
            (2, {"loss": 3.0}),
            (3, {"loss": 2.9}),
            (2, {"loss": 3.0}),
            (3, {"loss": 2.0}),
            (None, {"loss": 1.0}),
        ],
    )
    (run,) = read_runs([folder])
    assert run.series["loss"] == [(1.0, 4.0), (2.0, 3.0), (3.0, 2.0), (4.0, 1.0)]  # no step: one after the last


def test_a_project_folder_yields_each_run_once_preferring_jsonl(tmp_path):
    write_run(tmp_path / "logs" / "b", [(0, {"loss": 1.0})])
    write_run(tmp_path / "logs" / "a", [(0, {"loss": 2.0})])
    (tmp_path / "logs" / "a" / "events.out.tfevents.1.host.1.0").write_bytes(b"")  # TensorBoard's copy of run a
    runs = read_runs([tmp_path / "logs"])
    assert [(run.name, run.series["loss"][0][1]) for run in runs] == [("logs/a", 2.0), ("logs/b", 1.0)]


def test_read_runs_names_a_missing_path_and_an_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope: no such file or folder"):
        read_runs([tmp_path / "nope"])
    with pytest.raises(FileNotFoundError, match="no logged run here"):
        read_runs([tmp_path])


def test_tensorboard_event_files_are_read_with_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "tb")) as writer:
        for step in range(3):
            writer.add_scalar("loss", 1.0 / (step + 1), global_step=step)
    (run,) = read_runs([tmp_path / "tb"])
    assert [step for step, _ in run.series["loss"]] == [0, 1, 2]
    assert [value for _, value in run.series["loss"]] == pytest.approx([1.0, 0.5, 1 / 3])


# --- drawing --------------------------------------------------------------------------------------------------------


def test_smoothing_is_tensorboards_debiased_moving_average():
    assert smoothed([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no pull towards 0
    assert smoothed([0.0, 10.0], 0.5) == pytest.approx([0.0, 5.0 / 0.75])


def test_plot_runs_writes_a_png_with_one_panel_per_metric(tmp_path):
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path / "a", [(s, {"loss": 1 / (s + 1), "acc": s / 10}) for s in range(20)])
    b = write_run(tmp_path / "b", [(s, {"loss": 2 / (s + 1), "nan": float("nan")}) for s in range(20)])
    drawn = plot_runs([a, b], tmp_path / "out.png", smoothing=0.5, title="two runs")
    assert drawn == ["loss", "acc"]  # first-logged order; a metric that is never finite is not drawn
    assert (tmp_path / "out.png").read_bytes().startswith(PNG_SIGNATURE)
    assert plot_runs(
        [Run("x", "x", {"eval/acc": [(0, 1.0)], "loss": [(0, 1.0)]})], tmp_path / "e.png", metrics=["eval/*"]
    ) == ["eval/acc"]


def test_plot_runs_rejects_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    run = Run("x", "x", {"loss": [(0, 1.0)]})
    with pytest.raises(ValueError, match=r"no logged scalar matching \['acc'\] to draw .*metrics found: \['loss'\]"):
        plot_runs([run], tmp_path / "out.png", metrics=["acc"])
    with pytest.raises(ValueError, match="smoothing must be in"):
        plot_runs([run], tmp_path / "out.png", smoothing=1.0)


def test_plot_without_matplotlib_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"accel plot needs matplotlib: pip install matplotlib"):
        plot_runs([Run("x", "x", {"loss": [(0, 1.0)]})], tmp_path / "out.png")


def test_cli_parser_and_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "logs" / "run", [(s, {"loss": 1 / (s + 1)}) for s in range(5)])
    args = parse(str(tmp_path / "logs"), "-o", str(tmp_path / "p.png"), "--metrics", "loss", "--smoothing", "0.3")
    assert args.run_dirs == [str(tmp_path / "logs")] and args.metrics == ["loss"] and args.smoothing == 0.3
    assert args.run(args) == 0
    assert capsys.readouterr().out == f"accel plot: 1 metric(s) of 1 run(s) -> {tmp_path / 'p.png'}\n"
    bad = parse(str(tmp_path / "missing"))
    assert bad.run(bad) == 1 and "missing: no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse()  # at least one RUN_DIR


# --- the HF-style example under accel launch -------------------------------------------------------------------------


@pytest.mark.slow
def test_tracking_example_on_two_processes_logs_once_and_plots(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("matplotlib")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), TMPDIR=str(tmp_path))
    if "ACCEL_DISABLE_NATIVE" in os.environ:
        env["ACCEL_DISABLE_NATIVE"] = os.environ["ACCEL_DISABLE_NATIVE"]
    launch = [
        sys.executable,
        "-m",
        "accel",
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        str(REPO / "examples" / "tracking.py"),
        "--with_tracking",
        "--log_with",
        "tensorboard,jsonl",
        "--project_dir",
        "logs",
        "--num_epochs",
        "2",
    ]
    result = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    printed = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(printed) == 2  # accelerator.print: the main process only

    records = [json.loads(line) for line in (tmp_path / "logs" / "tracking" / "metrics.jsonl").read_text().splitlines()]
    events = event_accumulator.EventAccumulator(str(tmp_path / "logs" / "tracking"), size_guidance={"scalars": 0})
    events.Reload()
    for name in ("train_loss", "lr", "accuracy", "eval_loss", "epoch"):
        logged = [(record["step"], record["values"][name]) for record in records if name in record["values"]]
        assert [(event.step, event.value) for event in events.Scalars(name)] == [
            (step, pytest.approx(value, rel=1e-6)) for step, value in logged
        ]
    epochs = [record["values"] for record in records if "accuracy" in record["values"]]
    assert printed[-1] == f"epoch 1: accuracy {epochs[-1]['accuracy']:.4f}, eval loss {epochs[-1]['eval_loss']:.4f}"
    assert [record["step"] for record in records if "train_loss" in record["values"]] == list(range(4, 65, 4))
    assert len(list((tmp_path / "logs" / "tracking").glob("events.out.tfevents.*"))) == 1  # one writer: rank 0
    assert json.loads((tmp_path / "logs" / "tracking" / "config.json").read_text())["batch_size"] == 32

    plotted = subprocess.run(
        [sys.executable, "-m", "accel", "plot", "logs", "-o", "curves.png"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plotted.returncode == 0, plotted.stderr
    assert "5 metric(s) of 1 run(s) -> curves.png" in plotted.stdout
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
