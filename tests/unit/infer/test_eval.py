"""End to end on a small real target (SmolLM2 cut to 6 layers): regenerate data with the target,
train, then `eval` and `export`. A trained drafter must beat an untrained one on real speculative
decoding, losslessly."""

import json

import pytest
import torch
import yaml

from dflash_train.cli import main
from dflash_train.architectures.io import load_drafter


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def regen_data(tmp_path_factory, smollm2_slice_dir):
    """Conversations whose answers the tiny target wrote itself (greedy, `regen`), as every recipe does."""
    from dflash_train.data.regen.inputs import RegenSettings
    from dflash_train.data.regen.local import regenerate

    words = ["apple", "river", "stone", "cloud", "green", "seven", "light", "table"]
    questions = [f"Tell me about {words[i % 8]} number {i}." for i in range(30)]
    root = tmp_path_factory.mktemp("regen")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                                                for q in questions[:26]))
    (root / "heldout.jsonl").write_text("".join(json.dumps({"id": i, "turns": [q]}) + "\n"
                                                for i, q in enumerate(questions) if i >= 26))
    summary = regenerate(smollm2_slice_dir, [str(root / "prompts.jsonl")], root / "train.jsonl",
                         RegenSettings(max_new_tokens=32, batch_size=26, progress=False))
    assert summary["rows_written"] == 26, summary
    return root


@pytest.fixture(scope="module")
def trained_run(regen_data, smollm2_slice_dir):
    cfg = {
        "target": {"path": str(smollm2_slice_dir)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "target_layer_ids": [1, 4]},
        "data": {"train_files": [str(regen_data / "train.jsonl")], "max_length": 256, "token_budget": 1024, "max_batch_size": 8},
        "objective": {"max_anchors": 32, "gamma": 4.0},
        "optim": {"lr": 5e-3, "epochs": 20, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 10, "save_every": 1000, "progress_bar": False, "export_dtype": "float32"},
    }
    (regen_data / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = regen_data / "run"
    assert main(["train", str(regen_data / "c.yaml"), "--run-dir", str(run), "--max-steps", "40"]) == 0
    return run


def _eval(tmp, target_dir, drafter_dir, data, name, extra=()):
    out = tmp / f"{name}.json"
    assert main(["eval", "--target", str(target_dir), "--drafter", str(drafter_dir), "--data", str(data),
                 "--out", str(out), "--max-new-tokens", "32", *extra]) == 0
    return json.loads(out.read_text())


@pytest.mark.long  # trains a drafter on the real SmolLM2 slice first (~65 s on 2 cores)
def test_trained_drafter_beats_untrained_and_stays_lossless(tmp_path, regen_data, trained_run, smollm2_slice_dir):
    from dflash_train.architectures.io import save_drafter

    trained = load_drafter(trained_run / "export")
    torch.manual_seed(0)
    untrained = type(trained)(trained.config)
    save_drafter(untrained, tmp_path / "untrained", dtype="float32")
    data = regen_data / "heldout.jsonl"
    after = _eval(tmp_path, smollm2_slice_dir, trained_run / "export", data, "after", ["--tree-budget", "8"])
    before = _eval(tmp_path, smollm2_slice_dir, tmp_path / "untrained", data, "before", ["--no-baseline"])
    name = str(data)
    tau_after = after["datasets"][name]["modes"]["block"]["tau"]
    tau_before = before["datasets"][name]["modes"]["block"]["tau"]
    assert tau_before < 1.3
    assert tau_after > tau_before + 1.0, (tau_before, tau_after)
    assert after["datasets"][name]["modes"]["tree-8"]["tau"] >= tau_after - 0.05
    assert after["datasets"][name]["lossless_mismatches"] == []
    body = after["datasets"][name]["modes"]["block"]
    # Every generated token after each prompt's first comes from some verification step.
    produced = sum(len(o["modes"]["block"][0]["token_ids"]) for o in after["outputs"])
    assert sum(int(k) * v for k, v in body["histogram"].items()) >= produced - len(after["outputs"])
    assert (tmp_path / "after.md").read_text().count("|") > 10
    out0 = after["outputs"][0]["modes"]
    assert out0["block"][0]["token_ids"] == out0["target"][0]["token_ids"] and out0["block"][0]["text"]


@pytest.mark.long  # trains a drafter on the real SmolLM2 slice first (~65 s on 2 cores)
def test_export_from_a_checkpoint_reloads_with_identical_outputs(tmp_path, trained_run, capsys):
    ckpt = sorted((trained_run / "checkpoints").iterdir())[-1]
    assert main(["export", str(ckpt), "--out", str(tmp_path / "exp"), "--dtype", "float32"]) == 0
    a, b = load_drafter(ckpt / "drafter"), load_drafter(tmp_path / "exp")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert (tmp_path / "exp" / "training_config.yaml").is_file()


@pytest.mark.long  # trains a drafter on the real SmolLM2 slice first (~65 s on 2 cores)
def test_eval_refuses_a_drafter_of_another_target(tmp_path, trained_run, tiny_target_dir, capsys):
    """The check reads only config.json files: it fails before any target weights load."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2]))
    from conftest import make_tiny_target

    other = make_tiny_target(tmp_path / "other", tiny_target_dir, layers=3)
    prompts = tmp_path / "x.jsonl"  # the data is read (and checked) before the pair
    prompts.write_text('{"prompt": "Hi"}\n')
    rc = main(["eval", "--target", str(other), "--drafter", str(trained_run / "export"), "--data", str(prompts),
               "--out", str(tmp_path / "e.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "not trained for this target" in err and "target 3, drafter 6" in err and "hidden_size: target 64, drafter 576" in err


@pytest.mark.long  # trains a drafter on the real SmolLM2 slice first (~65 s on 2 cores)
def test_eval_refuses_another_chat_template_and_updates_the_model_card(tmp_path, regen_data, trained_run,
                                                                        smollm2_slice_dir, capsys):
    import shutil

    export = trained_run / "export"
    provenance = json.loads((export / "dflash_train.json").read_text())
    assert provenance["chat_template_sha256"].startswith("sha256:") and provenance["num_hidden_layers"] == 6
    assert (provenance["architecture"], provenance["block_size"], provenance["num_speculative_tokens"]) == ("dflash", 4, 3)
    assert '"num_speculative_tokens": 3}' in (export / "README.md").read_text()
    other = tmp_path / "other-template"
    shutil.copytree(smollm2_slice_dir, other)
    template = other / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>assistant", "<|im_start|>bot"))
    rc = main(["eval", "--target", str(other), "--drafter", str(export), "--data", str(regen_data / "heldout.jsonl"),
               "--out", str(tmp_path / "e.json")])
    assert rc == 2
    assert "chat template: trained with" in capsys.readouterr().err
    card = tmp_path / "card"
    shutil.copytree(export, card)
    assert main(["eval", "--target", str(smollm2_slice_dir), "--drafter", str(card), "--data",
                 str(regen_data / "heldout.jsonl"), "--out", str(tmp_path / "c.json"), "--limit", "1",
                 "--max-new-tokens", "8", "--update-card"]) == 0
    text = (card / "README.md").read_text()
    assert "## Evaluation (speculative decoding)" in text and "| block |" in text and "## Training config" in text


@pytest.mark.parametrize("architecture", ["dflash", "dspark"])
def test_eval_refuses_an_export_whose_recorded_speculative_tokens_differ(tiny_target_dir, tmp_path, architecture):
    """The export's dflash_train.json records the number of speculative tokens it is served with (DFlash drafts
    bs - 1 per block, DSpark bs); the model card says it; eval refuses a drafter that drafts another number."""
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.io import save_drafter
    from dflash_train.infer.evaluate import load_eval_models
    from dflash_train.exports.card import drafter_card
    from dflash_train.target.capture import load_tokenizer, read_target_config
    from dflash_train.target.provenance import serving_record, target_provenance, write_provenance

    cfg = make_drafter_config(read_target_config(tiny_target_dir), num_draft_layers=1, block_size=5,
                              target_layer_ids=[1, 4], mask_token_id=16)
    if architecture == "dspark":
        from dflash_train.architectures.dspark.model import DSparkDrafter

        cfg.architectures = ["Qwen3DSparkModel"]
        cfg.markov_rank, cfg.markov_head_type = 4, "vanilla"
        cfg.enable_confidence_head, cfg.confidence_head_with_markov = True, True
        drafter = DSparkDrafter(cfg)
    else:
        drafter = DFlashDrafter(cfg)
    export = save_drafter(drafter, tmp_path / "export", dtype="float32")
    record = serving_record(load_drafter(export))
    want = 5 if architecture == "dspark" else 4
    assert record == {"architecture": architecture, "block_size": 5, "num_speculative_tokens": want}
    card = drafter_card(load_drafter(export), "float32", str(tiny_target_dir))
    assert f'"num_speculative_tokens": {want}}}' in card and f"--speculative-num-draft-tokens {want + 1}`" in card
    tokenizer = load_tokenizer(tiny_target_dir)
    base = target_provenance(str(tiny_target_dir), tokenizer, read_target_config(tiny_target_dir))
    write_provenance(export, {**base, **record})
    load_eval_models(str(tiny_target_dir), str(export), torch.device("cpu"), torch.float32)
    write_provenance(export, {**base, **record, "num_speculative_tokens": 9 - want})  # the other layout's number
    with pytest.raises(ValueError, match=rf"records {9 - want} speculative tokens.*drafts {want} \(block size 5\)"):
        load_eval_models(str(tiny_target_dir), str(export), torch.device("cpu"), torch.float32)
