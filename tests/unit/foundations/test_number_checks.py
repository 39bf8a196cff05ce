"""Every number a user gives has a declared range, and a number outside it is refused before anything loads or is
written: one line naming the flag or the config key, the range and the value (exit code 2, no traceback). The
sweeps are generated from the parser and the config schema, so a new numeric flag or key without a range fails."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from dflash_train.cli import build_parser, main
from dflash_train.config.validate import NUMBER_RULES, number_rules, numeric_keys
from dflash_train.numbers import POSITIVE_INT, Rule, rule_of

REPO = Path(__file__).resolve().parents[3]
TINY_CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")

# Every numeric flag: its range as the error states it, and values it accepts. A new numeric flag fails
# `test_every_numeric_flag_is_in_the_table` until it has a line here.
FLAGS: dict[tuple[str, str], tuple[str, list[str]]] = {
    ("train", "--max-steps"): ("a positive integer", ["1", "40"]),
    ("train", "--nproc"): ("a positive integer", ["1", "8"]),
    ("train", "--stall-timeout"): ("a number > 0", ["0.5", "300"]),
    ("status", "--interval"): ("a number > 0", ["0.1", "5"]),
    ("eval", "--max-new-tokens"): ("a positive integer", ["1", "256"]),
    ("eval", "--temperature"): ("a number >= 0 (0 = greedy)", ["0", "0.7", "2"]),
    ("eval", "--block-size"): ("an integer >= 2", ["2", "16"]),
    ("eval", "--confidence-threshold"): ("a number in [0, 1]", ["0", "0.5", "1"]),
    ("eval", "--tree-budget"): ("an integer in [1, 1024]", ["1", "64", "1024"]),
    ("eval", "--limit"): ("an integer >= 0 (0 = all)", ["0", "10"]),
    ("prepare", "--max-length"): ("a positive integer", ["32", "3072"]),
    ("prepare", "--block-size"): ("an integer >= 2", ["2", "16"]),
    ("prepare", "--val-fraction"): ("a number in [0, 1)", ["0", "0.02", "0.99"]),
    ("prepare", "--shard-rows"): ("a positive integer", ["1", "50000"]),
    ("prepare", "--max-samples"): ("an integer >= 0 (0 = all)", ["0", "100"]),
    ("regen", "--max-new-tokens"): ("a positive integer", ["1", "512"]),
    ("regen", "--temperature"): ("a number >= 0 (0 = greedy)", ["0", "1.0"]),
    ("regen", "--top-p"): ("a number in (0, 1]", ["0.05", "1"]),
    ("regen", "--stop-token-ids"): ("an integer >= 0", ["0", "2"]),
    ("regen", "--batch-size"): ("a positive integer", ["1", "16"]),
    ("regen", "--batch-tokens"): ("an integer >= 0 (0 = no bound)", ["0", "600000"]),
    ("regen", "--limit"): ("an integer >= 0 (0 = all)", ["0", "7"]),
    ("regen", "--max-turns"): ("an integer >= 0 (0 = all)", ["0", "1"]),
    ("regen", "--seed"): ("an integer >= 0", ["0", "1234"]),
    ("regen", "--max-prompt-tokens"): ("a positive integer", ["1", "2048"]),
    ("regen", "--sort-window"): ("a positive integer", ["1", "4096"]),
}

# A flag and the config key of the same number share one rule.
SAME_NUMBER = {
    ("prepare", "--max-length"): "data.max_length",
    ("prepare", "--block-size"): "drafter.block_size",
    ("prepare", "--max-samples"): "data.max_samples",
    ("eval", "--block-size"): "drafter.block_size",
    ("eval", "--max-new-tokens"): "run.eval_max_new_tokens",
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _unranged_numbers(name: str, parser: argparse.ArgumentParser) -> list[str]:
    """Flags that read a number without a declared range: a bare `type=int`/`float`, or a numeric default
    with no rule."""
    problems = []
    for action in parser._actions:
        flag = "/".join(action.option_strings) or action.dest
        numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
        if action.type in (int, float) or (rule_of(action) is None and numeric_default
                                           and action.nargs != 0):  # store_true/store_const take no value
            problems.append(f"{name} {flag}")
    return problems


def _number_actions() -> dict[tuple[str, str], argparse.Action]:
    found = {}
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if rule_of(action) is not None:
                found[(name, action.option_strings[0])] = action
    return found


def _required_args(command: str) -> list[str]:
    """Placeholder values for what `command` requires: parsing fails on the number before they matter."""
    sub = _subparsers(build_parser())[command]
    args = []
    for action in sub._actions:
        if action.option_strings and action.required:
            args += [action.option_strings[0], "x"]
        elif not action.option_strings and action.nargs is None:
            args.append("x")
    return args


def _plain(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _invalid_values(rule: Rule) -> list[str]:
    """One value of each class outside `rule`: not a number, a fraction for an integer, not finite, below
    (0 where 0 is refused), negative, above."""
    values = ["abc"] + (["1.5"] if rule.kind is int else ["nan", "inf"])
    if rule.low is not None:
        below = rule.low if rule.low_open else rule.low - 1
        values += [_plain(below), _plain(min(below, -1))]
    if rule.high is not None:
        values.append(_plain(rule.high if rule.high_open else rule.high + 1))
    return list(dict.fromkeys(values))


def _is_number(rule: Rule, text: str) -> bool:
    try:
        rule.kind(text)
    except ValueError:
        return False
    return True


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's refusals
        rc = e.code
    return rc, capsys.readouterr().err


def _the_error_line(err: str) -> str:
    """The one line that says what is wrong: the last line, and no other line is an error or a traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert [line for line in lines if "error:" in line] == lines[-1:], err
    return lines[-1]


@pytest.fixture
def no_training(monkeypatch):
    """Training that would start fails the test: a refused config must never get that far."""
    import dflash_train.train.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(trainer, "train", refuse)


# ------------------------------------------------------------------------------ every flag has a range

def test_every_numeric_flag_declares_its_range():
    parser = build_parser()
    problems = _unranged_numbers("dflash-train", parser)
    for name, sub in _subparsers(parser).items():
        problems += _unranged_numbers(name, sub)
    assert not problems, "numeric flags without a range (give them type=<numbers rule>.flag): " + ", ".join(problems)


def test_the_range_check_catches_a_bare_number_flag():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=7, help="how many")
    p.add_argument("--t", type=float, help="how hot")
    p.add_argument("--w", default=3, help="no type at all")
    p.add_argument("--m", type=POSITIVE_INT.flag, default=7, help="ranged")
    p.add_argument("--quiet", action="store_true")
    assert _unranged_numbers("x", p) == ["x --n", "x --t", "x --w"]


def test_every_numeric_flag_is_in_the_table():
    found = {key: rule_of(action).describe() for key, action in _number_actions().items()}
    assert found == {key: described for key, (described, _) in FLAGS.items()}


# ------------------------------------------------------------------------------ the flag sweep

FLAG_CASES = [(command, flag, value) for (command, flag), action in _number_actions().items()
              for value in _invalid_values(rule_of(action))]


@pytest.mark.parametrize("command,flag,value", FLAG_CASES, ids=[" ".join(c) for c in FLAG_CASES])
def test_a_number_flag_outside_its_range_is_refused_before_anything_runs(command, flag, value, tmp_path, capsys,
                                                                         monkeypatch, no_training):
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    rc, err = _run([command, *_required_args(command), flag, value], capsys)
    assert rc == 2
    rule = rule_of(_number_actions()[(command, flag)])
    got = value if _is_number(rule, value) else repr(value)
    assert _the_error_line(err).endswith(f"argument {flag}: must be {rule.describe()}, got {got}"), err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("command,flag", list(FLAGS), ids=[" ".join(k) for k in FLAGS])
def test_a_number_flag_accepts_its_range(command, flag):
    action = _number_actions()[(command, flag)]
    for value in FLAGS[(command, flag)][1]:
        args = build_parser().parse_args([command, *_required_args(command), flag, value])
        parsed = getattr(args, action.dest)
        parsed = parsed[0] if isinstance(parsed, list) else parsed
        assert parsed == float(value) and type(parsed) is rule_of(action).kind, (flag, value, parsed)


def test_the_sweep_covers_zero_negative_non_numeric_and_too_large():
    assert _invalid_values(POSITIVE_INT) == ["abc", "1.5", "0", "-1"]
    top_p = rule_of(_number_actions()[("regen", "--top-p")])
    assert _invalid_values(top_p) == ["abc", "nan", "inf", "0", "-1", "2"]
    val_fraction = rule_of(_number_actions()[("prepare", "--val-fraction")])
    assert _invalid_values(val_fraction) == ["abc", "nan", "inf", "-1", "1"]


# ------------------------------------------------------------------------------ the config sweep

def test_every_numeric_config_key_has_a_range():
    keys = numeric_keys()
    assert {"optim.lr", "optim.max_steps", "optim.betas", "drafter.target_layer_ids", "drafter.sliding_window",
            "run.seed", "run.save_every", "data.max_length"} <= set(keys)
    assert {"dflash2.selector_top_k", "dflash2.selector_lr_scale"} <= set(keys)  # the architectures' sections too
    assert set(keys) == set(number_rules()), ("keys without a range in config.NUMBER_RULES or their architecture's "
                                              "Options.number_rules (or ranges of no key)")


def _override(key: str, value: str) -> str:
    if key == "optim.betas":
        return f"{key}=[{value}, 0.9]"
    if key == "drafter.target_layer_ids":
        return f"{key}=[{value}]"
    return f"{key}={value}"


CONFIG_CASES = [(key, value) for key, rule in number_rules().items() for value in _invalid_values(rule)]


@pytest.mark.parametrize("key,value", CONFIG_CASES, ids=[f"{k}={v}" for k, v in CONFIG_CASES])
def test_a_config_number_outside_its_range_is_refused_before_any_model_loads(key, value, tmp_path, capsys,
                                                                             monkeypatch, no_training):
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    rc, err = _run(["train", TINY_CONFIG, _override(key, value), "--run-dir", str(tmp_path / "run")], capsys)
    assert rc == 2
    line = _the_error_line(err)
    assert line.startswith("error: ") and f"config key '{key}" in line, line
    if value not in ("abc", "nan", "inf", "1.5"):  # those are refused as the wrong type, by name
        each = "each item " if key in ("optim.betas", "drafter.target_layer_ids") else ""
        assert f"': {each}must be {number_rules()[key].describe()}" in line, line
    assert _tree(tmp_path) == before


# ------------------------------------------------------------------------------ a flag and its key: one rule

@pytest.mark.parametrize("command,flag", list(SAME_NUMBER), ids=[" ".join(k) for k in SAME_NUMBER])
def test_a_flag_and_its_config_key_refuse_with_the_same_rule(command, flag, tmp_path, capsys, monkeypatch,
                                                            no_training):
    key = SAME_NUMBER[(command, flag)]
    rule = rule_of(_number_actions()[(command, flag)])
    assert rule is NUMBER_RULES[key]
    monkeypatch.chdir(tmp_path)
    bad = _invalid_values(rule)[-1]  # below the range
    _, flag_err = _run([command, *_required_args(command), flag, bad], capsys)
    _, key_err = _run(["train", TINY_CONFIG, f"{key}={bad}", "--run-dir", "run"], capsys)
    said = f"must be {rule.describe()}, got {bad}"
    assert _the_error_line(flag_err).endswith(f"argument {flag}: {said}")
    assert _the_error_line(key_err).startswith(f"error: config key '{key}': {said}")


def test_max_steps_refuses_what_optim_max_steps_refuses_and_zero(tmp_path, capsys, monkeypatch, no_training):
    """optim.max_steps=0 means "all optim.epochs"; `--max-steps 0` would mean nothing (not 0 steps): refused."""
    monkeypatch.chdir(tmp_path)
    _, err = _run(["train", TINY_CONFIG, "--max-steps", "-5"], capsys)
    assert _the_error_line(err).endswith("argument --max-steps: must be a positive integer, got -5")
    _, err = _run(["train", TINY_CONFIG, "optim.max_steps=-5", "--run-dir", "run"], capsys)
    assert _the_error_line(err).startswith(
        "error: config key 'optim.max_steps': must be an integer >= 0 (0 = all optim.epochs), got -5")
    _, err = _run(["train", TINY_CONFIG, "--max-steps", "0"], capsys)
    assert _the_error_line(err).endswith("argument --max-steps: must be a positive integer, got 0")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ refusals that need two flags

def _no_loading(monkeypatch):
    import dflash_train.infer.evaluate as evaluate
    import dflash_train.target.capture as target

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(evaluate, "load_eval_models", refuse)
    monkeypatch.setattr(target, "load_tokenizer", refuse)


@pytest.mark.parametrize("argv,said", [
    (["eval", "--tree-budget", "0"], "argument --tree-budget: must be an integer in [1, 1024], got 0"),
    (["eval", "--tree-budget", "16", "4", "16"], "error: --tree-budget lists 16 twice: give each budget once"),
    (["eval", "--tree-budget", "4", "--temperature", "0.7"],
     "error: --tree-budget: DDTree verification is greedy; drop --temperature (or --tree-budget)"),
    (["prepare", "--max-length", "20", "--block-size", "16"], "error: --max-length 20 is below 2 * --block-size (32)"),
])
def test_numbers_wrong_together_are_refused_before_anything_loads(argv, said, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    monkeypatch.chdir(tmp_path)
    command, *rest = argv
    extra = ["--target", "t", "--drafter", "d"] if command == "eval" else ["--target", "t", "--data", "x", "--out", "o"]
    rc, err = _run([command, *extra, *rest], capsys)
    assert rc == 2
    assert _the_error_line(err).endswith(said), err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ eval loses nothing it finished

@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory, tiny_target_dir):
    """An untrained drafter for the tiny target and two prompt files: eval runs in seconds on CPU."""
    from transformers import AutoConfig

    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.io import save_drafter

    root = tmp_path_factory.mktemp("two-datasets")
    cfg = make_drafter_config(AutoConfig.from_pretrained(tiny_target_dir), num_draft_layers=1, block_size=4,
                              target_layer_ids=[1, 4], mask_token_id=16)
    save_drafter(DFlashDrafter(cfg), root / "drafter", dtype="float32")
    files = []
    for name, words in (("first", ["rivers", "stones"]), ("second", ["clouds", "trees"])):
        files.append(root / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps({"id": f"{name}{i}", "prompt": f"Say something about {w}."}) + "\n"
                                     for i, w in enumerate(words)))
    return root / "drafter", files


def _eval_argv(tiny_target_dir, two_datasets, out: Path, *extra) -> list[str]:
    drafter, files = two_datasets
    return ["eval", "--target", str(tiny_target_dir), "--drafter", str(drafter), "--data", *map(str, files),
            "--out", str(out), "--max-new-tokens", "5", "--device", "cpu", *extra]


@pytest.mark.parametrize("replay", [False, True], ids=["decoding", "replay"])
def test_eval_writes_each_dataset_before_the_next_is_decoded(tiny_target_dir, two_datasets, tmp_path, monkeypatch,
                                                             replay):
    """The second dataset's decoding fails: the report on disk holds the first dataset's results, written before
    the second began (decoding names the failed mode and exits 1; a failed replay raises)."""
    import dflash_train.infer.evaluate as evaluate

    first, second = map(str, two_datasets[1])
    out = tmp_path / "e.json"
    seen_on_disk = []

    def check(datasets: set[str]) -> None:
        if second in datasets:
            seen_on_disk.append(json.loads(out.read_text()) if out.exists() else None)
            raise RuntimeError("the machine fell over")

    if replay:
        real_replay = evaluate.replay_reports
        monkeypatch.setattr(evaluate, "replay_reports", lambda target, tokenizer, drafters, items, **kw: (
            check({i["dataset"] for i in items}) or real_replay(target, tokenizer, drafters, items, **kw)))
    else:
        real_prompt = evaluate.run_prompt
        monkeypatch.setattr(evaluate, "run_prompt", lambda *args: check({args[-1]}) or real_prompt(*args))
    argv = _eval_argv(tiny_target_dir, two_datasets, out, *(["--replay"] if replay else ["--no-baseline"]))
    if replay:
        with pytest.raises(RuntimeError, match="fell over"):
            main(argv)
    else:
        assert main(argv) == 1
    assert seen_on_disk and seen_on_disk[0] is not None, "nothing was written before the second dataset"
    report = json.loads(out.read_text())
    assert list(report["datasets"]) == [first]
    assert [r["id"] for r in report["outputs"]] == ["first0", "first1"]
    assert report["datasets"][first]["modes"]["block"]["steps"] > 0
    assert report["config"]["target_quantize"] == "none"
    assert f"| {first} | block |" in out.with_suffix(".md").read_text()
    if not replay:
        assert report["failed"] == {"mode": "block", "dataset": second, "prompt": "second0",
                                    "error": "RuntimeError: the machine fell over"}


def test_eval_finishes_with_every_dataset_and_shows_a_progress_bar(tiny_target_dir, two_datasets, tmp_path, capsys):
    first, second = map(str, two_datasets[1])
    out = tmp_path / "e.json"
    assert main(_eval_argv(tiny_target_dir, two_datasets, out, "--no-baseline", "--limit", "1")) == 0
    err = capsys.readouterr().err
    assert f"{first}: 100%" in err and f"{second}: 100%" in err and "1/1" in err, err
    assert list(json.loads(out.read_text())["datasets"]) == [first, second]
    assert main(_eval_argv(tiny_target_dir, two_datasets, out, "--no-baseline", "--limit", "1", "--no-progress",
                           "--overwrite")) == 0
    err = capsys.readouterr().err
    assert f"{first}:" not in err and f"{second}:" not in err, err


def test_eval_replay_shows_a_progress_bar_per_dataset(tiny_target_dir, two_datasets, tmp_path, capsys):
    first, second = map(str, two_datasets[1])
    out = tmp_path / "r.json"
    assert main(_eval_argv(tiny_target_dir, two_datasets, out, "--replay", "--limit", "2")) == 0
    err = capsys.readouterr().err
    # every turn generated, then replayed: 2 prompts of one turn -> 4 of 4
    assert f"{first} (replay): 100%" in err and f"{second} (replay): 100%" in err and "4/4" in err, err
    assert main(_eval_argv(tiny_target_dir, two_datasets, out, "--replay", "--limit", "2", "--no-progress",
                           "--overwrite")) == 0
    assert "(replay)" not in capsys.readouterr().err
