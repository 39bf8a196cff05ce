"""The run directory's own files: train.log and metrics.jsonl rotate into bounded parts that readers follow, and a
resume truncates the metrics past its step."""

import json


def test_train_log_rotates_and_stays_bounded(tmp_path, monkeypatch):
    import logging

    from dflash_train.run.directory import RunDir

    monkeypatch.setattr(RunDir, "log_max_bytes", 4096)
    run = RunDir(tmp_path / "r").create()
    handler = run.attach_log()
    logger = logging.getLogger("dflash_train.test")
    logger.setLevel(logging.INFO)
    try:
        for i in range(2000):  # ~150 KB of log lines
            logger.info("step %d loss %.4f and some text to make the line longer", i, 1.0 / (i + 1))
    finally:
        logging.getLogger("dflash_train").removeHandler(handler)
        handler.close()
    parts = sorted(p.name for p in run.root.glob("train.log*"))
    assert parts == ["train.log", "train.log.1", "train.log.2", "train.log.3"]
    assert all((run.root / p).stat().st_size <= 4096 + 200 for p in parts)
    assert "step 1999 " in run.log.read_text()  # the newest lines are in train.log


def test_metrics_rotate_into_parts_that_readers_follow_and_resume_truncates(tmp_path, monkeypatch):
    from dflash_train.run.directory import RunDir
    from dflash_train.run.metrics import MetricsWriter, metrics_parts, read_metrics, truncate_metrics
    from dflash_train.run.status import read_status

    monkeypatch.setattr(MetricsWriter, "max_bytes", 2048)
    run = RunDir(tmp_path / "r").create()
    (run.root / "status.json").write_text(json.dumps({"phase": "training", "step": 0}))
    writer = MetricsWriter(run, tensorboard=True)
    try:
        for step in range(1, 201):
            writer.write({"step": step, "loss": 10.0 / step, "accuracy": 0.5, "note": "x" * 40})
    finally:
        writer.close()
    parts = metrics_parts(run.root)
    assert len(parts) > 5 and parts[-1].name == "metrics.jsonl" and parts[0].name == "metrics-00001.jsonl"
    assert all(p.stat().st_size <= 2048 + 200 for p in parts)
    assert [r["step"] for r in read_metrics(run.root)] == list(range(1, 201))  # nothing lost, in order
    assert read_status(run.root)[1]["step"] == 200
    assert len(list(run.tensorboard.glob("events.out.tfevents.*"))) >= 2  # TensorBoard rotated too

    # a resume from step 57 drops the killed run's later records, across parts, and removes emptied parts
    with open(parts[-1], "a") as f:
        f.write('{"step": 201, "lo')  # a torn line from the kill
    truncate_metrics(run.metrics, 57)
    assert [r["step"] for r in read_metrics(run.root)] == list(range(1, 58))
    assert all(p.stat().st_size > 0 for p in metrics_parts(run.root) if p.name != "metrics.jsonl")
    assert read_status(run.root)[1]["step"] == 57
