"""The runs of the experiment trackers `run.report_to` names (MLflow, W&B), continued across resumes through
trackers.json. Which names are valid and whether a tracker's package can run here: the top-level trackers.py."""

from __future__ import annotations

import json
import logging
import os
import secrets
import string
import time
from typing import Any, Optional, Protocol
from urllib.parse import urlparse

from ..files.io import write_json_atomic
from ..trackers import TRACKERS
from .directory import RunDir

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """One experiment tracker's run, continued across resumes: it takes every metrics record's scalars."""

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def read_tracker_ids(run: RunDir) -> dict[str, dict[str, Any]]:
    """trackers.json: {tracker: {what identifies its run}}; empty when there is none (or it is unreadable)."""
    try:
        data = json.loads(run.trackers.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_tracker_id(run: RunDir, name: str, entry: dict[str, Any]) -> None:
    ids = read_tracker_ids(run)
    ids[name] = entry
    write_json_atomic(run.trackers, ids)


def open_tracker(name: str, run: RunDir, params: dict[str, Any]) -> Tracker:
    if name == "mlflow":
        return MlflowTracker(run, params)
    if name == "wandb":
        return WandbTracker(run, params)
    raise ValueError(f"unknown tracker {name!r} (valid: {', '.join(TRACKERS)})")


class MlflowTracker:
    """An MLflow run through MlflowClient (explicit run id, no fluent global state). The tracking URI is
    MLFLOW_TRACKING_URI when set, else a local file store in RUN/mlruns; the experiment is
    MLFLOW_EXPERIMENT_NAME or "dflash-train", the run is named after the run directory."""

    def __init__(self, run: RunDir, params: dict[str, Any]):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or run.mlruns.resolve().as_uri()
        if _is_file_store(self.uri):
            # MLflow 3 keeps its file store in maintenance mode and refuses to open one without this opt-in;
            # it needs no database (the sqlite store needs sqlalchemy and alembic, which mlflow-skinny lacks).
            # Set for this process only, and only for a file store; a value the user set is kept.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.uri)
        known = read_tracker_ids(run).get("mlflow", {}).get("run_id")
        self.run_id: Optional[str] = None
        if known:
            try:
                active = self.client.get_run(known).info.lifecycle_stage == "active"
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                active = False
            if active:
                self.run_id = known
                self.client.update_run(known, status="RUNNING")
            else:
                log.warning("MLflow run %s of %s is not in %s (or was deleted); starting a new MLflow run",
                            known, run.trackers, self.uri)
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dflash-train"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            created = self.client.create_run(experiment_id, run_name=run.root.name,
                                             tags={"dflash_train.run_dir": str(run.root.resolve())})
            self.run_id = created.info.run_id
            _save_tracker_id(run, "mlflow", {"run_id": self.run_id, "experiment_id": experiment_id,
                                             "tracking_uri": self.uri})
            items = [Param(k, str(v)) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _is_file_store(uri: str) -> bool:
    """A local path or file: URI (a bare name such as "databricks" also passes: the opt-in is then unused)."""
    return urlparse(uri).scheme in ("", "file")


class WandbTracker:
    """A Weights & Biases run, offline unless WANDB_MODE says otherwise: it writes RUN/wandb/offline-run-*/
    and needs no network or account (`wandb sync RUN/wandb/offline-run-*` uploads it later). The project
    is WANDB_PROJECT or "dflash-train"; the run id is kept in trackers.json, so a resume logs into the
    same run (each sitting writes its own offline-run-* directory under that id)."""

    def __init__(self, run: RunDir, params: dict[str, Any]):
        import wandb

        run_id = read_tracker_ids(run).get("wandb", {}).get("id")
        fresh = run_id is None
        if fresh:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "dflash-train",
            name=run.root.name,
            id=run_id,
            resume="allow",
            dir=str(run.root),
            mode=os.environ.get("WANDB_MODE") or "offline",
            config=params if fresh else None,  # the params once per tracker run
            settings=wandb.Settings(console="off", silent=True),  # leave the trainer's stdout/stderr alone
        )
        if fresh:
            _save_tracker_id(run, "wandb", {"id": run_id})

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before W&B's service process has written the run's file (offline, on a busy
        # machine: an empty run-ID.wandb for a while); teardown waits for it, so the run is on disk when
        # close returns. W&B's own atexit teardown is, by its docs, unreliable in multi-process programs.
        wandb.teardown()
