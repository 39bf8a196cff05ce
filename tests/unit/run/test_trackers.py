"""run.report_to: MetricsWriter's trackers beside TensorBoard. MLflow is exercised for real on a local file
store (mlflow-skinny is in the test extra), W&B for real in offline mode (wandb is in the test extra; the
test skips where it is not installed: `pip install wandb` to run it). Neither is mocked."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from dflash_train import trackers
from dflash_train.config.load import config_from_dict, load_config
from dflash_train.config.validate import validate_world
from dflash_train.errors import ConfigError
from dflash_train.run.directory import RunDir
from dflash_train.run.metrics import MetricsWriter
from dflash_train.run.reporter import Reporter
from dflash_train.run.tracker_runs import read_tracker_ids
from dflash_train.files.io import write_json_atomic
from dflash_train.trackers import TrackerPackage, tracker_unavailable
from dflash_train.train.start.directory_admission import flatten, resume_changes

PARAMS = {"optim.lr": 0.0006, "drafter.block_size": 16, "run.report_to": ["mlflow"], "drafter.target_layer_ids": None}


def train_record(step: int, loss: float) -> dict:
    return {"step": step, "epoch": step / 10, "loss": loss, "accuracy": 0.25,
            "accuracy_per_position": [0.5, None, 0.125], "lr": 1e-3, "grad_norm": None, "tokens": 100,
            "time": 1700000000.0 + step}


def validation_record(step: int, tau: float) -> dict:
    return {"step": step, "kind": "validation", "val_tau_walk": tau, "val_accuracy": 0.5, "best": True}


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir(tmp_path / "run").create()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) by step; values at one step in the order they were logged."""
    metrics = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return [(m.step, m.value) for m in metrics]


# ---------------------------------------------------------------------------- default


def test_default_writes_tensorboard_and_no_tracker(run: RunDir, clean_env) -> None:
    rep = Reporter(run, 0, True)
    try:
        rep.open_metrics()
        rep.write_metrics(train_record(1, 2.0))
    finally:
        rep.close()
    assert list(run.tensorboard.glob("events.out.tfevents.*"))
    assert not run.mlruns.exists() and not (run.root / "wandb").exists() and not run.trackers.exists()
    assert load_config(None).run.report_to == []


# ---------------------------------------------------------------------------- MLflow, for real


def test_mlflow_gets_every_record_and_a_resume_continues_its_run(run: RunDir, clean_env) -> None:
    pytest.importorskip("mlflow")
    writer = MetricsWriter(run, trackers=["mlflow"], params=PARAMS)
    writer.write(train_record(10, 2.5))
    writer.write(train_record(20, float("nan")))  # a step whose loss was not finite
    writer.write(validation_record(20, 3.25))
    writer.close()

    ids = read_tracker_ids(run)["mlflow"]
    run_id = ids["run_id"]
    assert run.mlruns.is_dir() and ids["tracking_uri"] == run.mlruns.resolve().as_uri()
    client = mlflow_client(run.mlruns.resolve().as_uri())
    loss = history(client, run_id, "loss")
    assert [s for s, _ in loss] == [10, 20] and loss[0][1] == 2.5 and math.isnan(loss[1][1])
    assert history(client, run_id, "accuracy_per_position/1") == [(10, 0.5), (20, 0.5)]
    assert history(client, run_id, "accuracy_per_position/3") == [(10, 0.125), (20, 0.125)]
    assert client.get_metric_history(run_id, "accuracy_per_position/2") == []  # nothing counted: left out
    assert history(client, run_id, "val_tau_walk") == [(20, 3.25)]
    assert history(client, run_id, "best") == [(20, 1.0)]
    assert client.get_metric_history(run_id, "step") == [] and client.get_metric_history(run_id, "grad_norm") == []
    got = client.get_run(run_id)
    assert got.data.params == {k: str(v) for k, v in PARAMS.items()}
    assert got.info.status == "FINISHED" and got.info.run_name == run.root.name
    assert client.get_experiment(got.info.experiment_id).name == "dflash-train"

    # A resume (a new process in the same run directory, a resumable key changed) continues the same run:
    # params stay those of its first sitting, new steps are appended; a step re-done after the checkpoint
    # (here 20) is a second value at that step in MLflow's append-only history.
    writer = MetricsWriter(run, trackers=["mlflow"], params={**PARAMS, "optim.max_steps": 99})
    assert client.get_run(run_id).info.status == "RUNNING"
    writer.write(train_record(20, 2.0))
    writer.write(train_record(30, 1.5))
    writer.close(failed=True)
    assert read_tracker_ids(run)["mlflow"]["run_id"] == run_id
    loss = history(client, run_id, "loss")
    assert [s for s, _ in loss] == [10, 20, 20, 30] and math.isnan(loss[1][1]) and loss[2:] == [(20, 2.0), (30, 1.5)]
    got = client.get_run(run_id)
    assert got.data.params == {k: str(v) for k, v in PARAMS.items()} and got.info.status == "FAILED"
    assert len(client.search_runs([got.info.experiment_id])) == 1


def test_mlflow_through_the_reporter_marks_a_failed_run(run: RunDir, clean_env) -> None:
    pytest.importorskip("mlflow")
    rep = Reporter(run, 0, True)
    rep.open_metrics(["mlflow"], PARAMS)
    rep.write_metrics(train_record(5, 3.0))
    rep.failed(RuntimeError("boom"))
    rep.close()
    client = mlflow_client(run.mlruns.resolve().as_uri())
    run_id = read_tracker_ids(run)["mlflow"]["run_id"]
    assert history(client, run_id, "loss") == [(5, 3.0)] and client.get_run(run_id).info.status == "FAILED"


def test_a_rank_other_than_0_reports_to_no_tracker(run: RunDir, clean_env) -> None:
    rep = Reporter(run, 1, False)
    rep.open_metrics(["mlflow"], PARAMS)
    rep.write_metrics(train_record(5, 3.0))
    rep.close()
    assert not run.mlruns.exists() and not run.trackers.exists()


def test_mlflow_honours_the_users_tracking_uri(run: RunDir, tmp_path: Path, clean_env,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    elsewhere = (tmp_path / "shared-store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "drafters")
    writer = MetricsWriter(run, tensorboard=False, trackers=["mlflow"], params=PARAMS)
    writer.write(train_record(1, 4.0))
    writer.close()
    assert not run.mlruns.exists()
    client = mlflow_client(elsewhere)
    got = client.get_run(read_tracker_ids(run)["mlflow"]["run_id"])
    assert client.get_experiment(got.info.experiment_id).name == "drafters"
    assert history(client, got.info.run_id, "loss") == [(1, 4.0)]


def test_mlflow_starts_a_new_run_when_the_recorded_one_is_gone(run: RunDir, clean_env) -> None:
    pytest.importorskip("mlflow")
    write_json_atomic(run.trackers, {"mlflow": {"run_id": "0123456789abcdef0123456789abcdef"}})
    writer = MetricsWriter(run, tensorboard=False, trackers=["mlflow"], params=PARAMS)
    writer.close()
    run_id = read_tracker_ids(run)["mlflow"]["run_id"]
    assert run_id != "0123456789abcdef0123456789abcdef"
    assert mlflow_client(run.mlruns.resolve().as_uri()).get_run(run_id).data.params["optim.lr"] == "0.0006"


# ---------------------------------------------------------------------------- W&B offline, for real


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (run-ID.wandb): a 7-byte header (":W&B", magic, version), then
    32 KiB blocks of chunks (crc32c: 4 bytes, length: 2, type: 1 = full, 2 = first, 3 = middle, 4 = last),
    the tail of a block too short for a chunk header left as padding. Each record is a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data, records, pos, pending = path.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_gets_every_record_and_a_resume_continues_its_run(run: RunDir, clean_env) -> None:
    pytest.importorskip("wandb")
    writer = MetricsWriter(run, tensorboard=False, trackers=["wandb"], params=PARAMS)
    writer.write(train_record(10, 2.5))
    writer.write(validation_record(10, 3.25))
    writer.close()
    run_id = read_tracker_ids(run)["wandb"]["id"]
    time.sleep(1.0)  # W&B names a sitting's directory by its start time in seconds (a real resume takes longer)
    writer = MetricsWriter(run, tensorboard=False, trackers=["wandb"], params={**PARAMS, "optim.max_steps": 99})
    writer.write(train_record(20, 1.5))
    writer.close()
    assert read_tracker_ids(run)["wandb"]["id"] == run_id

    sittings = sorted((run.root / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(sittings) == 2  # one offline directory per sitting, one run id: `wandb sync` joins them
    logged: dict[str, list[tuple[int, float]]] = {}
    configs = []
    for sitting in sittings:
        for record in wandb_records(sitting / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id and record.run.project == "dflash-train"
                configs.append({i.key: json.loads(i.value_json) for i in record.run.config.update if i.key != "_wandb"})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key, value in items.items():
                    if not key.startswith("_"):
                        logged.setdefault(key, []).append((record.history.step.num, value))
    assert configs[0] == PARAMS and configs[1] == {}  # the params once per tracker run
    assert logged["loss"] == [(10, 2.5), (20, 1.5)]
    assert logged["accuracy_per_position/3"] == [(10, 0.125), (20, 0.125)]
    assert logged["val_tau_walk"] == [(10, 3.25)]
    assert "accuracy_per_position/2" not in logged and "step" not in logged


# ---------------------------------------------------------------------------- config


def test_report_to_accepts_the_trackers_and_refuses_anything_else() -> None:
    assert load_config(None, ["run.report_to=[mlflow, wandb]"]).run.report_to == ["mlflow", "wandb"]
    with pytest.raises(ConfigError, match=r"'run.report_to'.*'tensorboard' is not a tracker; valid: wandb, mlflow"):
        load_config(None, ["run.report_to=[tensorboard]"])
    with pytest.raises(ConfigError, match=r"'run.report_to': lists a tracker twice"):
        config_from_dict({"run": {"report_to": ["mlflow", "mlflow"]}})
    with pytest.raises(ConfigError, match=r"'run.report_to': expected list\[str\]"):
        config_from_dict({"run": {"report_to": "mlflow"}})


def test_a_tracker_whose_package_is_missing_fails_the_start_saying_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    why = tracker_unavailable("mlflow", module="dflash_train_no_such_package")
    assert why is not None and "\n" not in why
    assert "'run.report_to'" in why and "`pip install mlflow-skinny`" in why and "ModuleNotFoundError" in why
    assert "`pip install wandb`" in tracker_unavailable("wandb", module="dflash_train_no_such_package")
    cfg = load_config(None, ["run.report_to=[wandb]"])  # the run's own config.yaml still loads (a resume may drop it)
    monkeypatch.setitem(trackers.TRACKERS, "wandb", TrackerPackage("dflash_train_no_such_package", "pip install wandb"))
    with pytest.raises(ConfigError, match=r"'run.report_to': lists 'wandb'.*`pip install wandb`"):
        validate_world(cfg, 1)  # at start-up, before any model loads


def test_mlflow_that_is_installed_passes_the_start_check() -> None:
    pytest.importorskip("mlflow")
    assert tracker_unavailable("mlflow") is None
    validate_world(load_config(None, ["run.report_to=[mlflow]"]), 1)


def test_report_to_is_resumable(tmp_path: Path) -> None:
    recorded = load_config(None, ["run.report_to=[wandb]"])
    asked = load_config(None, ["run.report_to=[]"])
    changes = resume_changes(recorded, asked, RunDir(tmp_path), None, ["run.report_to=[]"], None)
    assert changes == {"run.report_to": (["wandb"], [])}
    assert flatten(asked)["run.report_to"] == []


# ---------------------------------------------------------------------------- through `train`


def test_a_cpu_run_and_its_resume_report_to_one_mlflow_run(tmp_path: Path, tiny_target_dir, counting_jsonl,
                                                            clean_env) -> None:
    pytest.importorskip("mlflow")
    import yaml

    from dflash_train.cli import main

    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 1024, "max_batch_size": 4},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10},
        "run": {"device": "cpu", "log_every": 5, "save_every": 5, "eval_every": 0, "progress_bar": False,
                "report_to": ["mlflow"]},
    }
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    run = RunDir(tmp_path / "R")
    assert main(["train", str(tmp_path / "tiny.yaml"), "--run-dir", str(run.root), "--max-steps", "10"]) == 0
    run_id = read_tracker_ids(run)["mlflow"]["run_id"]
    assert main(["train", "--resume", "--run-dir", str(run.root), "optim.max_steps=15"]) == 0
    assert read_tracker_ids(run)["mlflow"]["run_id"] == run_id
    client = mlflow_client(run.mlruns.resolve().as_uri())
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.params["optim.max_steps"] == "10"  # params of the first sitting
    assert got.data.params["run.report_to"] == "['mlflow']" and got.data.params["objective.gamma"] == "4.0"
    assert [s for s, _ in history(client, run_id, "loss")] == [5, 10, 15]
    assert [s for s, _ in history(client, run_id, "accuracy_per_position/3")] == [5, 10, 15]


def test_train_with_a_tracker_it_cannot_import_stops_before_anything_starts(
        tmp_path: Path, tiny_target_dir, counting_jsonl, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import yaml

    from dflash_train.cli import main

    monkeypatch.setitem(trackers.TRACKERS, "wandb", TrackerPackage("dflash_train_no_such_package", "pip install wandb"))
    cfg = {"target": {"path": str(tiny_target_dir)}, "data": {"train_files": [str(counting_jsonl)]},
           "run": {"device": "cpu", "report_to": ["wandb"]}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "tiny.yaml"), "--run-dir", str(tmp_path / "R")]) == 2
    assert "`pip install wandb`" in capsys.readouterr().err and not (tmp_path / "R").exists()
