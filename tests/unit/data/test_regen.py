"""`dflash-train regen`: the target's own greedy answers, multi-turn feedback, bad rows, kill -9 and
resume (byte-identical), torn lines, the settings guard, OpenAI batch export/import, built-in sets.
Real tiny models, no mocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main
from dflash_train.data.formats import to_messages
from dflash_train.data.regen import batch_api
from dflash_train.data.regen.inputs import RegenSettings
from dflash_train.data.regen.journal import SettingsMismatch
from dflash_train.data.regen.local import LocalGenerator, regenerate
from dflash_train.data.regen.roundtrip import batch_roundtrip

STOPS = [2, 0]  # SmolLM2's <|im_end|>, <|endoftext|> (dflash_target.json of the tiny target)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from dflash_train.target.capture import load_target_model, load_tokenizer

    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    return model, load_tokenizer(tiny_target_dir)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def reference_answer(model, tok, messages: list[dict], max_new: int) -> list[int]:
    """The target's own greedy continuation of one prompt, unpadded, up to and including a stop token."""
    from transformers import GenerationConfig

    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=STOPS, pad_token_id=2)
    with torch.no_grad():
        new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, ids.shape[1]:]
    new = new.tolist()
    cut = next((j for j, t in enumerate(new) if t in STOPS), None)
    return new if cut is None else new[: cut + 1]


def decode(tok, toks: list[int]) -> str:
    return tok.decode([t for t in toks if t not in STOPS], skip_special_tokens=True)


PROMPTS = ["Hi", "Explain rotary position embeddings in two sentences, please.", "What is 2 + 2?",
           "Write a haiku about the sea and the wind and the long grey evening light."]


def test_greedy_equals_target_generate(tmp_path, tiny, tiny_target_dir):
    model, tok = tiny
    max_new = 12
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    # token for token: one left-padded batch against each prompt generated alone
    gen = LocalGenerator(model, tok, stop_token_ids=STOPS, max_new_tokens=max_new, temperature=0.0, top_p=1.0, seed=0)
    batched = gen.generate([gen.prompt_ids(c) for c in chats])
    refs = [reference_answer(model, tok, c, max_new) for c in chats]
    assert batched == refs
    # the file: {prompt} and {prompt, response} rows, the response replaced by the target's own answer
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1], "response": "OLD"},
                                              {"prompt": PROMPTS[2]}, {"prompt": PROMPTS[3]}])
    out = tmp_path / "out.jsonl"
    s = regenerate(tiny_target_dir, [str(data)], out, RegenSettings(max_new_tokens=max_new, batch_size=4, progress=False),
                   model=model, tokenizer=tok)
    assert s["rows_written"] == 4 and not s["rejected"] and s["new_tokens"] == sum(len(r) for r in refs)
    rows = {r["id"]: r for r in read_jsonl(out)}
    for i, (p, ref) in enumerate(zip(PROMPTS, refs)):
        assert rows[f"{data}:{i + 1}"]["messages"] == [{"role": "user", "content": p},
                                                       {"role": "assistant", "content": decode(tok, ref)}]
    # processing order: longest prompt first
    assert [r["id"] for r in read_jsonl(out)][0] == f"{data}:4"


@pytest.mark.long  # ~50 s on 2 cores: continuous batching's scheduler is slow on a CPU
def test_the_continuous_engine_writes_the_same_file_as_padded_generate(tmp_path, tiny, tiny_target_dir):
    """`--engine continuous` (transformers' continuous batching: no padding, each row leaves at its stop token)
    answers every turn as the target's own unpadded greedy generate does, so a multi-turn file comes out byte for
    byte as with the padded engine. A model of its own: continuous batching switches its attention to paged."""
    from dflash_train.target.capture import load_target_model

    model, tok = tiny
    own = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    max_new = 10
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    gen = LocalGenerator(own, tok, stop_token_ids=STOPS, max_new_tokens=max_new, temperature=0.0, top_p=1.0, seed=0,
                         engine="continuous")
    assert gen.generate([gen.prompt_ids(c) for c in chats]) == [reference_answer(model, tok, c, max_new) for c in chats]

    rows = [{"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "OLD"},
                          {"role": "user", "content": "Another one?"}]}] + [{"prompt": p} for p in PROMPTS]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    outs = {}
    for engine, m in (("generate", model), ("continuous", own)):
        outs[engine] = tmp_path / f"{engine}.jsonl"
        s = regenerate(tiny_target_dir, [str(data)], outs[engine], RegenSettings(
            max_new_tokens=max_new, batch_size=8, progress=False, engine=engine), model=m, tokenizer=tok)
        assert s["rows_written"] == len(rows)
    assert outs["continuous"].read_bytes() == outs["generate"].read_bytes()


def test_the_continuous_engine_refuses_sampling_before_loading_anything(tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi"}])
    out = tmp_path / "out.jsonl"
    assert main(["regen", "--target", str(tmp_path / "no-such-model"), "--data", str(data), "--out", str(out),
                 "--engine", "continuous", "--temperature", "0.7"]) == 2
    err = capsys.readouterr().err
    assert "--engine continuous generates greedily only" in err and "--temperature is 0.7" in err
    assert "Traceback" not in err and not out.exists()


def test_multi_turn_feeds_back_own_answers(tmp_path, tiny, tiny_target_dir):
    model, tok = tiny
    max_new = 8
    conv = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "OLD ONE"},
                         {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "OLD TWO"},
                         {"role": "user", "content": "And a third, please."}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Count to three."}, {"from": "gpt", "value": "OLD"},
                                  {"from": "human", "value": "Now backwards."}, {"from": "gpt", "value": "OLD"}]}
    data = write_jsonl(tmp_path / "mt.jsonl", [conv, sharegpt, {"prompt": "Hello"}])
    out = tmp_path / "out.jsonl"
    regenerate(tiny_target_dir, [str(data)], out, RegenSettings(max_new_tokens=max_new, batch_size=3, progress=False),
               model=model, tokenizer=tok)
    rows = {r["id"]: r["messages"] for r in read_jsonl(out)}
    for i, row in enumerate([conv, sharegpt, {"prompt": "Hello"}]):
        src = to_messages(row)
        expected = [m for m in src[:1] if m["role"] == "system"]
        for m in src:
            if m["role"] == "user":
                expected.append(m)
                expected.append({"role": "assistant", "content": decode(tok, reference_answer(model, tok, expected, max_new))})
        assert rows[f"{data}:{i + 1}"] == expected
    assert "OLD" not in out.read_text()


def test_bad_rows_reported_good_rows_kept(tmp_path, tiny_target_dir, capsys):
    long_prompt = " ".join(["word"] * 200)
    data = tmp_path / "messy.jsonl"
    data.write_bytes(b"\n".join([
        json.dumps({"prompt": "good one"}).encode(),                                     # 1
        b'{"prompt": "broken',                                                            # 2
        b'{"prompt": "\xff\xfe bad bytes"}',                                              # 3
        json.dumps({"text": "no known keys"}).encode(),                                   # 4
        json.dumps({"messages": [{"role": "user", "content": "  "}]}).encode(),            # 5
        json.dumps({"messages": [{"role": "assistant", "content": "first"}]}).encode(),    # 6
        json.dumps({"prompt": long_prompt}).encode(),                                     # 7
        json.dumps({"conversations": [{"from": "human", "value": "good two"}]}).encode(),  # 8
    ]) + b"\n")
    out = tmp_path / "out.jsonl"
    rc = main(["regen", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(out),
               "--max-new-tokens", "4", "--max-prompt-tokens", "60", "--no-progress"])
    assert rc == 0
    report = capsys.readouterr().out
    assert sorted(r["id"] for r in read_jsonl(out)) == [f"{data}:1", f"{data}:8"]
    rejects = {r["id"]: r["reason"] for r in read_jsonl(tmp_path / "out.jsonl.rejects.jsonl")}
    assert rejects == {f"{data}:2": "invalid JSON", f"{data}:3": "not UTF-8", f"{data}:4": "unknown shape",
                       f"{data}:5": "empty turn", f"{data}:6": "bad turn order", f"{data}:7": "prompt too long"}
    assert "2 conversations written" in report and "6 rejected" in report
    for where, reason in rejects.items():
        assert f"rejected {where}: {reason}" in report


def _cli(data: Path, out: Path, target: Path, *extra: str, max_new: int = 6) -> list[str]:
    return ["regen", "--target", str(target), "--data", str(data), "--out", str(out), "--max-new-tokens", str(max_new),
            "--batch-size", "2", "--no-progress", *extra]


def _rows(n: int) -> list:
    rows: list = [{"prompt": f"Question {i}: " + "tell me more " * (i % 5)} for i in range(n)]
    rows[3] = "{not json"
    return rows


def test_kill_9_then_resume_is_byte_identical(tmp_path, tiny, tiny_target_dir):
    model, tok = tiny
    data = write_jsonl(tmp_path / "data.jsonl", _rows(40))
    ref = tmp_path / "ref.jsonl"
    settings = RegenSettings(max_new_tokens=8, batch_size=2, progress=False)
    regenerate(tiny_target_dir, [str(data)], ref, settings, model=model, tokenizer=tok)

    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(tmp_path / "child.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_train", *_cli(data, out, tiny_target_dir, max_new=8)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "child.log").read_text()[-2000:]
    written = out.read_bytes().count(b"\n")
    assert 2 <= written < 39, f"kill not mid-run ({written} rows written)"

    s = regenerate(tiny_target_dir, [str(data)], out, settings, model=model, tokenizer=tok)
    assert s["already_done"] >= 2 and s["rows_written"] + s["already_done"] == 39
    assert out.read_bytes() == ref.read_bytes()
    assert (tmp_path / "out.jsonl.rejects.jsonl").read_bytes() == (tmp_path / "ref.jsonl.rejects.jsonl").read_bytes()
    ids = [r["id"] for r in read_jsonl(out)]
    assert len(ids) == len(set(ids)) == 39


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_torn_last_line_and_partial_batch(tmp_path, tiny, tiny_target_dir, temperature):
    model, tok = tiny
    data = write_jsonl(tmp_path / "data.jsonl", _rows(7))
    settings = RegenSettings(max_new_tokens=5, batch_size=2, temperature=temperature, top_p=0.9, seed=3, progress=False)
    ref = tmp_path / "ref.jsonl"
    regenerate(tiny_target_dir, [str(data)], ref, settings, model=model, tokenizer=tok)
    out = tmp_path / "out.jsonl"
    regenerate(tiny_target_dir, [str(data)], out, settings, model=model, tokenizer=tok)
    lines = out.read_bytes().splitlines(keepends=True)
    # cut inside a batch (3 complete rows, then half of the 4th): a torn write
    out.write_bytes(b"".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    s = regenerate(tiny_target_dir, [str(data)], out, settings, model=model, tokenizer=tok)
    assert s["already_done"] == 3 and s["rows_written"] == 3
    assert out.read_bytes() == ref.read_bytes()
    # a damaged line that is not the last one is an error, not silently dropped
    out.write_bytes(lines[0] + b"garbage\n" + lines[1])
    with pytest.raises(ValueError, match="not a valid record"):
        regenerate(tiny_target_dir, [str(data)], out, settings, model=model, tokenizer=tok)


def test_settings_mismatch_refused(tmp_path, tiny_target_dir, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "hi"}, {"prompt": "hello there"}])
    out = tmp_path / "out.jsonl"
    assert main(_cli(data, out, tiny_target_dir, "--limit", "1")) == 0
    before = out.read_bytes()
    assert main(_cli(data, out, tiny_target_dir, "--temperature", "0.7")) == 2
    err = capsys.readouterr().err
    assert "other settings" in err and "temperature: 0.0 there, 0.7 now" in err
    assert main(_cli(data, out, tiny_target_dir, "--thinking", "false")) == 2
    assert out.read_bytes() == before
    # --limit and --batch-size may change: the run continues
    assert main(_cli(data, out, tiny_target_dir, "--batch-size", "1")) == 0
    assert len(read_jsonl(out)) == 2 and out.read_bytes().startswith(before)
    # an output without its settings sidecar is never extended
    (tmp_path / "out.jsonl.regen.json").unlink()
    with pytest.raises(SettingsMismatch, match="settings it was produced with are unknown"):
        regenerate(tiny_target_dir, [str(data)], out, RegenSettings(max_new_tokens=6, progress=False))


def test_the_embedded_target_is_recorded_by_name_so_another_machine_continues(tmp_path, smollm2_dir, capsys):
    """The embedded default's conversion folder is named after the GGUF file's modification time, which another
    machine or a reinstall changes: the settings record `smollm2`, and an older output that recorded this
    machine's folder still continues; one made from another target is refused, naming both."""
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": p} for p in ("hi", "hello there", "Name a fruit.")])
    out = tmp_path / "out.jsonl"
    sidecar = tmp_path / "out.jsonl.regen.json"
    assert main(_cli(data, out, "smollm2", "--limit", "1", max_new=2)) == 0
    record = json.loads(sidecar.read_text())
    assert record["settings"]["target"] == "smollm2"

    record["settings"]["target"] = str(smollm2_dir)  # as an older version wrote it, on this machine
    sidecar.write_text(json.dumps(record))
    assert main(_cli(data, out, "smollm2", "--limit", "2", max_new=2)) == 0
    assert len(read_jsonl(out)) == 2

    before = out.read_bytes()
    record["settings"]["target"] = "/elsewhere/targets/SmolLM2-135M-Instruct.Q4_1-0123456789abcdef"
    sidecar.write_text(json.dumps(record))
    assert main(_cli(data, out, "smollm2", max_new=2)) == 2
    err = capsys.readouterr().err
    assert "target: '/elsewhere/targets/SmolLM2-135M-Instruct.Q4_1-0123456789abcdef' there, 'smollm2' now" in err
    assert out.read_bytes() == before


def _response(cid: str, content: str | None = None, status: int = 200) -> dict:
    if content is None:
        return {"id": "x", "custom_id": cid, "response": None, "error": {"code": "boom", "message": "engine died"}}
    return {"id": "x", "custom_id": cid, "error": None,
            "response": {"status_code": status, "request_id": "r", "body": {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}}}


def test_batch_export_import_rounds(tmp_path, capsys):
    single = {"prompt": "One question."}
    multi = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "First?"},
                          {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "Second?"}]}
    failing, missing = {"prompt": "Fails once."}, {"prompt": "Never answered."}
    data = write_jsonl(tmp_path / "d.jsonl", [single, multi, "oops", failing, missing])
    ids = [f"{data}:{i}" for i in (1, 2, 3, 4, 5)]
    b1 = tmp_path / "b1.jsonl"
    assert main(["regen", "--data", str(data), "--export-batch", str(b1), "--model", "my-model",
                 "--max-new-tokens", "64", "--thinking", "false"]) == 0
    reqs = read_jsonl(b1)
    assert [r["custom_id"] for r in reqs] == [f"{ids[0]}#turn0", f"{ids[1]}#turn0", f"{ids[3]}#turn0", f"{ids[4]}#turn0"]
    assert reqs[1] == {"custom_id": f"{ids[1]}#turn0", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "my-model", "messages": [{"role": "system", "content": "sys"},
                                                                  {"role": "user", "content": "First?"}],
                                "max_tokens": 64, "temperature": 0.0, "top_p": 1.0,
                                "chat_template_kwargs": {"enable_thinking": False}}}
    # what `vllm run-batch` would write: answers for 3 of 4, one of them an error; plus a broken line
    r1 = write_jsonl(tmp_path / "r1.jsonl", [_response(f"{ids[0]}#turn0", "A single"),
                                             _response(f"{ids[1]}#turn0", "A first"),
                                             _response(f"{ids[3]}#turn0", None), "{truncated"])
    out = tmp_path / "conv.jsonl"
    # import only: complete rows written, failures and missing answers reported, the 2-turn row waits
    s = batch_roundtrip([str(data)], imports=[r1], out=out)
    assert s["rows_written"] == 1 and s["waiting"] == 1
    assert s["rejected"] == {"invalid JSON": 1, "batch error": 1, "missing response": 1, "unreadable response line": 1}
    rejects = {r["id"]: r for r in read_jsonl(tmp_path / "conv.jsonl.rejects.jsonl")}
    assert "engine died" in rejects[ids[3]]["detail"] and rejects[ids[4]]["reason"] == "missing response"
    # round 2: import again and export the next turn (with the imported first answer) and the retries
    b2 = tmp_path / "b2.jsonl"
    assert main(["regen", "--data", str(data), "--import-batch", str(r1), "--export-batch", str(b2),
                 "--out", str(out), "--model", "my-model", "--max-new-tokens", "64", "--thinking", "false"]) == 0
    reqs2 = {r["custom_id"]: r["body"]["messages"] for r in read_jsonl(b2)}
    assert set(reqs2) == {f"{ids[1]}#turn1", f"{ids[3]}#turn0", f"{ids[4]}#turn0"}
    assert reqs2[f"{ids[1]}#turn1"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "First?"},
                                        {"role": "assistant", "content": "A first"}, {"role": "user", "content": "Second?"}]
    r2 = write_jsonl(tmp_path / "r2.jsonl", [_response(f"{ids[1]}#turn1", "A second"),
                                             _response(f"{ids[3]}#turn0", "A retry"),
                                             _response(f"{ids[4]}#turn0", "A late")])
    s = batch_roundtrip([str(data)], imports=[r1, r2], export_path=tmp_path / "b3.jsonl", out=out, model_name="m")
    assert s["requests"] == 0 and s["already_done"] == 1 and s["rows_written"] == 3
    rows = {r["id"]: r["messages"] for r in read_jsonl(out)}
    assert rows == {
        ids[0]: [{"role": "user", "content": "One question."}, {"role": "assistant", "content": "A single"}],
        ids[1]: [{"role": "system", "content": "sys"}, {"role": "user", "content": "First?"},
                 {"role": "assistant", "content": "A first"}, {"role": "user", "content": "Second?"},
                 {"role": "assistant", "content": "A second"}],
        ids[3]: [{"role": "user", "content": "Fails once."}, {"role": "assistant", "content": "A retry"}],
        ids[4]: [{"role": "user", "content": "Never answered."}, {"role": "assistant", "content": "A late"}],
    }
    for msgs in rows.values():
        assert to_messages({"messages": msgs}) == msgs  # what prepare reads
    assert batch_api.split_custom_id(f"{ids[1]}#turn1") == (ids[1], 1)


def test_builtin_mtbench_multi_turn(tmp_path, tiny, tiny_target_dir):
    model, tok = tiny
    out = tmp_path / "mt.jsonl"
    s = regenerate(tiny_target_dir, ["mt-bench"], out, RegenSettings(max_new_tokens=4, limit=2, progress=False),
                   model=model, tokenizer=tok)
    rows = read_jsonl(out)
    assert s["rows_written"] == 2 and sorted(r["id"] for r in rows) == ["mt-bench:81", "mt-bench:82"]
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]  # MT-Bench: two turns, both answered
        assert to_messages(r) == r["messages"]


def test_max_turns_answers_only_the_first_turns_and_is_part_of_the_settings(tmp_path, tiny, tiny_target_dir, capsys):
    model, tok = tiny
    out = tmp_path / "first.jsonl"
    regenerate(tiny_target_dir, ["mt-bench"], out, RegenSettings(max_new_tokens=4, limit=2, max_turns=1,
                                                                  progress=False), model=model, tokenizer=tok)
    rows = read_jsonl(out)
    assert len(rows) == 2 and all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    # The same answers as the first turn of a full regen (greedy): a cut, not another generation.
    full = tmp_path / "full.jsonl"
    regenerate(tiny_target_dir, ["mt-bench"], full, RegenSettings(max_new_tokens=4, limit=2, progress=False),
               model=model, tokenizer=tok)
    assert [r["messages"] for r in rows] == [r["messages"][:2] for r in read_jsonl(full)]
    # Continuing the output with another turn count is refused, naming the setting.
    from dflash_train.cli import main

    assert main(["regen", "--target", str(tiny_target_dir), "--data", "mt-bench", "--limit", "2",
                 "--max-new-tokens", "4", "--out", str(out), "--no-progress"]) == 2
    assert "max_turns" in capsys.readouterr().err


def test_token_batches_partition_in_order_within_both_bounds_and_greedily():
    import random

    from dflash_train.data.regen.local import token_batches

    rng = random.Random(0)
    for _ in range(300):
        lengths = sorted((rng.randint(1, 60) for _ in range(rng.randint(0, 40))), reverse=rng.random() < 0.8)
        rows, budget, new = rng.randint(1, 12), rng.choice([0, rng.randint(1, 400)]), rng.randint(0, 20)
        slices = token_batches(lengths, rows, budget, new)
        assert [i for s in slices for i in s] == list(range(len(lengths)))  # every prompt once, in order

        def width(s):
            return len(s) * (max(lengths[i] for i in s) + new)

        for n, s in enumerate(slices):
            assert 1 <= len(s) <= rows
            assert not budget or len(s) == 1 or width(s) <= budget
            if n + 1 < len(slices):  # greedy: the next prompt would have broken a bound
                grown = range(s.start, s.stop + 1)
                assert len(grown) > rows or (budget and width(grown) > budget)


def test_a_token_budget_splits_generate_calls_and_keeps_the_answers(tmp_path, tiny, tiny_target_dir):
    """Calls within the budget (their padded width seen at the real model's generate), the same greedy answers
    and the same file as one call per batch."""
    model, tok = tiny
    max_new = 6
    prompts = PROMPTS + ["Tell me a story about a cat who learned to fly over the mountains.", "Ok"]
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompts])
    widths: list[tuple[int, int]] = []
    real_generate = model.generate

    def recording_generate(*args, **kwargs):
        widths.append(tuple(kwargs["input_ids"].shape))
        return real_generate(*args, **kwargs)

    files = []
    for budget in (0, 90):
        widths.clear()
        model.generate = recording_generate
        try:
            out = tmp_path / f"out{budget}.jsonl"
            regenerate(tiny_target_dir, [str(data)], out,
                       RegenSettings(max_new_tokens=max_new, batch_size=6, batch_tokens=budget, progress=False),
                       model=model, tokenizer=tok)
        finally:
            del model.generate
        files.append(out.read_bytes())
        if budget:
            assert len(widths) > 1 and all(rows * (w + max_new) <= budget or rows == 1 for rows, w in widths)
        else:
            assert [rows for rows, _ in widths] == [6]
    assert files[0] == files[1]
    gen = LocalGenerator(model, tok, stop_token_ids=STOPS, max_new_tokens=max_new, temperature=0.0, top_p=1.0, seed=0,
                         batch_tokens=60)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    assert gen.generate([gen.prompt_ids(c) for c in chats]) == [reference_answer(model, tok, c, max_new) for c in chats]
