"""Several nodes for real: two torchrun agents ("nodes") of two gloo ranks each on this machine, c10d rendezvous on
localhost, one shared run directory. They train what four local ranks train, and `status`, `stop` and `--resume`
work across them, as README's multi-node section says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _harness import ENV, assert_same_losses, losses, wait_for_step, write_config

from dflash_train.cli import main
from dflash_train.train.processes.launch import free_port

pytestmark = pytest.mark.long

STEPS = 12


def _node(node_rank: int, port: int, args: list[str], log: Path) -> subprocess.Popen:
    """One torchrun agent: 2 local ranks, the whole job 2 nodes x 2 ranks, rendezvous at localhost:`port`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "dflash-multinode-test", "--max-restarts", "0", "-m", "dflash_train", "train", *args]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV)


def _two_nodes(args: list[str], root: Path, tag: str) -> list[subprocess.Popen]:
    port = free_port()
    return [_node(i, port, args, root / f"{tag}-node{i}.log") for i in range(2)]


def _wait(nodes: list[subprocess.Popen], root: Path, tag: str, timeout: float = 300) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        for i in range(2):
            log = root / f"{tag}-node{i}.log"
            if log.is_file():
                sys.stderr.write(f"--- {log.name} (tail)\n" + log.read_text()[-3000:])


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir, counting_jsonl):
    root = tmp_path_factory.mktemp("multinode")
    return root, write_config(root / "c.yaml", tiny_target_dir, counting_jsonl)


@pytest.fixture(scope="module")
def four_local_ranks(setup):
    root, cfg = setup
    run = root / "local4"
    assert main(["train", str(cfg), "--run-dir", str(run), "--max-steps", str(STEPS), "--nproc", "4"]) == 0
    return losses(run)


def test_two_nodes_of_two_ranks_train_what_four_local_ranks_do(setup, four_local_ranks, capsys):
    root, cfg = setup
    run = root / "nodes"
    nodes = _two_nodes([str(cfg), "--run-dir", str(run), "--max-steps", str(STEPS)], root, "plain")
    assert _wait(nodes, root, "plain") == [0, 0]
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "done" and status["world_size"] == 4 and status["step"] == STEPS
    assert_same_losses(four_local_ranks, losses(run), STEPS)
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert all(f"rank {r}: colocated done" in out for r in range(4)), out
    assert (run / "export" / "model.safetensors").is_file()


def test_stop_and_resume_work_across_two_nodes(setup, four_local_ranks, capsys):
    root, cfg = setup
    run = root / "stopped"
    args = [str(cfg), "--run-dir", str(run), "--max-steps", str(STEPS)]
    nodes = _two_nodes(args, root, "stop")
    beat = wait_for_step(run, 3, 3, nodes[1])  # a rank of the second node is training
    assert beat["phase"] == "training"
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    assert "rank 3: colocated training" in capsys.readouterr().out
    assert main(["stop", str(run)]) == 0
    codes = _wait(nodes, root, "stop")
    assert all(c != 0 for c in codes), codes  # torchrun reports the ranks' "stopped before done" (3) as a failure
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "stopped" and status["step"] < STEPS, status
    assert (Path(status["checkpoint"]) / "trainer_state.json").is_file()
    nodes = _two_nodes([*args, "--resume"], root, "resume")
    assert _wait(nodes, root, "resume") == [0, 0]
    assert json.loads((run / "status.json").read_text())["phase"] == "done"
    assert_same_losses(four_local_ranks, losses(run), STEPS)
