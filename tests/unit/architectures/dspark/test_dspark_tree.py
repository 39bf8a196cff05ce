"""DDTree over a DSpark drafter: every slot is a depth (the anchor's slot too), each (parent, child) pair scored
exactly with the Markov bias of the parent's token (vanilla and gated heads); greedy tree decoding is lossless;
the rnn head, whose bias depends on the whole path, is refused before decoding."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.architectures.io import save_drafter
from dflash_train.cli import main
from dflash_train.errors import EXIT_USER_ERROR
from dflash_train.infer.evaluate import evaluate
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.target.capture import load_target_model
from test_dspark import BS, dspark


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17)]


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_greedy_tree_decoding_is_lossless(target, kind):
    dec = SpeculativeDecoder(target, dspark(target, kind), stop_token_ids=[2])
    for prompt in prompts():
        ref = dec.generate_target_only(prompt, 24).tokens
        for budget in (1, 12):
            out = dec.generate_tree(prompt, 24, budget)
            assert out.tokens == ref
            assert all(1 <= a <= BS + 1 for a in out.accept_lengths)


def test_a_tree_as_deep_as_the_block_is_accepted_whole_and_stays_lossless(target):
    """Base logits forced to the target's own tokens at every slot: the tree reaches depth bs (every slot drafts,
    the anchor's too), so a step gains bs + 1 tokens, and the outputs stay the target's."""
    dec = SpeculativeDecoder(target, dspark(target), stop_token_ids=[2])
    prompt = prompts()[1]
    ref = dec.generate_target_only(prompt, 30).tokens
    original_hidden, original_logits, seen = dec._draft_hidden, dec.drafter.logits, {}

    def record_start(context, anchor, start, dcache):
        seen["start"] = start
        return original_hidden(context, anchor, start, dcache)

    def oracle(hidden, lm_head):  # slot k predicts the token after anchor + k
        logits = original_logits(hidden, lm_head)
        offset = seen["start"] - len(prompt)  # index of the anchor in ref
        for k in range(logits.shape[1]):
            if offset + 1 + k < len(ref):
                logits[0, k] = -1e9
                logits[0, k, ref[offset + 1 + k]] = 0
        return logits

    dec._draft_hidden, dec.drafter.logits = record_start, oracle
    out = dec.generate_tree(prompt, 30, 8)
    assert out.tokens == ref
    assert max(out.accept_lengths) == BS + 1


def reference_log_probs(d, target, hidden, anchors, ids):
    """log_softmax(base_d + bias(parent token)) in float64 at the candidates, for every (depth, parent p, c)."""
    head = d.markov_head
    w1, w2 = head.markov_w1.weight.double(), head.markov_w2.weight.double()
    base = hidden.double() @ target.lm_head.weight.double().t()  # [n, bs, V]
    n, depth, k = ids.shape
    out = torch.zeros(n, depth, k, k, dtype=torch.float64)
    for b in range(n):
        for t in range(depth):
            for p in range(k):
                parent = int(anchors[b]) if t == 0 else int(ids[b, t - 1, p])
                e = w1[parent]
                f = e
                if head.kind == "gated":
                    g = head.gate_proj.weight.double() @ torch.cat([hidden[b, t].double(), e]) + head.gate_proj.bias.double()
                    f = torch.sigmoid(g) * e
                lp = torch.log_softmax(base[b, t] + w2 @ f, -1)
                out[b, t, p] = lp[ids[b, t]]
    return out


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_conditional_log_probs_equal_a_float64_reference(target, kind):
    d = dspark(target, kind)
    hidden = torch.randn(3, BS, target.config.hidden_size) * 0.05  # base logits the bias can outweigh
    anchors = torch.tensor([5, 77, 300])
    k = 5
    with torch.no_grad():
        lp, ids = d.tree_candidates(hidden, target.lm_head, anchors, k)
        assert lp.shape == (3, BS, k, k) and ids.shape == (3, BS, k)
        want = reference_log_probs(d, target, hidden, anchors, ids)
        assert torch.allclose(lp.double(), want, atol=1e-5, rtol=0)
        # depth 0: every row given the anchor; depth d's candidates are the k best given depth d - 1's best
        assert torch.equal(lp[:, 0], lp[:, 0, :1].expand(3, k, k))
        for t in range(BS):
            assert torch.all(lp[:, t, 0, :-1] >= lp[:, t, 0, 1:])
        assert (lp[:, 1:, 0] != lp[:, 1:, 1]).any()  # the parent's token matters
        assert torch.equal(ids[:, :, 0], d.draft(hidden, target.lm_head, anchors)[0])  # first branch: greedy
        # the scores in chunks of blocks are the same
        chunked = d.tree_candidates(hidden, target.lm_head, anchors, k, max_elements=1)
        assert torch.equal(chunked[0], lp) and torch.equal(chunked[1], ids)


def test_without_a_markov_head_each_slot_is_independent(target):
    d = dspark(target, rank=0, confidence=False)
    hidden = torch.randn(2, BS, target.config.hidden_size) * 0.05
    with torch.no_grad():
        lp, ids = d.tree_candidates(hidden, target.lm_head, torch.tensor([5, 6]), 3)
        want = torch.log_softmax(hidden.double() @ target.lm_head.weight.double().t(), -1).topk(3, -1)
    assert lp.shape == (2, BS, 3) and torch.equal(ids, want.indices)
    assert torch.allclose(lp.double(), want.values, atol=1e-5, rtol=0)


REFUSAL = r"--tree-budget.*markov_head_type is rnn.*without --tree-budget"


def test_the_rnn_head_is_refused_before_decoding(target, tmp_path):
    d = dspark(target, "rnn")
    with pytest.raises(ValueError, match=REFUSAL):
        d.tree_candidates(torch.zeros(1, BS, target.config.hidden_size), target.lm_head, torch.tensor([5]), 4)
    with pytest.raises(ValueError, match=REFUSAL):
        SpeculativeDecoder(target, d).generate_tree(prompts()[0], 8, 4)
    # before any prompt is read (a missing data file would be said otherwise)
    with pytest.raises(ValueError, match=REFUSAL):
        evaluate(target, None, d, [str(tmp_path / "absent.jsonl")], tree_budgets=(4,))


def test_eval_says_the_refusal_in_one_line(tiny_target_dir, target, tmp_path, capsys):
    from dflash_train.target.capture import load_tokenizer, read_target_config
    from dflash_train.target.provenance import serving_record, target_provenance, write_provenance

    d = dspark(target, "rnn")
    export = save_drafter(d, tmp_path / "export", dtype="float32")
    base = target_provenance(str(tiny_target_dir), load_tokenizer(tiny_target_dir),
                             read_target_config(tiny_target_dir))
    write_provenance(export, {**base, **serving_record(d)})
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": 0, "turns": ["hello"]}) + "\n")
    rc = main(["eval", "--target", str(tiny_target_dir), "--drafter", str(export), "--data", str(data),
               "--out", str(tmp_path / "r.json"), "--max-new-tokens", "8", "--tree-budget", "4", "--no-progress"])
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert rc == EXIT_USER_ERROR and len(said) == 1, said
    assert said[0].startswith("error:") and "markov_head_type is rnn" in said[0] and "--tree-budget" in said[0]
    assert not (tmp_path / "r.json").exists()


def memorise_every_slot(d, target, sequences: list[list[int]], steps: int = 20):
    """Teach the drafter's base logits these sequences: slot k of the block at a predicts ids[a + k + 1] (the
    anchor's slot too), so that whole blocks are accepted and the tree's last depth is reached."""
    from dflash_train.architectures.attention import sdpa_attention
    from dflash_train.architectures.family.mask import dense_mask

    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    batches = []
    for ids in sequences:
        with torch.no_grad():
            hs = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in d.target_layer_ids], -1)
        anchors = torch.arange(1, len(ids) - BS)
        window = torch.tensor(ids)[anchors.view(-1, 1) + torch.arange(BS + 1)]
        inputs = torch.full_like(window[:, :BS], d.mask_token_id)
        inputs[:, 0] = window[:, 0]
        positions = torch.cat([torch.arange(len(ids)), (anchors.view(-1, 1) + torch.arange(BS)).view(-1)]).view(1, -1)
        mask = dense_mask(anchors.view(1, -1), torch.ones(1, len(anchors), dtype=torch.bool), len(ids), BS)
        embeds = target.get_input_embeddings()(inputs.view(1, -1)).detach()
        batches.append((context, embeds, positions, mask, window[:, 1:]))
    d.train()
    for _ in range(steps):
        for context, embeds, positions, mask, labels in batches:
            out = d(context, embeds, positions, sdpa_attention, mask)
            logits = d.logits(out[0].view(labels.shape[0], BS, -1), target.lm_head)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return d.eval()


@pytest.mark.long  # ~30 s: 40 float64 memorising steps before whole blocks are accepted
def test_replay_of_the_tree_equals_real_decoding(tiny_target_dir):
    """Replay (`eval --replay`) walks the DSpark tree as deep as real decoding does (bs depths), step for step."""
    from dflash_train.infer.replay import ReplayTurn, greedy_continuations, replay_turn

    target = load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))  # no ties to flip
    max_new = 16
    prompts_ = prompts()
    conts = greedy_continuations(target, prompts_, max_new + BS)
    d = memorise_every_slot(dspark(target).double(), target, [p + c for p, c in zip(prompts_, conts)], steps=40)
    with torch.no_grad():  # a bias small enough beside the memorised base logits for whole blocks to pass
        d.markov_head.markov_w2.weight.mul_(0.1)
    dec = SpeculativeDecoder(target, d, stop_token_ids=[2])
    longest = 0
    for i, (p, c) in enumerate(zip(prompts_, conts)):
        rep = replay_turn(target, d, ReplayTurn("toy", str(i), 0, p, c), max_new, (3, 8), [2])
        for budget in (3, 8):
            res = dec.generate_tree(p, max_new, budget)
            assert rep.modes[f"tree-{budget}"] == (res.tokens, res.accept_lengths), budget
            longest = max(longest, max(res.accept_lengths))
    assert longest == BS + 1  # a whole tree path, every depth, was accepted and replayed
