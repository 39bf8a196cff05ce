"""The run directory contract: config.yaml, train.log, metrics.jsonl, status.json, heartbeats/, STOP,
checkpoints/, tensorboard/, export/ (and, with run.report_to, trackers.json, mlruns/, wandb/).

directory.py names the files and the phases; status.py writes status.json and the heartbeats and answers
`dflash-train status` (`read_status`, `format_status`, and `liveness`: is the process behind a run still
there); metrics.py writes metrics.jsonl and TensorBoard; tracker_runs.py the trackers' runs of run.report_to;
reporter.py is one rank's voice over all of them."""
