"""A reduced draft vocabulary (`drafter.draft_vocab_size`): label counts from `prepare`, the vocabulary chosen from
them, the drafter's own head, the loss with labels outside the vocabulary (against a float64 brute force),
lossless decoding and replay, the export vLLM reads, and the config's refusals."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

from dflash_train.errors import ResourceError
from dflash_train.architectures import architecture
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.config import drafter_config_from_dict, make_drafter_config
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.dflash.objective import DFlashObjective
from dflash_train.cli import main
from dflash_train.config.load import config_from_dict
from dflash_train.config.validate import validate_against_target
from dflash_train.data.batch import Batch
from dflash_train.data.label_counts import COUNTS_FILE, draft_vocabulary
from dflash_train.commands.prepare import PrepareConfig, prepare, summary
from dflash_train.data.source import open_training_data, require_label_counts
from dflash_train.data.store import PreparedDataset, read_label_counts
from dflash_train.errors import ConfigError
from dflash_train.commands.export import export_checkpoint
from dflash_train.infer.replay import ReplayTurn, greedy_continuations, replay_turn
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.target.capture import TargetCapture, load_target_model, load_tokenizer
from dflash_train.train.plan import preflight
from dflash_train.train.start.drafter_session import choose_draft_vocabulary
from _harness import write_config
from _memorise import memorise


STOPS = [2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target_dir, counting_jsonl) -> Path:
    out = tmp_path_factory.mktemp("prep") / "counting"
    prepare(load_tokenizer(tiny_target_dir), str(tiny_target_dir), [str(counting_jsonl)], out,
            PrepareConfig(max_length=256, block_size=4, val_fraction=0.2, shard_rows=16))
    return out


@pytest.fixture(scope="module")
def target64(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))


def _drafter(target, block_size: int, vocab: torch.Tensor, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = make_drafter_config(target.config, num_draft_layers=1, block_size=block_size, target_layer_ids=[1, 4],
                              mask_token_id=16, draft_vocab_size=len(vocab))
    drafter = DFlashDrafter(cfg).to(target.dtype)
    drafter.set_draft_vocabulary(vocab, target.get_output_embeddings().weight)
    return drafter


# ------------------------------------------------------------------------------------------ counting


def test_prepare_counts_the_train_split_labels_and_gives_the_same_bytes(prepared, tiny_target_dir, counting_jsonl,
                                                                         tmp_path):
    manifest = json.loads((prepared / "manifest.json").read_text())
    counts = read_label_counts(prepared, manifest)
    brute = Counter()
    for i in range(len(train := PreparedDataset(prepared, "train"))):
        ex = train.example(i)
        brute.update(int(t) for t, m in zip(ex.input_ids, ex.loss_mask) if m)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(brute)
    assert len(counts) == len(load_tokenizer(tiny_target_dir))
    val = manifest["splits"]["val"]
    assert val["rows"] > 0 and manifest["label_counts"]["labels"] == manifest["splits"]["train"]["supervised_tokens"]
    assert f"labels: {len(brute)} distinct tokens" in summary(manifest, prepared)
    again = tmp_path / "again"
    prepare(load_tokenizer(tiny_target_dir), str(tiny_target_dir), [str(counting_jsonl)], again,
            PrepareConfig(max_length=256, block_size=4, val_fraction=0.2, shard_rows=16))
    assert (again / COUNTS_FILE).read_bytes() == (prepared / COUNTS_FILE).read_bytes()


def test_the_vocabulary_is_the_most_frequent_tokens_ties_by_lower_id():
    counts = np.array([5, 3, 5, 0, 3, 7], dtype=np.int64)
    assert draft_vocabulary(counts, 3).tolist() == [0, 2, 5]
    assert draft_vocabulary(counts, 4).tolist() == [0, 1, 2, 5]  # 1 and 4 tie at 3: the lower id
    assert draft_vocabulary(counts, 6).tolist() == list(range(6))
    rng = np.random.default_rng(0)
    many = rng.integers(0, 4, size=300)  # many ties
    for n in (1, 17, 150, 300):
        brute = sorted(sorted(range(300), key=lambda i: (-many[i], i))[:n])
        assert draft_vocabulary(many, n).tolist() == brute
    for bad in (0, 7):
        with pytest.raises(ValueError, match="does not fit"):
            draft_vocabulary(counts, bad)


def test_the_head_starts_as_the_targets_rows_of_the_chosen_tokens(prepared, tiny_target_dir, target64):
    cfg = config_from_dict({"target": {"path": str(tiny_target_dir)},
                            "drafter": {"block_size": 4, "num_draft_layers": 1, "draft_vocab_size": 30},
                            "data": {"train_files": [str(prepared)], "max_length": 256, "token_budget": 1024}})
    data = open_training_data(cfg, load_tokenizer(tiny_target_dir), 4)
    head = target64.get_output_embeddings().weight
    dcfg = make_drafter_config(target64.config, num_draft_layers=1, block_size=4, target_layer_ids=[1, 4],
                               mask_token_id=16, draft_vocab_size=30)
    drafter = DFlashDrafter(dcfg).double()
    info = choose_draft_vocabulary(drafter, data, head)
    counts = read_label_counts(prepared, json.loads((prepared / "manifest.json").read_text()))
    want = sorted(sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:30])
    assert drafter.vocabulary_ids().tolist() == want
    assert torch.equal(drafter.d2t, torch.tensor(want) - torch.arange(30))
    assert torch.equal(drafter.lm_head.weight, head[want])
    assert info["draft_vocab_size"] == 30
    assert info["draft_vocab_label_coverage"] == pytest.approx(counts[want].sum() / counts.sum())


def test_a_prepared_dir_without_counts_is_refused_before_anything_is_written(prepared, tiny_target_dir, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for p in prepared.rglob("*"):
        if p.is_file() and p.name != COUNTS_FILE:
            (old / p.relative_to(prepared)).parent.mkdir(parents=True, exist_ok=True)
            (old / p.relative_to(prepared)).write_bytes(p.read_bytes())
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["label_counts"]  # as an older dflash-train wrote it
    (old / "manifest.json").write_text(json.dumps(manifest))
    cfg = {"target": {"path": str(tiny_target_dir)},
           "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa", "draft_vocab_size": 50},
           "data": {"train_files": [str(old)], "max_length": 256, "token_budget": 1024},
           "run": {"device": "cpu", "progress_bar": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=r"holds no label token counts.*re-run `dflash-train prepare.*"
                                         r"drafter.draft_vocab_size=0"):
        require_label_counts(config_from_dict(cfg))
    require_label_counts(config_from_dict(cfg, ["drafter.draft_vocab_size=0"]))  # the full vocabulary needs none
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(run)]) == 2
    assert not run.exists() or not any(run.iterdir())


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("overrides,match", [
    (["drafter.draft_vocab_size=-1"], r"must be an integer >= 0 \(0 = the target's vocabulary\), got -1"),
    (["drafter.architecture=dflash2", "drafter.draft_vocab_size=100"], "dflash only"),
    (["drafter.draft_vocab_size=100", "objective.distill_weight=0.5"], "distillation"),
])
def test_config_refusals_before_any_model_loads(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        config_from_dict({}, overrides)
    assert "drafter.draft_vocab_size" in str(e.value)


def test_a_kept_head_gradient_without_a_trained_head_is_refused():
    with pytest.raises(ConfigError, match=r"'objective.head_gradient'.*drafter.draft_vocab_size > 0"):
        config_from_dict({}, ["objective.head_gradient=keep"])
    assert config_from_dict({}, ["objective.head_gradient=keep", "drafter.draft_vocab_size=10"]).objective.head_gradient \
        == "keep"


def test_a_vocabulary_larger_than_the_targets_is_refused():
    cfg = config_from_dict({}, ["drafter.draft_vocab_size=1001"])
    with pytest.raises(ConfigError, match="larger than the target's vocabulary"):
        validate_against_target(cfg, 6, 1000)
    validate_against_target(config_from_dict({}, ["drafter.draft_vocab_size=1000"]), 6, 1000)


def test_an_exported_config_with_a_bad_draft_vocab_size_is_refused(target64):
    dcfg = make_drafter_config(target64.config, num_draft_layers=1, block_size=4, target_layer_ids=[1, 4],
                               mask_token_id=16, draft_vocab_size=8)
    data = DFlashDrafter(dcfg).config.to_dict()
    data["architectures"] = ["DFlashDraftModel"]
    for bad in (0, 49153, 2.5, True):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            drafter_config_from_dict({**data, "draft_vocab_size": bad})


def test_preflight_counts_the_drafters_own_head(target64):
    def params(n):
        return preflight.drafter_parameters(architecture("dflash"), make_drafter_config(
            target64.config, num_draft_layers=1, block_size=4, target_layer_ids=[1, 4], mask_token_id=16,
            draft_vocab_size=n))

    assert params(100) - params(0) == 100 * target64.config.hidden_size
    assert preflight.needed_bytes(0, torch.bfloat16, params(100), "drafter") - \
        preflight.needed_bytes(0, torch.bfloat16, params(0), "drafter") == 16 * 100 * 64


def test_preflight_counts_the_kept_head_gradient_rows(target64):
    """objective.head_gradient keep (and auto, the default, with a trained head) adds exactly [counted rows,
    draft_vocab_size] in the compute dtype; a plan short of memory is told that recompute saves it."""
    from dflash_train.train.plan import activation_memory as am

    dcfg = make_drafter_config(target64.config, num_draft_layers=1, block_size=4, target_layer_ids=[1, 4],
                               mask_token_id=16, draft_vocab_size=100)
    shape = am.MicroBatchShape(2, 64, 8, 4)
    parts = {}
    for how in ("recompute", "keep", "auto"):
        cfg = config_from_dict({}, ["drafter.draft_vocab_size=100", f"objective.head_gradient={how}"])
        settings = am.step_settings(cfg, target64.config, dcfg, [1, 4], torch.bfloat16, torch.bfloat16, "cuda", 0,
                                    architecture("dflash"))
        parts[how] = am.drafter_step_parts(dcfg, shape, settings)
    assert parts["keep"]["kept head gradient rows"] == shape.counted * 100 * 2
    assert sum(parts["keep"].values()) - sum(parts["recompute"].values()) == shape.counted * 100 * 2
    assert parts["auto"] == parts["keep"] and config_from_dict({}).objective.head_gradient == "auto"
    assert not config_from_dict({}).keeps_head_gradient  # the full vocabulary: the target's frozen head
    need = preflight.MemoryNeed(10, am.ActivationEstimate(parts["keep"], shape))
    with pytest.raises(ResourceError, match=r"objective.head_gradient=recompute saves the kept head gradient rows"):
        preflight.check_gpu(torch.device("cuda", 0), need, 0, "the test", free_memory=lambda d: (1, 2**34))
    need = preflight.MemoryNeed(10, am.ActivationEstimate(parts["recompute"], shape))
    with pytest.raises(ResourceError) as refused:
        preflight.check_gpu(torch.device("cuda", 0), need, 0, "the test", free_memory=lambda d: (1, 2**34))
    assert "head_gradient" not in str(refused.value)


# ------------------------------------------------------------------------------------------ the loss


def _brute_force(rows, blocks, idx, vocab: list[int], weight, slot_weighting: str, floor: float):
    """Float64 loss, hits per slot and outside count by loops over the counted slots."""
    position = {t: i for i, t in enumerate(vocab)}
    logp = torch.log_softmax(rows @ weight.t(), -1)
    labels = blocks.labels.reshape(-1)[idx].tolist()
    flat = idx.tolist()
    counted = blocks.counted
    b_, n_, bs = counted.shape
    ce, weights, hits, outside = [], [], torch.zeros(bs), 0
    row_of = {f: r for r, f in enumerate(flat)}
    for b in range(b_):
        for n in range(n_):
            reach = 1.0
            for k in range(bs):
                f = (b * n_ + n) * bs + k
                if not counted[b, n, k]:
                    continue
                r = row_of[f]
                draft = position.get(labels[r])
                w = float(blocks.weights[b, n, k]) if slot_weighting == "gamma" else max(reach, floor)
                if draft is None:
                    outside += 1
                    reach = 0.0
                    continue
                p = float(logp[r, draft].detach().exp())
                reach *= p
                ce.append(-logp[r, draft])
                weights.append(w)
                hits[k] += int(int(logp[r].argmax()) == draft)
    w = torch.tensor(weights, dtype=torch.float64)
    return (torch.stack(ce) * w).sum() / w.sum(), hits, outside


@pytest.mark.parametrize("slot_weighting,head_gradient", [("gamma", "recompute"), ("acceptance", "recompute"),
                                                          ("acceptance", "keep")])
def test_loss_hits_and_outside_share_against_a_float64_brute_force(target64, slot_weighting, head_gradient):
    """Also the head's weight gradient both ways: formed again in backward, or from the forward's kept rows."""
    g = torch.Generator().manual_seed(3)
    pool = torch.arange(100, 160)  # labels drawn from 60 tokens, 40 of them in the vocabulary
    vocab = pool[torch.randperm(60, generator=g)[:40]].sort().values
    drafter = _drafter(target64, 4, vocab)
    cfg = config_from_dict({"drafter": {"block_size": 4, "num_draft_layers": 1, "draft_vocab_size": 40},
                            "objective": {"max_anchors": 12, "slot_weighting": slot_weighting, "loss_chunk_size": 7,
                                          "head_gradient": head_gradient},
                            "data": {"max_length": 64, "token_budget": 256}})
    objective = DFlashObjective(drafter, TargetCapture.from_model(target64, [1, 4]),
                                resolve_backend("sdpa", torch.device("cpu"), 4), cfg, torch.float64)
    ids = pool[torch.randint(0, 60, (2, 40), generator=g)]
    mask = (torch.rand(2, 40, generator=g) < 0.8).long()
    batch = Batch(ids, mask, torch.tensor([40, 31]))
    stats = objective(batch, torch.Generator().manual_seed(5))
    stats.loss.backward()
    ours = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()

    blocks, idx = objective.plan_blocks(batch, torch.Generator().manual_seed(5))
    rows = objective.block_rows(batch, objective.target(batch.input_ids), blocks, idx, drafter)
    loss, hits, outside = _brute_force(rows, blocks, idx, vocab.tolist(), drafter.lm_head.weight, slot_weighting,
                                       cfg.objective.acceptance_floor)
    loss.backward()
    assert 0 < outside < len(idx)  # both kinds of label are there
    assert float(stats.loss.detach()) == pytest.approx(float(loss.detach()), rel=1e-10)
    assert stats.correct_per_slot.tolist() == hits.tolist()
    assert int(stats.counted_per_slot.sum()) == len(idx)  # an outside label stays in the denominator
    assert int(stats.extra["label_outside_draft_vocab"]) == outside
    for name, p in drafter.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert float(ours["lm_head.weight"].abs().sum()) > 0  # the head trains


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_the_kept_head_gradient_equals_the_recomputed_one(softcap):
    """objective.head_gradient keep against recompute, float64: the same loss and both gradients, with a score
    transform (multiplier and softcap) and labels outside the vocabulary; the kept rows are [M, V]."""
    from dflash_train.architectures.family.loss import CEOptions, chunked_weighted_ce

    g = torch.Generator().manual_seed(0)
    m, h, n = 23, 16, 40
    labels = torch.randint(0, n, (m,), generator=g)
    labels[::5] = -1
    weights = torch.rand(m, generator=g, dtype=torch.float64) + 0.1
    results = []
    for keep in (False, True):
        hidden = torch.randn(m, h, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()
        head = torch.randn(n, h, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
        out = chunked_weighted_ce(hidden, head, labels, weights, CEOptions(6, output_multiplier=1.5, softcap=softcap,
                                                                           unscored=True, keep_grad_logits=keep))
        out.loss.backward()
        results.append((out.loss.detach(), hidden.grad, head.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert results[1][2].abs().sum() > 0


def test_a_training_step_trains_the_head_and_keeps_the_vocabulary(target64):
    from dflash_train.train.loop.step import TrainStep

    vocab = torch.arange(100, 140)
    drafter = _drafter(target64, 4, vocab)
    cfg = config_from_dict({"drafter": {"block_size": 4, "num_draft_layers": 1, "draft_vocab_size": 40},
                            "objective": {"max_anchors": 8}, "data": {"max_length": 64, "token_budget": 256}})
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    target_head = target64.get_output_embeddings().weight.clone()
    step = TrainStep(drafter, TargetCapture.from_model(target64, [1, 4]),
                     resolve_backend("sdpa", torch.device("cpu"), 4), cfg, 10, torch.float64, torch.device("cpu"))
    ids = torch.randint(100, 150, (2, 40), generator=torch.Generator().manual_seed(0))
    stats = step(Batch(ids, torch.ones_like(ids), torch.tensor([40, 33])), 0)
    assert 0 < float(stats.extra["label_outside_draft_vocab"]) < float(stats.counted_per_slot.sum())
    changed = {k for k, v in drafter.state_dict().items() if not torch.equal(v, before[k])}
    assert "lm_head.weight" in changed and "d2t" not in changed
    assert torch.equal(target64.get_output_embeddings().weight, target_head)


# ------------------------------------------------------------------------------------------ decoding


@pytest.fixture(scope="module")
def memorised(target64):
    """(prompts, greedy continuations, a reduced-vocabulary drafter that knows most of them). Its vocabulary holds
    the sequences' tokens but a few of the continuations' (drafting those is impossible: forced misses)."""
    bs, max_new = 5, 20
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 19, 33)]
    conts = greedy_continuations(target64, prompts, max_new + bs - 1)
    seen = sorted({t for p, c in zip(prompts, conts) for t in p + c})
    left_out = set(sorted({t for c in conts for t in c[2:]})[::4])
    vocab = torch.tensor([t for t in seen if t not in left_out] + list(range(40000, 40010))).sort().values
    drafter = memorise(_drafter(target64, bs, vocab), target64, [p + c for p, c in zip(prompts, conts)], steps=12)
    return prompts, conts, drafter, left_out


def test_block_and_tree_decoding_stay_lossless_and_replay_agrees(target64, memorised):
    prompts, conts, drafter, left_out = memorised
    max_new = 20
    dec = SpeculativeDecoder(target64, drafter, stop_token_ids=STOPS)
    taus = []
    for i, (p, c) in enumerate(zip(prompts, conts)):
        ref = dec.generate_target_only(p, max_new).tokens
        assert ref == c[:len(ref)]
        real = {"block": dec.generate_block(p, max_new), "tree-3": dec.generate_tree(p, max_new, 3),
                "tree-8": dec.generate_tree(p, max_new, 8)}
        rep = replay_turn(target64, drafter, ReplayTurn("toy", str(i), 0, p, c), max_new, (3, 8), STOPS)
        for mode, res in real.items():
            assert res.tokens == ref, mode
            assert rep.modes[mode] == (res.tokens, res.accept_lengths), mode
        taus.append(real["block"].tau)
    assert max(taus) > 1.5 and any(t in left_out for c in conts for t in c[:max_new])


def test_drafts_and_sampling_distributions_are_over_target_ids(target64, memorised):
    _, _, drafter, _ = memorised
    vocab = drafter.vocabulary_ids()
    head = target64.get_output_embeddings()
    hidden = torch.randn(3, drafter.block_size, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    greedy, _ = drafter.draft(hidden, head, torch.zeros(3, dtype=torch.long))
    logits = drafter.logits(hidden, head)[:, 1:]
    assert torch.equal(greedy, vocab[logits.argmax(-1)])
    drafts, q = drafter.draft(hidden, head, torch.zeros(3, dtype=torch.long), temperature=0.7,
                              generator=torch.Generator().manual_seed(1))
    assert q.shape[-1] == head.weight.shape[0] and torch.isin(drafts, vocab).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(3, drafter.block_size - 1))
    torch.testing.assert_close(q[..., vocab], torch.softmax(logits / 0.7, -1))
    outside = torch.ones(q.shape[-1], dtype=torch.bool)
    outside[vocab] = False
    assert not q[..., outside].any()
    lp, top = drafter.tree_candidates(hidden, head, torch.zeros(3, dtype=torch.long), 4)
    assert torch.isin(top, vocab).all()
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).topk(4, -1).values)


# ------------------------------------------------------------------------------------------ export


def test_the_export_is_what_vllm_reads_and_loads_back(target64, memorised, tmp_path):
    _, _, drafter, _ = memorised
    n = drafter.draft_vocab_size
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    save_drafter(drafter, ckpt / "drafter", dtype="float32")  # as a checkpoint holds it
    out = export_checkpoint(ckpt, tmp_path / "export", "bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == n and config["vocab_size"] == 49152
    assert config["architectures"] == ["DFlashDraftModel"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        d2t, head = f.get_tensor("d2t"), f.get_tensor("lm_head.weight")
    assert {"d2t", "lm_head.weight", "fc.weight", "norm.weight"} <= names
    assert not any("embed" in k for k in names)
    assert d2t.dtype == torch.int64 and d2t.shape == (n,)
    assert head.dtype == torch.bfloat16 and head.shape == (n, 64)
    assert torch.equal(torch.arange(n) + d2t, drafter.vocabulary_ids())  # target id = draft id + d2t[draft id]
    assert torch.equal(head, drafter.lm_head.weight.to(torch.bfloat16))
    back = load_drafter(out)
    assert back.draft_vocab_size == n and torch.equal(back.vocabulary_ids(), drafter.vocabulary_ids())
    full = DFlashDrafter(make_drafter_config(target64.config, num_draft_layers=1, block_size=4,
                                             target_layer_ids=[1, 4], mask_token_id=16))
    save_drafter(full, tmp_path / "full")  # the target's vocabulary: nothing of the above in the files
    assert "draft_vocab_size" not in json.loads((tmp_path / "full" / "config.json").read_text())
    with safe_open(str(tmp_path / "full" / "model.safetensors"), framework="pt") as f:
        assert not {"d2t", "lm_head.weight"} & set(f.keys())


def test_a_d2t_that_maps_outside_the_vocabulary_is_refused(memorised, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, drafter, _ = memorised
    save_drafter(drafter, tmp_path / "d", dtype="float32")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    tensors["d2t"][-1] = 10**6
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t maps"):
        load_drafter(tmp_path / "d")
    tensors["d2t"] = tensors["d2t"].float()
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor d2t is torch.float32"):
        load_drafter(tmp_path / "d")


def test_train_export_and_eval_a_reduced_vocabulary_drafter(prepared, tiny_target_dir, tmp_path, capsys):
    """The whole path on the CLI: train on a prepared directory, the metric in metrics.jsonl, the export, and
    `eval` loading it (lossless against the target's own greedy output)."""
    write_config(tmp_path / "c.yaml", tiny_target_dir, prepared, drafter__draft_vocab_size=40,
                 data__token_budget=1024, data__max_batch_size=4, objective__gamma=config_from_dict({}).objective.gamma,
                 run__log_every=2, run__save_every=100, run__eval_every=0, run__export_dtype="float32")
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(run), "--max-steps", "4"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    shares = [r["label_outside_draft_vocab"] for r in records if "loss" in r]
    assert shares and all(0 <= s < 1 for s in shares) and all(math.isfinite(r["loss"]) for r in records)
    status = json.loads((run / "status.json").read_text())
    assert status["draft_vocab_size"] == 40 and 0 < status["draft_vocab_label_coverage"] <= 1
    exported = load_drafter(run / "export")
    assert exported.draft_vocab_size == 40
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "turns": ["Count from 3."]}) + "\n")
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(run / "export"), "--data", str(prompts),
                 "--out", str(out), "--max-new-tokens", "12", "--tree-budget", "4", "--no-baseline"]) == 0
    result = json.loads(out.read_text())
    assert "lossless" in capsys.readouterr().out
    assert result["datasets"][str(prompts)]["modes"]["block"]["tokens"] > 0


@pytest.mark.long
def test_two_ranks_train_the_head_together_and_resume_exactly(prepared, tiny_target_dir, tmp_path):
    """Two colocated gloo ranks (the head trained outside DDP's forward still all-reduces), stopped after a
    checkpoint and resumed: the resumed run logs the uninterrupted run's losses and keeps its vocabulary. A
    constant learning rate, so that the shorter first run's schedule is the longer one's."""
    from _harness import assert_same_losses, losses

    cfg = write_config(tmp_path / "c.yaml", tiny_target_dir, prepared, drafter__draft_vocab_size=40,
                       run__save_every=3, run__eval_every=0, optim__warmup_ratio=0.0, optim__min_lr_ratio=1.0)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(["train", str(cfg), "--run-dir", str(whole), "--max-steps", "6", "--nproc", "2"]) == 0
    assert main(["train", str(cfg), "--run-dir", str(parts), "--max-steps", "3", "--nproc", "2"]) == 0
    assert main(["train", "--resume", "--run-dir", str(parts), "optim.max_steps=6", "--nproc", "2"]) == 0
    assert_same_losses(losses(whole), losses(parts), 6)
    a, b = load_drafter(whole / "export"), load_drafter(parts / "export")
    assert torch.equal(a.d2t, b.d2t) and torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_the_index_check_sizes_the_loss_chunk_by_the_draft_vocabulary(target64):
    from dflash_train.train.plan.indexing import compiled_widths

    dcfg = make_drafter_config(target64.config, num_draft_layers=1, block_size=4, target_layer_ids=[1, 4],
                               mask_token_id=16, draft_vocab_size=300)
    backend = resolve_backend("sdpa", torch.device("cpu"), 4)
    for n, width in ((300, 300), (0, 49152)):
        cfg = config_from_dict({}, [f"drafter.draft_vocab_size={n}"])
        assert compiled_widths(cfg, dcfg, target64.config, backend, on_gpu=True).loss_row == width


def test_a_run_with_the_kept_head_gradient_logs_the_losses_of_the_recomputed_one(prepared, tiny_target_dir, tmp_path):
    """objective.head_gradient keep against recompute through the whole trainer (float32 on the CPU, acceptance
    weights, 6 steps): the same losses step by step, and the same trained head at the end."""
    from _harness import losses

    runs = {}
    for how in ("recompute", "keep"):
        cfg = write_config(tmp_path / f"{how}.yaml", tiny_target_dir, prepared, drafter__draft_vocab_size=40,
                           objective__slot_weighting="acceptance", objective__head_gradient=how,
                           run__save_every=100, run__eval_every=0, run__export_dtype="float32")
        runs[how] = tmp_path / how
        assert main(["train", str(cfg), "--run-dir", str(runs[how]), "--max-steps", "6"]) == 0
    ref, got = losses(runs["recompute"]), losses(runs["keep"])
    assert sorted(got) == sorted(ref) == list(range(1, 7))
    assert all(got[s] == pytest.approx(ref[s], rel=1e-5) for s in ref), (ref, got)
    a, b = load_drafter(runs["recompute"] / "export"), load_drafter(runs["keep"] / "export")
    assert torch.allclose(a.lm_head.weight, b.lm_head.weight, rtol=1e-4, atol=1e-6)
    start = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu")).get_output_embeddings().weight
    start = start[torch.arange(len(a.d2t)) + a.d2t]  # the head's first rows: the target's rows of its tokens
    assert not torch.allclose(a.lm_head.weight, start, atol=1e-4)  # it trained: the comparison is not vacuous
