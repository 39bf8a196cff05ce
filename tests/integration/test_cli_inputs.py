"""The CLI's user-facing contract: every flag says what it does and its default; paths of the wrong kind
get one line that says what they are and which command fits (exit code 2, no traceback)."""

from __future__ import annotations

import argparse

import pytest

from conftest import tiny_drafter
from dflash_train.cli import build_parser

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _shows(default, text: str) -> bool:
    values = default if isinstance(default, (list, tuple)) else [default]
    return "default" in text and all(str(v) in text for v in values)


def _named(sub: argparse.ArgumentParser) -> tuple[str, argparse.ArgumentParser]:
    return sub.prog.split()[-1], sub


def _help_problems(name: str, parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    problems = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = "/".join(action.option_strings) or action.dest
        text = formatter._expand_help(action) if action.help else ""
        if not text.strip():
            problems.append(f"{name} {flag}: no help")
        elif action.option_strings and not any(action.default is v for v in (None, False, argparse.SUPPRESS)) \
                and not _shows(action.default, text):
            problems.append(f"{name} {flag}: help does not state the default {action.default!r}: {text!r}")
    return problems


def test_every_flag_has_help_that_states_its_default():
    parser = build_parser()
    subs = _subparsers(parser)
    assert {"train", "status", "stop", "eval", "export", "doctor", "demo", "prepare", "regen"} <= set(subs)
    problems = _help_problems("dflash-train", parser)
    for sub in subs.values():
        problems += _help_problems(*_named(sub))
    assert not problems, "\n".join(problems)


def test_the_help_check_catches_a_flag_without_its_default():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=7, help="how many")
    p.add_argument("--m", type=int, default=7, help="how many (default: %(default)s)")
    p.add_argument("--t", type=float, default=0.0, help="zero: greedy")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("where")
    assert _help_problems("x", p) == ["x --n: help does not state the default 7: 'how many'",
                                      "x --t: help does not state the default 0.0: 'zero: greedy'",
                                      "x --quiet: no help", "x where: no help"]


# ------------------------------------------------------------------------------ paths of the wrong kind

def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]




@pytest.fixture
def run_dir(tmp_path):
    """A run as training leaves it: config.yaml, checkpoints step-10/20/30 and best (each its own weights), export/."""
    import torch

    from dflash_train.architectures.io import save_drafter
    from dflash_train.run.directory import RunDir
    from dflash_train.train.checkpoint import save_checkpoint

    run = RunDir(tmp_path / "run").create()
    run.config.write_text("target:\n  path: smollm2\n")
    for step, name in ((10, None), (20, None), (30, None), (20, "best")):
        drafter = tiny_drafter(seed=step)
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        save_checkpoint(run.checkpoints, step, drafter, opt, sched, {"epoch": 0, "batch_index": step}, keep_last=5,
                        name=name)
    save_drafter(tiny_drafter(seed=30), run.export, dtype="float32")
    return run.root


def _same_weights(a, b) -> bool:
    import torch

    from dflash_train.architectures.io import load_drafter

    sa, sb = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("given", ["checkpoints/step-20", "step-20", "checkpoints/step-00000020",
                                   "checkpoints/step-00000020/drafter"])
def test_export_accepts_the_step_shorthand_and_the_drafter_folder(run_dir, tmp_path, given):
    from dflash_train.cli import main

    out = tmp_path / "exported"
    assert main(["export", str(run_dir / given), "--out", str(out), "--dtype", "float32"]) == 0
    assert _same_weights(out, run_dir / "checkpoints" / "step-00000020" / "drafter")
    assert not _same_weights(out, run_dir / "checkpoints" / "step-00000010" / "drafter")
    assert (out / "training_config.yaml").read_text() == (run_dir / "config.yaml").read_text()


def test_export_never_replaces_an_existing_folder_without_overwrite(run_dir, tmp_path, capsys):
    from dflash_train.cli import main

    out = tmp_path / "exported"
    assert main(["export", str(run_dir / "step-10"), "--out", str(out), "--dtype", "float32"]) == 0
    assert main(["export", str(run_dir / "step-20"), "--out", str(out), "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and "Traceback" not in err
    assert _same_weights(out, run_dir / "checkpoints" / "step-00000010" / "drafter")  # untouched
    assert main(["export", str(run_dir / "step-20"), "--out", str(out), "--dtype", "float32", "--overwrite"]) == 0
    assert _same_weights(out, run_dir / "checkpoints" / "step-00000020" / "drafter")


def test_export_accepts_best(run_dir, tmp_path):
    from dflash_train.cli import main

    assert main(["export", str(run_dir / "best"), "--out", str(tmp_path / "b"), "--dtype", "float32"]) == 0
    assert _same_weights(tmp_path / "b", run_dir / "checkpoints" / "best" / "drafter")


def test_export_of_a_run_lists_its_checkpoints_and_its_export(run_dir, tmp_path, capsys):
    from dflash_train.cli import main

    assert main(["export", str(run_dir), "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys)
    assert f"{run_dir} is a training run, not a checkpoint" in line
    assert f"e.g. dflash-train export {run_dir / 'checkpoints' / 'step-00000030'} --out DIR" in line
    assert "step-00000030, step-00000020, step-00000010, best" in line
    assert line.index("step-00000030") < line.index("step-00000010")  # newest first
    assert f"already in {run_dir / 'export'}" in line
    assert not (tmp_path / "x").exists()


def test_export_of_an_exported_folder_says_so(run_dir, tmp_path, capsys):
    from dflash_train.cli import main

    assert main(["export", str(run_dir / "export"), "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys)
    assert f"{run_dir / 'export'} is already an exported drafter" in line and "eval --drafter" in line


def test_export_of_something_else_names_what_is_missing(run_dir, tmp_path, capsys):
    from dflash_train.cli import main

    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "drafter").mkdir()
    (tmp_path / "stuff" / "drafter" / "config.json").write_text("{}")
    assert main(["export", str(tmp_path / "stuff"), "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys)
    assert "is not a training checkpoint: it lacks trainer_state.json, drafter/model.safetensors;" in line
    assert main(["export", str(run_dir / "checkpoints" / "step-40"), "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys)
    assert "step-40 does not exist; checkpoints in" in line and "step-00000030" in line
    assert main(["export", str(run_dir / "checkpoints"), "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys)
    assert "is a folder of checkpoints, not a checkpoint: export one of its checkpoints" in line


def _eval_error(capsys, drafter, tmp_path) -> str:
    """`eval` with a target that does not exist: an error about the drafter shows it was checked first."""
    from dflash_train.cli import main

    rc = main(["eval", "--target", str(tmp_path / "no-target"), "--drafter", str(drafter), "--data", "x.jsonl",
               "--out", str(tmp_path / "e.json")])
    assert rc == 2
    return _one_error_line(capsys)


def test_eval_of_a_checkpoint_says_export_it_first(run_dir, tmp_path, capsys):
    ckpt = run_dir / "checkpoints" / "step-00000020"
    line = _eval_error(capsys, ckpt, tmp_path)
    assert f"{ckpt} is a training checkpoint, not an exported drafter" in line
    assert f"dflash-train export {ckpt} --out DIR and pass --drafter DIR" in line
    assert f"or use {run_dir / 'export'}" in line
    assert not (tmp_path / "e.json").exists()


def test_eval_of_a_run_points_at_its_export_or_its_newest_checkpoint(run_dir, tmp_path, capsys):
    import shutil

    line = _eval_error(capsys, run_dir, tmp_path)
    assert f"{run_dir} is a training run: its exported drafter is {run_dir / 'export'}" in line
    shutil.rmtree(run_dir / "export")
    line = _eval_error(capsys, run_dir, tmp_path)
    assert "is a training run without an export yet" in line
    assert f"dflash-train export {run_dir / 'checkpoints' / 'step-00000030'} --out DIR" in line


def test_eval_of_a_folder_without_a_drafter_names_the_missing_files(tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    line = _eval_error(capsys, tmp_path / "half", tmp_path)
    assert f"{tmp_path / 'half'} is not an exported drafter: it lacks model.safetensors" in line


# ------------------------------------------------------------------------------ eval's lossless line

@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory, tiny_target_dir):
    """An untrained drafter for the tiny target and three prompts: eval runs in seconds on CPU."""
    import json

    from transformers import AutoConfig

    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.io import save_drafter

    root = tmp_path_factory.mktemp("tiny-eval")
    cfg = make_drafter_config(AutoConfig.from_pretrained(tiny_target_dir), num_draft_layers=1, block_size=4,
                              target_layer_ids=[1, 4], mask_token_id=16)
    save_drafter(DFlashDrafter(cfg), root / "drafter", dtype="float32")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Say something about {w}."}) + "\n"
                            for i, w in enumerate(["rivers", "stones", "clouds"])))
    return root / "drafter", data


def _eval_lines(tiny_target_dir, tiny_eval, tmp_path, capsys, *extra) -> tuple[list[str], dict]:
    import json

    from dflash_train.cli import main

    drafter, data = tiny_eval
    out = tmp_path / "e.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(drafter), "--data", str(data),
                 "--out", str(out), "--max-new-tokens", "6", "--device", "cpu", *extra]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lossless:")]
    return lines, json.loads(out.read_text())


def test_eval_prints_how_many_outputs_equal_the_targets_greedy_output(tiny_target_dir, tiny_eval, tmp_path, capsys):
    lines, report = _eval_lines(tiny_target_dir, tiny_eval, tmp_path, capsys, "--tree-budget", "4", "--limit", "2")
    data = str(tiny_eval[1])
    assert len(report["outputs"]) == 2 and report["datasets"][data]["lossless_mismatches"] == []
    assert lines == [f"lossless: {data}: 4 of 4 outputs (block, tree-4) equal the target's own greedy output"]


def test_the_lossless_line_names_the_first_mismatch(tiny_target_dir, tiny_eval, tmp_path, capsys):
    """A real report with one decoded output changed: the line counts it and says where it diverges."""
    from dflash_train.infer.evaluate import lossless_line, summarize_records

    _, report = _eval_lines(tiny_target_dir, tiny_eval, tmp_path, capsys)
    data = str(tiny_eval[1])
    record = report["outputs"][1]
    tokens = record["modes"]["block"][0]["token_ids"]
    tokens[2] = tokens[2] + 1
    report["datasets"][data] = summarize_records(report["outputs"], ["target", "block"])
    assert lossless_line(report, data) == (
        f"lossless: {data}: 2 of 3 outputs (block) equal the target's own greedy output; 1 differs, the first: "
        f"prompt {record['id']} (block) at turn 0, token 2 (expected only below float32)")


@pytest.mark.parametrize("extra,why", [
    (("--no-baseline",), "not checked (--no-baseline"),
    (("--temperature", "0.8"), "not applicable (sampling at --temperature 0.8"),
    (("--replay",), "not checked (--replay"),
])
def test_eval_says_when_losslessness_is_not_checked(tiny_target_dir, tiny_eval, tmp_path, capsys, extra, why):
    lines, _ = _eval_lines(tiny_target_dir, tiny_eval, tmp_path, capsys, "--limit", "1", *extra)
    assert len(lines) == 1 and lines[0].startswith(f"lossless: {tiny_eval[1]}: {why}"), lines


# ------------------------------------------------------------------------------ target folders that cannot load

def _partial_copy(src, dst, names):
    import shutil

    dst.mkdir()
    for name in names:
        shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture
def config_only(tiny_target_dir, tmp_path):
    return _partial_copy(tiny_target_dir, tmp_path / "config-only", ["config.json"])


@pytest.fixture
def no_tokenizer(tiny_target_dir, tmp_path):
    return _partial_copy(tiny_target_dir, tmp_path / "no-tokenizer", ["config.json", "model.safetensors"])


def test_resolve_target_names_what_a_folder_lacks(config_only, no_tokenizer, tiny_target_dir, tmp_path):
    import json

    from dflash_train.assets import resolve_target
    from dflash_train.errors import UserError

    with pytest.raises(UserError) as e:
        resolve_target(str(config_only))
    assert str(e.value).startswith(f"{config_only} is not a complete model folder: missing a tokenizer "
                                   "(tokenizer.json, or tokenizer.model / vocab files); weights (")
    with pytest.raises(UserError) as e:
        resolve_target(str(no_tokenizer))
    assert "missing a tokenizer" in str(e.value) and "weights" not in str(e.value).split("Copy")[0]
    sharded = _partial_copy(tiny_target_dir, tmp_path / "sharded", ["config.json", "tokenizer.json"])
    (sharded / "model-00001-of-00002.safetensors").write_bytes((tiny_target_dir / "model.safetensors").read_bytes())
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(UserError, match="missing weight shards listed in its index: model-00002-of-00002.safetensors"):
        resolve_target(str(sharded))
    assert resolve_target(str(tiny_target_dir)) == tiny_target_dir.resolve()
    tokenizer_only = _partial_copy(tiny_target_dir, tmp_path / "tokenizer-only", ["config.json", "tokenizer.json"])
    assert resolve_target(str(tokenizer_only), weights=False) == tokenizer_only.resolve()


def _target_error(capsys, argv) -> str:
    from dflash_train.cli import main

    assert main(argv) == 2
    return _one_error_line(capsys)


def test_every_command_that_loads_a_target_names_the_missing_files(config_only, no_tokenizer, tiny_eval, tmp_path,
                                                                   capsys):
    import yaml

    drafter, data = tiny_eval
    commands = {
        "eval": lambda t: ["eval", "--target", str(t), "--drafter", str(drafter), "--data", str(data),
                           "--out", str(tmp_path / "e.json"), "--device", "cpu"],
        "regen": lambda t: ["regen", "--target", str(t), "--data", str(data), "--out", str(tmp_path / "r.jsonl"),
                            "--device", "cpu"],
        "prepare": lambda t: ["prepare", "--target", str(t), "--data", str(data), "--out", str(tmp_path / "p")],
    }
    for name, argv in commands.items():
        line = _target_error(capsys, argv(no_tokenizer))
        assert line.startswith(f"error: {no_tokenizer} is not a complete model folder: missing a tokenizer"), (name, line)
        line = _target_error(capsys, argv(config_only))
        assert f"{config_only} is not a complete model folder: missing a tokenizer" in line, (name, line)
        assert ("weights (*.safetensors" in line) == (name != "prepare"), (name, line)  # prepare reads the tokenizer only
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"path": str(no_tokenizer)}, "data": {"train_files": [str(data)]},
                                   "run": {"device": "cpu", "progress_bar": False}}))
    line = _target_error(capsys, ["train", str(cfg), "--run-dir", str(tmp_path / "run"), "--max-steps", "1"])
    assert f"{no_tokenizer} is not a complete model folder: missing a tokenizer" in line


def test_prepare_needs_only_the_tokenizer(tiny_target_dir, counting_jsonl, tmp_path):
    from dflash_train.cli import main

    folder = _partial_copy(tiny_target_dir, tmp_path / "tokenizer-only",
                           ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
    assert main(["prepare", "--target", str(folder), "--data", str(counting_jsonl), "--out", str(tmp_path / "p"),
                 "--max-length", "128", "--block-size", "4"]) == 0
    assert (tmp_path / "p" / "manifest.json").is_file()


@pytest.mark.parametrize("value,expected", [("true", True), ("False", False), ("1", True), ("0", False),
                                            ("yes", True), ("NO", False)])
def test_true_false_options_read_true_false_1_0_yes_no(value, expected):
    from dflash_train.cli import parse_bool

    assert parse_bool(value) is expected


@pytest.mark.parametrize("command", [["eval", "--target", "t", "--drafter", "d"],
                                     ["prepare", "--target", "t", "--data", "x", "--out", "o"],
                                     ["regen", "--data", "x"]])
@pytest.mark.parametrize("value", ["maybe", "on", "", "2"])
def test_true_false_options_refuse_anything_else(command, value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--thinking", value])
    assert e.value.code == 2
    assert f"--thinking: expected true or false (or 1/0, yes/no), got {value!r}" in capsys.readouterr().err


# ------------------------------------------------------------------------------ eval's options, before anything loads

@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_target_dir):
    from _drafter_exports import EXPORTS, export_drafter

    root = tmp_path_factory.mktemp("exports")
    return {case: export_drafter(root, tiny_target_dir, case)[0] for case in EXPORTS}


@pytest.mark.parametrize("case,extra,said", [
    ("dflash", ["--tree-budget", "4", "--confidence-threshold", "0.5"],
     "error: --confidence-threshold truncates block verification; DDTree verifies a tree: drop --tree-budget or "
     "--confidence-threshold"),
    ("dflash", ["--confidence-threshold", "0.5"],
     "error: --confidence-threshold 0.5: the dflash drafter in {drafter} has no confidence head (its config.json "
     "declares none); drop --confidence-threshold"),
    ("dspark-no-confidence", ["--confidence-threshold", "0.5"],
     "error: --confidence-threshold 0.5: the dspark drafter in {drafter} has no confidence head"),
    ("domino", ["--tree-budget", "4"], "error: {drafter}: drafter.architecture domino drafts a chain"),
    ("dspark-rnn", ["--tree-budget", "16"], "error: {drafter}: --tree-budget (DDTree) scores each tree node given its "
                                            "parent token only; this DSpark drafter's markov_head_type is rnn"),
    ("dflash", ["--block-size", "8"], "error: --block-size 8: larger than the drafter's trained block size 4 "
                                      "({drafter}/config.json); give at most 4 or leave --block-size out"),
    ("dflash", ["--replay", "--block-size", "3"], "error: --replay verifies the drafter's trained block (4, "
                                                  "{drafter}/config.json); drop --block-size 3 or --replay"),
])
def test_eval_refuses_what_the_drafter_cannot_do_before_any_model_loads(exports, tiny_eval, tmp_path, capsys, case,
                                                                        extra, said):
    """The target does not exist: a refusal about the options shows they were checked before it was looked at."""
    from dflash_train.cli import main

    drafter, out = exports[case], tmp_path / "e.json"
    assert main(["eval", "--target", str(tmp_path / "no-target"), "--drafter", str(drafter), "--data",
                 str(tiny_eval[1]), "--out", str(out), *extra]) == 2
    assert _one_error_line(capsys).startswith(said.format(drafter=drafter))
    assert not out.exists()


@pytest.mark.parametrize("case,extra", [("dspark", ["--confidence-threshold", "0.5"]),
                                        ("dspark", ["--tree-budget", "4", "1024"]),
                                        ("dflash2", ["--tree-budget", "16", "--block-size", "3"])])
def test_eval_options_the_drafter_supports_go_on_to_the_target(exports, tiny_eval, tmp_path, capsys, case, extra):
    from dflash_train.cli import main

    assert main(["eval", "--target", str(tmp_path / "no-target"), "--drafter", str(exports[case]), "--data",
                 str(tiny_eval[1]), "--out", str(tmp_path / "e.json"), *extra]) == 2
    assert "no-target' does not exist" in _one_error_line(capsys)


@pytest.mark.parametrize("values,said", [
    (["100000"], "argument --tree-budget: must be an integer in [1, 1024], got 100000"),
    ([], "argument --tree-budget: expected at least one argument"),
])
def test_eval_refuses_a_tree_budget_beyond_its_bound_or_none(values, said, capsys):
    from dflash_train.cli import main

    with pytest.raises(SystemExit) as e:
        main(["eval", "--target", "t", "--drafter", "d", "--tree-budget", *values])
    assert e.value.code == 2
    assert said in capsys.readouterr().err


def test_eval_refuses_more_new_tokens_than_the_targets_context_before_the_drafter_loads(tiny_target_dir, tiny_eval,
                                                                                         tmp_path, capsys):
    """The drafter's weights are garbage: the refusal about the context shows they were never read."""
    import shutil

    from dflash_train.cli import main

    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_eval[0], drafter)
    (drafter / "model.safetensors").write_bytes(b"not weights")
    argv = ["eval", "--target", str(tiny_target_dir), "--drafter", str(drafter), "--data", str(tiny_eval[1]),
            "--out", str(tmp_path / "e.json"), "--device", "cpu"]
    assert main([*argv, "--max-new-tokens", "2048"]) == 2
    assert _one_error_line(capsys) == (
        f"error: --max-new-tokens 2048 leaves no room for a prompt in the target's context of 2048 tokens "
        f"(max_position_embeddings in {tiny_target_dir.resolve() / 'config.json'}): give fewer than 2048")
    assert main([*argv, "--max-new-tokens", "2047"]) == 2  # within the context: the drafter is read, and refused
    assert "model.safetensors" in _one_error_line(capsys)


def test_eval_dtype_help_names_its_real_default():
    parser = _subparsers(build_parser())["eval"]
    (action,) = [a for a in parser._actions if "--dtype" in a.option_strings]
    text = parser._get_formatter()._expand_help(action)
    assert action.default == "float32" and text.endswith("(default: float32)")
    assert "float32, the default on every device" in text


# ------------------------------------------------------------------------------ a decoding mode that fails

def test_a_failed_decoding_mode_keeps_the_modes_before_it(tiny_target_dir, tiny_eval, tmp_path, capsys, monkeypatch):
    """DDTree's mask cannot be allocated (as for a budget too large for the machine): the report holds the target and
    block results of every prompt, names the failed mode with its error, and eval exits 1 saying which."""
    import json

    from dflash_train.cli import main
    from dflash_train.infer.spec_decode import SpeculativeDecoder

    def out_of_memory(self, parents, past, dtype):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 40004000008 bytes.\n"
                           "Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(SpeculativeDecoder, "_tree_mask", out_of_memory)
    drafter, data = tiny_eval
    out = tmp_path / "e.json"
    rc = main(["eval", "--target", str(tiny_target_dir), "--drafter", str(drafter), "--data", str(data),
               "--out", str(out), "--max-new-tokens", "6", "--device", "cpu", "--tree-budget", "4", "--limit", "2",
               "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1
    error = ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 40004000008 bytes. "
             "Error code 12 (Cannot allocate memory)")
    report = json.loads(out.read_text())
    assert report["failed"] == {"mode": "tree-4", "dataset": str(data), "prompt": "p0", "error": error}
    assert list(report["datasets"][str(data)]["modes"]) == ["target", "block"]
    assert [sorted(r["modes"]) for r in report["outputs"]] == [["block", "target"]] * 2
    assert report["datasets"][str(data)]["modes"]["block"]["steps"] > 0
    said = f"decoding mode tree-4 failed on {data} prompt p0 ({error})"
    assert [line for line in captured.err.splitlines() if line.startswith("error:")] == [
        f"error: eval: {said}; the report holds the modes finished before it, and no later mode or dataset ran "
        "(--debug shows the traceback)"]
    assert "Traceback" not in captured.err
    assert f"| {data} | block |" in captured.out and "tree-4 |" not in captured.out
    assert f"lossless: {data}: 2 of 2 outputs (block) equal the target's own greedy output" in captured.out
    md = out.with_suffix(".md").read_text()
    assert f"| {data} | block |" in md and f"Failed: {said}" in md


# ------------------------------------------------------------------------------ the table

def test_the_table_shows_the_tokens_verified_per_step_where_the_report_has_them(tiny_target_dir, tiny_eval, tmp_path,
                                                                               capsys):
    """Block decoding counts the tokens the target verified per step (the anchor and the block's drafts: 4 at
    block size 4); replay does not."""
    import json

    from dflash_train.cli import main

    drafter, data = tiny_eval
    argv = ["eval", "--target", str(tiny_target_dir), "--drafter", str(drafter), "--data", str(data),
            "--max-new-tokens", "6", "--device", "cpu", "--limit", "1", "--no-progress", "--tree-budget", "4"]
    assert main([*argv, "--out", str(tmp_path / "d.json")]) == 0
    table = capsys.readouterr().out
    modes = json.loads((tmp_path / "d.json").read_text())["datasets"][str(data)]["modes"]
    assert modes["block"]["verified_per_step"] == 4 and "verified_per_step" not in modes["tree-4"]
    assert "| dataset | mode | tau | verified/step | decode tok/s |" in table
    assert f"| {data} | block | {modes['block']['tau']:.3f} | 4.00 |" in table
    assert f"| {data} | tree-4 | {modes['tree-4']['tau']:.3f} | - |" in table
    assert f"| {data} | block | {modes['block']['tau']:.3f} | 4.00 |" in (tmp_path / "d.md").read_text()
    assert main([*argv, "--out", str(tmp_path / "r.json"), "--replay"]) == 0
    assert "verified/step" not in capsys.readouterr().out
