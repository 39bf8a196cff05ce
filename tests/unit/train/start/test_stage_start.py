"""The on-policy stage as a run: it starts from a finished run's export, trains with Draft-OPD's objective and logs
its terms, exports, and resumes exactly; a start that cannot be this stage's is refused before any model loads,
naming the key."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from _harness import launch, losses, wait_for_step

from dflash_train.architectures.io import load_drafter
from dflash_train.cli import main


def config(tmp_path, tiny_target_dir, counting_jsonl, **sections) -> str:
    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.1, "max_steps": 8},
        "run": {"device": "cpu", "log_every": 1, "save_every": 3, "progress_bar": False, "eval_every": 0,
                "export_dtype": "float32"},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = tmp_path / f"c{len(list(tmp_path.glob('c*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_target_dir, counting_jsonl):
    tmp = tmp_path_factory.mktemp("sft")
    assert main(["train", config(tmp, tiny_target_dir, counting_jsonl), "--run-dir", str(tmp / "run")]) == 0
    return tmp / "run"


def records(run):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_the_stage_starts_from_the_export_trains_with_its_terms_and_exports(finished, tiny_target_dir, counting_jsonl,
                                                                            tmp_path, caplog):
    caplog.set_level("INFO")
    cfg = config(tmp_path, tiny_target_dir, counting_jsonl, onpolicy={"start_from": str(finished)},
                 data={"val_files": [str(counting_jsonl)]}, run={"eval_every": 4})
    assert main(["train", cfg, "--run-dir", str(tmp_path / "S")]) == 0
    every = [json.loads(line) for line in (tmp_path / "S" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in every if "val_loss" in r] == [4, 8]  # validation runs the stage's objective
    steps = records(tmp_path / "S")
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all("onpolicy_committed_loss" in r and "onpolicy_rejected_loss" in r for r in steps)
    assert all(r["loss"] == r["loss"] for r in steps)
    start = load_drafter(finished / "export")
    stage = load_drafter(tmp_path / "S" / "export")
    assert any(not torch.equal(t, stage.state_dict()[k]) for k, t in start.state_dict().items())
    log = caplog.text
    assert f"the drafter starts from {finished / 'export'}" in log and "on-policy (Draft-OPD" in log


MEMBERS = {  # a member whose q reads its own head: its sections, its export's class, the head's parameter prefix
    "dflash2": ({"dflash2": {"selector_top_k": 8, "selector_rank": 8}}, "DFlash2Drafter", "candidate_selector."),
    "lilicorr": ({"lilicorr": {"candidate_topk": 4, "head_hidden_size": 32, "factor_dim": 16, "head_num_heads": 2}},
                 "LiLiCorrDrafter", "lilicorr."),
    # a few steps' Domino drafter has every first draft rejected: only its uncorrected slot 0 counts, so its layers
    # move and its GRU waits (the gradients through the GRU: tests/unit/architectures/family/test_onpolicy.py)
    "domino": ({"domino": {"gru_hidden_dim": 16, "emb_dim": 16}}, "DominoDrafter", "layers."),
    "dspark": ({"dspark": {"markov_rank": 8}}, "DSparkDrafter", "markov_head."),
}


@pytest.mark.long  # ~20 s each; the default run trains DFlash's stage, and each member's q is checked alone
@pytest.mark.parametrize("arch", sorted(MEMBERS))
def test_a_members_stage_continues_its_run_through_its_own_head(tiny_target_dir, counting_jsonl, tmp_path, arch):
    """DFlash2's, LiLiCorr's, Domino's and DSpark's stages: their own q (the selector's rescoring, the lattice, the
    GRU's correction, the Markov bias, the last two in a shifted layout) trains them; the export stays the
    member's."""
    sections, drafter_class, head = MEMBERS[arch]
    own = {"drafter": {"architecture": arch}, **sections}
    assert main(["train", config(tmp_path, tiny_target_dir, counting_jsonl, optim={"max_steps": 4}, **own),
                 "--run-dir", str(tmp_path / "SFT")]) == 0
    cfg = config(tmp_path, tiny_target_dir, counting_jsonl, onpolicy={"start_from": str(tmp_path / "SFT")},
                 optim={"max_steps": 4}, **own)
    assert main(["train", cfg, "--run-dir", str(tmp_path / "S")]) == 0
    steps = records(tmp_path / "S")
    assert len(steps) == 4 and all(r["loss"] == r["loss"] and "onpolicy_rejected_loss" in r for r in steps)
    start, stage = load_drafter(tmp_path / "SFT" / "export"), load_drafter(tmp_path / "S" / "export")
    assert type(stage).__name__ == drafter_class
    moved = [k for k, t in start.state_dict().items() if not torch.equal(t, stage.state_dict()[k])]
    assert any(k.startswith(head) for k in moved), moved


@pytest.mark.long  # ~30 s: two drafter ranks over gloo
@pytest.mark.parametrize("arch", ["dspark", "domino"])
def test_a_stage_on_two_ranks_trains_what_its_q_reads_and_nothing_else(tiny_target_dir, counting_jsonl, tmp_path,
                                                                      arch):
    """DDP needs every trained parameter to get a gradient each step: DSpark's stage leaves its confidence head as the
    finished run trained it (frozen), Domino's corrected slots may be absent from a micro-batch (its GRU still in the
    graph); both run on two ranks, and the confidence head is exported unchanged."""
    sections = {"dspark": {"dspark": {"markov_rank": 8, "confidence_head": True}},
                "domino": {"domino": {"gru_hidden_dim": 16, "emb_dim": 16}}}[arch]
    own = {"drafter": {"architecture": arch}, **sections}
    assert main(["train", config(tmp_path, tiny_target_dir, counting_jsonl, optim={"max_steps": 3}, **own),
                 "--run-dir", str(tmp_path / "SFT")]) == 0
    cfg = config(tmp_path, tiny_target_dir, counting_jsonl, onpolicy={"start_from": str(tmp_path / "SFT")},
                 optim={"max_steps": 3}, **own)
    assert main(["train", cfg, "--run-dir", str(tmp_path / "S"), "--nproc", "2"]) == 0
    start, stage = load_drafter(tmp_path / "SFT" / "export"), load_drafter(tmp_path / "S" / "export")
    frozen = [k for k in start.state_dict() if k.startswith("confidence_head.")]
    assert (len(frozen) > 0) == (arch == "dspark")
    assert all(torch.equal(start.state_dict()[k], stage.state_dict()[k]) for k in frozen)


@pytest.mark.long  # ~25 s: the stage in a real process, stopped and resumed
def test_a_stopped_stage_resumes_to_the_uninterrupted_losses_without_its_starts_export(finished, tiny_target_dir, counting_jsonl, tmp_path):
    cfg = config(tmp_path, tiny_target_dir, counting_jsonl, onpolicy={"start_from": str(finished)},
                 optim={"max_steps": 12})
    assert main(["train", cfg, "--run-dir", str(tmp_path / "S")]) == 0
    proc = launch(["train", cfg, "--run-dir", str(tmp_path / "T")], tmp_path / "t.log")
    try:
        wait_for_step(tmp_path / "T", 0, 4, proc)
        assert main(["stop", str(tmp_path / "T")]) == 0
        assert proc.wait(timeout=60) == 3, (tmp_path / "t.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    aside = finished / "export.aside"  # a resumed stage reads its own checkpoint: the start's export may be gone
    (finished / "export").rename(aside)
    try:
        assert main(["train", "--run-dir", str(tmp_path / "T"), "--resume"]) == 0
    finally:
        aside.rename(finished / "export")
    got, ref = losses(tmp_path / "T"), losses(tmp_path / "S")
    assert got.keys() == ref.keys() and all(got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7) for s in got)


def test_a_start_that_is_not_this_stages_drafter_is_refused_naming_the_key(finished, tiny_target_dir, counting_jsonl,
                                                                           tmp_path, capsys):
    cases = [({"onpolicy": {"start_from": str(tmp_path / "nothing")}}, "holds no exported drafter"),
             ({"onpolicy": {"start_from": str(finished)}, "drafter": {"num_draft_layers": 2}},
              "has num_hidden_layers 1 where this stage's drafter config gives 2"),
             ({"onpolicy": {"start_from": str(finished)}, "drafter": {"architecture": "dflash2"}},
              "holds a dflash drafter and this stage trains drafter.architecture=dflash2"),
             ({"onpolicy": {"start_from": str(finished)}, "drafter": {"architecture": "dspark"}},
              "holds a dflash drafter and this stage trains drafter.architecture=dspark"),
             ({"onpolicy": {"start_from": str(finished)}, "drafter": {"architecture": "dflash2"},
               "dflash2": {"selector_codebooks": "factored"}}, "set dflash2.selector_codebooks=free")]
    for i, (sections, message) in enumerate(cases):
        run = tmp_path / f"R{i}"
        assert main(["train", config(tmp_path, tiny_target_dir, counting_jsonl, **sections), "--run-dir",
                     str(run)]) == 2
        err = capsys.readouterr().err
        assert "onpolicy.start_from" in err and message in err, err
        assert not run.exists() or not any(run.iterdir())
