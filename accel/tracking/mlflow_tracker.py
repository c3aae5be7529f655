"""MLflow: an experiment named after the project, one run, metrics with steps, parameters from the config."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from accel.env_vars import parse_bool
from accel.tracking.base import GeneralTracker, SkipWarner, as_number, on_main_process, plain_config


class MLflowTracker(GeneralTracker):
    """Logs to MLflow (the tracking URI is MLflow's own setting: `MLFLOW_TRACKING_URI`, or `mlflow.set_tracking_uri`).

    Args:
        experiment_name: the experiment (the Accelerator passes the project name). `MLFLOW_EXPERIMENT_NAME` wins.
        logging_dir: the artifact location of an experiment this creates.
        run_id: continue this run instead of starting one. `MLFLOW_RUN_ID` wins.
        tags: tags of the experiment and the run, a dict or its JSON text. `MLFLOW_TAGS` wins.
        nested_run: start the run nested in the active one. `MLFLOW_NESTED_RUN` wins.
        run_name: the new run's name.
        description: the run's description.

    Only numbers are metrics; anything else is skipped with one warning naming the key. Nested configuration is
    flattened into parameters ("optimizer/lr"), values longer than MLflow allows are dropped with a warning.
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | None = False,
        run_name: str | None = None,
        description: str | None = None,
    ):
        super().__init__()
        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested_run = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = logging_dir
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = parse_bool(nested_run, "MLFLOW_NESTED_RUN") if isinstance(nested_run, str) else nested_run
        self.run_name = run_name
        self.description = description
        self.skipped = SkipWarner(self.name)

    @on_main_process
    def start(self) -> None:
        import mlflow

        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=self._experiment_id(mlflow),
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    def _experiment_id(self, mlflow: Any) -> str:
        found = mlflow.search_experiments(filter_string=f"name = '{self.experiment_name}'")
        if len(found) > 1:
            warnings.warn(f"{len(found)} MLflow experiments are named {self.experiment_name!r}; using the first")
        if found:
            return found[0].experiment_id
        return mlflow.create_experiment(name=self.experiment_name, artifact_location=self.logging_dir, tags=self.tags)

    @property
    def tracker(self) -> Any:
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Logs `values` as run parameters, in batches of the most MLflow takes at once."""
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {}
        for key, value in plain_config(values).items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                warnings.warn(f"MLflow parameters hold at most {MAX_PARAM_VAL_LENGTH} characters: {key!r} not logged")
            else:
                params[key] = value
        items = list(params.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start : start + MAX_PARAMS_TAGS_PER_BATCH]))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Logs the numbers of `values` as metrics at `step`; `kwargs` go to `mlflow.log_metrics`."""
        import mlflow

        metrics = {}
        for key, value in values.items():
            number = as_number(value)
            if number is None:
                self.skipped.skip(key, value)
            else:
                metrics[key] = number
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Logs a matplotlib or plotly figure as the artifact `artifact_file`."""
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Logs every file of `local_dir` as artifacts (under `artifact_path`)."""
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Logs the file `local_path` as an artifact (under `artifact_path`)."""
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        import mlflow

        mlflow.end_run()
