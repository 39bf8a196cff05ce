"""Rejected rows of raw data at start: one log line per reason with the first ids, and every row in a
`rejects.jsonl` of the same shape `prepare` writes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from dflash_train.cli import main
from dflash_train.config.load import config_from_dict
from dflash_train.data.dataset import NO_ASSISTANT, TOO_FEW, load_dataset
from dflash_train.data.rejects import EXAMPLES
from dflash_train.data.source import open_training_data, open_validation_data
from dflash_train.target.capture import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    return load_tokenizer(tiny_target_dir)


def _good(i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"Tell me about item {i}."},
                                    {"role": "assistant", "content": f"Item {i} is " + "very " * 30 + "good."}]})


BAD = {  # reason -> a row with it
    NO_ASSISTANT: json.dumps({"prompt": "Only a question?"}),
    "invalid JSON": '{"messages": [',
    TOO_FEW: json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}]}),
    "unknown role": json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}),
}
PATTERN = [NO_ASSISTANT, "invalid JSON", NO_ASSISTANT, TOO_FEW, "unknown role", NO_ASSISTANT, "invalid JSON"]


def _mixed(path: Path, n_good: int = 12, n_bad: int = 28) -> tuple[Path, int, list[tuple[str, str]]]:
    """Good rows with bad ones between them; returns the file, its good-row count and every (where, reason)."""
    lines, expected = [], []
    for i in range(n_good + n_bad):
        if i % 10 < 3:
            lines.append(_good(i))
        else:
            reason = PATTERN[len(expected) % len(PATTERN)]
            lines.append(BAD[reason])
            expected.append((f"{path}:{i + 1}", reason))
    assert len(expected) == n_bad
    path.write_text("\n".join(lines) + "\n")
    return path, len(lines) - n_bad, expected


def _summary_lines(caplog, what: str) -> dict[str, str]:
    """reason -> its summary line (failing on a second line for one reason)."""
    found: dict[str, str] = {}
    for r in caplog.records:
        msg = r.getMessage()
        prefix = f"rows of {what}: "
        if prefix in msg and msg.startswith("rejected "):
            reason = msg.split(prefix, 1)[1].rsplit(" (", 1)[0]
            assert reason not in found, f"two summary lines for {reason}"
            found[reason] = msg
    return found


def test_rejects_are_summarised_per_reason_and_all_listed(tok, tmp_path, caplog):
    data, n_good, expected = _mixed(tmp_path / "mixed.jsonl")
    rejects = tmp_path / "run" / "rejects.jsonl"
    rejects.parent.mkdir()
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        ds = load_dataset([str(data)], tok, max_length=512, block_size=8, rejects_path=rejects)

    assert len(ds) == n_good
    kept = [tok.decode(e.input_ids) for e in ds.examples]
    good_items = [i for i in range(40) if i % 10 < 3]
    assert all(f"item {i}." in text for i, text in zip(good_items, kept))

    assert not [r for r in caplog.records if "skipping" in r.getMessage()]
    lines = _summary_lines(caplog, str(data))
    assert set(lines) == set(BAD)
    for reason, line in lines.items():
        wheres = [w for w, r in expected if r == reason]
        assert f"rejected {len(wheres)} of {n_good + len(expected)} rows" in line, line
        shown = line.rsplit(" (", 1)[1].rstrip(")").split(", ")
        assert [w for w in shown if w != "..."] == wheres[:EXAMPLES], line
        assert line.endswith(", ...)") == (len(wheres) > EXAMPLES), line
    total = [r.getMessage() for r in caplog.records if "in all" in r.getMessage()]
    assert len(total) == 1 and f"rejected {len(expected)} of" in total[0] and str(rejects) in total[0]
    assert len([r for r in caplog.records if r.getMessage().startswith("rejected ")]) == len(BAD) + 1

    records = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(r["where"], r["reason"]) for r in records] == expected
    assert all(set(r) == {"where", "reason", "detail"} for r in records)
    assert all(r["detail"] for r in records if r["reason"] != NO_ASSISTANT)
    assert sorted(p.name for p in rejects.parent.iterdir()) == ["rejects.jsonl"]  # no temp file left


def test_without_a_path_only_the_summary_is_logged(tok, tmp_path, caplog):
    data, n_good, expected = _mixed(tmp_path / "mixed.jsonl", n_good=3, n_bad=2)
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        ds = load_dataset([str(data)], tok, max_length=512, block_size=8)
    assert len(ds) == n_good and sum(ds.rejected.values()) == len(expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.jsonl"]
    assert "skipping" not in caplog.text and "not written to a file" in caplog.text
    assert set(_summary_lines(caplog, str(data))) == {reason for _, reason in expected}


def test_training_data_lists_the_rejects_of_every_raw_entry(tok, tiny_target_dir, tmp_path, caplog):
    a, n_a, bad_a = _mixed(tmp_path / "a.jsonl")
    b, n_b, bad_b = _mixed(tmp_path / "b.jsonl", n_good=6, n_bad=14)
    cfg = config_from_dict({"target": {"path": str(tiny_target_dir)}, "drafter": {"block_size": 8},
                            "data": {"train_files": [str(a), str(b)], "val_files": [str(b)], "max_length": 512}})
    rejects = tmp_path / "rejects.jsonl"
    rejects.write_text("a stale list of an earlier start\n")
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        data = open_training_data(cfg, tok, 8, rejects)
    assert len(data) == n_a + n_b
    assert [(r["where"], r["reason"]) for r in map(json.loads, rejects.read_text().splitlines())] == bad_a + bad_b
    assert set(_summary_lines(caplog, str(a))) == set(_summary_lines(caplog, str(b))) == set(BAD)
    val_rejects = tmp_path / "rejects-val.jsonl"
    assert len(open_validation_data(cfg, tok, 8, val_rejects)) == n_b
    assert [(r["where"], r["reason"]) for r in map(json.loads, val_rejects.read_text().splitlines())] == bad_b


@pytest.mark.long  # ~12 s: a whole run
def test_a_train_start_writes_rejects_jsonl_in_the_run_directory(tiny_target_dir, tmp_path):
    from conftest import counting_conversations

    good = [json.dumps(r) for r in counting_conversations(16)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(good[:8] + [BAD[NO_ASSISTANT]] + good[8:] + [BAD["invalid JSON"]]) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(bad)], "max_length": 256, "token_budget": 1024},
        "run": {"device": "cpu", "progress_bar": False, "eval_every": 0},
    }))
    run = tmp_path / "R"
    assert main(["train", str(cfg), "--run-dir", str(run), "--max-steps", "1"]) == 0
    records = [json.loads(line) for line in (run / "rejects.jsonl").read_text().splitlines()]
    assert [(r["where"], r["reason"]) for r in records] == [(f"{bad}:9", NO_ASSISTANT), (f"{bad}:18", "invalid JSON")]
    log = (run / "train.log").read_text()
    assert f"every one with its reason in {run / 'rejects.jsonl'}" in log and "skipping" not in log
