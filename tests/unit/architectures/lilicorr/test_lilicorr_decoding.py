"""LiLiCorr decoding: the greedy lattice walk (ties to the lowest rank), drafts equal to the specification's head and
walk on the anchor row decoding gives it (the last committed context row), lossless block decoding on the tiny and
the real SmolLM2 target, sampled drafts whose distribution is the walk's, DDTree refused, and replay's accept lengths
equal to step-by-step decoding's."""

from __future__ import annotations

import pytest
import torch

from _lilicorr_drafters import perturbed_lilicorr
from _lilicorr_reference import head_scores, walk

from dflash_train.architectures.attention import DrafterKVCache, sdpa_attention
from dflash_train.architectures.lilicorr.head import greedy_walk
from dflash_train.architectures.lilicorr.model import LiLiCorrDrafter
from dflash_train.infer.replay import ReplayTurn, greedy_continuations, replay_turn
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.target.capture import load_target_model

STOPS = [2]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))


def lilicorr(target_config, layer_ids=(1, 4), block_size=5, topk=4, seed=0, mask=16, scale=0.3) -> LiLiCorrDrafter:
    """A head whose choices are not the backbone's argmax (`_lilicorr_drafters.perturbed_lilicorr`), for decoding."""
    return perturbed_lilicorr(target_config, block_size, topk, layer_ids, mask, scale, seed).eval()


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 19, 33)]


def test_the_walk_takes_the_lowest_rank_on_ties_and_follows_the_chosen_row():
    log_start = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    log_pair = torch.zeros(1, 2, 4, 4)
    log_pair[0, 0, 1] = torch.tensor([2.0, 0.0, 2.0, 1.0])  # row of rank 1: ranks 0 and 2 tie
    log_pair[0, 0, 2] = torch.tensor([0.0, 0.0, 0.0, 9.0])  # the row a walk from rank 2 would read
    log_pair[0, 1, 0] = torch.tensor([0.0, 5.0, 5.0, 5.0])
    assert greedy_walk(log_start, log_pair).tolist() == [[1, 0, 1]]
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 3, (50, 8), generator=g).double()  # small integers: many ties
    pair = torch.randint(0, 3, (50, 6, 8, 8), generator=g).double()
    assert greedy_walk(start, pair).tolist() == [walk(start[i], pair[i]) for i in range(50)]


def test_drafts_are_the_specified_walk_on_the_last_committed_context_row(target):
    """A block decoded with the KV cache (the context given as a prefix, then one new row before the anchor): the
    drafts equal the specification's head and walk on the anchor row hidden_norm(fc(features[anchor - 1])); a drafter
    whose head reads no anchor row drafts otherwise."""
    d = lilicorr(target.config).double()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    g = torch.Generator().manual_seed(3)
    tensors = dict(d.lilicorr.named_parameters())
    differs_from_argmax = differs_without_anchor = False
    for trial in range(6):
        context = torch.randn(1, 12, 128, generator=g, dtype=torch.float64)
        anchor = int(torch.randint(3, 49152, (1,), generator=g))
        cache = DrafterKVCache(1)
        d(context[:, :9], d.embed_block(embed, torch.tensor([[anchor] + [16] * 4])), torch.arange(0, 14).view(1, -1),
          sdpa_attention, None, cache)  # the prefix's keys, as decoding's earlier steps leave them
        cache.crop(9)
        block = torch.tensor([[anchor] + [16] * 4])
        hidden = d(context[:, 9:], d.embed_block(embed, block), torch.arange(9, 17).view(1, -1), sdpa_attention, None,
                   cache)
        drafts, q = d.draft(hidden, lm_head, block[:, 0])
        assert q is None
        slots = hidden[0, 1:]
        logp = torch.log_softmax(lm_head.weight @ slots.T, 0).T
        lp, cand = logp.topk(4, -1)
        row = d.hidden_norm(d.fc(context[0, 11]))
        start, pair = head_scores(tensors, d.lilicorr.exported_fields(), 64, d.config.rms_norm_eps,
                                  embed(cand), slots, lp, row, 1.0)
        ranks = walk(start, pair)
        assert drafts[0].tolist() == [int(cand[s, r]) for s, r in enumerate(ranks)]
        differs_from_argmax |= ranks != [0] * 4
        no_anchor = hidden.clone()
        no_anchor[:, 0] = 0
        differs_without_anchor |= not torch.equal(d.draft(no_anchor, lm_head, block[:, 0])[0], drafts)
    assert differs_from_argmax and differs_without_anchor


def test_greedy_block_decoding_is_lossless_and_the_tree_is_refused(target):
    d = lilicorr(target.config).double()
    dec = SpeculativeDecoder(target, d, stop_token_ids=STOPS)
    for p in prompts():
        assert dec.generate_block(p, 24).tokens == dec.generate_target_only(p, 24).tokens
    with pytest.raises(ValueError, match="walking that lattice"):
        dec.generate_tree(prompts()[0], 8, 6)


def test_sampled_drafts_come_from_the_walks_distribution_over_the_candidates(target):
    d = lilicorr(target.config).double()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    block = torch.tensor([[7] + [16] * 4] * 3)
    context = torch.randn(1, 10, 128, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    positions = torch.cat([torch.arange(10), torch.arange(9, 14).repeat(3)]).view(1, -1)
    hidden = d(context, d.embed_block(embed, block.view(1, -1)), positions, sdpa_attention, None).view(3, 5, -1)
    drafts, q = d.draft(hidden, lm_head, block[:, 0], temperature=0.8, generator=torch.Generator().manual_seed(0))
    lp, cand = d.candidates(hidden, lm_head)
    assert q.shape == (3, 4, 49152)
    torch.testing.assert_close(q.sum(-1), torch.ones(3, 4, dtype=q.dtype))
    assert bool((q.gather(-1, drafts.unsqueeze(-1)) > 0).all())  # each draft is a candidate it could draw
    assert bool(((q > 0).sum(-1) <= 4).all())  # only the candidates carry mass
    start, pair = d.lattice(hidden, lp, cand, embed)
    torch.testing.assert_close(q.gather(-1, cand[:, :1])[:, 0], torch.softmax(start / 0.8, -1))
    for s in range(1, 4):  # each step's distribution is the row leaving the draft before it
        prev = (cand[:, s - 1] == drafts[:, s - 1].unsqueeze(-1)).long().argmax(-1)
        rows = pair[torch.arange(3), s - 1, prev]
        torch.testing.assert_close(q[:, s].gather(-1, cand[:, s]), torch.softmax(rows / 0.8, -1))


@pytest.mark.long  # ~20 s: memorising takes 20 float32 steps over the tiny target's 49,152-token head
def test_replay_equals_step_by_step_decoding(target):
    """The anchor row replay forms (the whole context, an anchor at every position) is the one decoding forms (the
    newest row of the KV-cached context): the same tokens and accept lengths, step for step. Replay's backbone
    argmax mode is what a DFlash drafter holding the same backbone decodes."""
    from _lilicorr_drafters import backbone_alone
    from _memorise import memorise

    from dflash_train.infer.replay import ARGMAX_MODE

    bs, max_new = 5, 20
    ps = prompts()
    conts = greedy_continuations(target, ps, max_new + bs - 1)
    d = memorise(lilicorr(target.config, topk=2, scale=0.1).double(), target, [p + c for p, c in zip(ps, conts)],
                 steps=20)
    dec = SpeculativeDecoder(target, d, stop_token_ids=STOPS)
    alone = SpeculativeDecoder(target, backbone_alone(d, target.config), stop_token_ids=STOPS)
    taus, differ = [], False
    for i, (p, c) in enumerate(zip(ps, conts)):
        rep = replay_turn(target, d, ReplayTurn("toy", str(i), 0, p, c), max_new, (), STOPS)
        real = dec.generate_block(p, max_new)
        assert rep.modes["block"] == (real.tokens, real.accept_lengths)
        plain = alone.generate_block(p, max_new)
        assert rep.modes[ARGMAX_MODE] == (plain.tokens, plain.accept_lengths)
        differ |= plain.accept_lengths != real.accept_lengths
        taus.append(sum(real.accept_lengths) / len(real.accept_lengths))
    assert max(taus) > 1.3 and differ  # multi-token steps, chosen by the head, were compared



@pytest.mark.long  # ~36 s: the real SmolLM2 decoding on CPU
@pytest.mark.slow
def test_greedy_decoding_with_the_real_smollm2_target_is_its_own_greedy_output(smollm2_dir):
    from transformers import AutoTokenizer

    target = load_target_model(smollm2_dir, torch.float32, torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    layers = target.config.num_hidden_layers
    d = lilicorr(target.config, layer_ids=(1, layers // 2, layers - 3), block_size=8, topk=8, mask=0)
    dec = SpeculativeDecoder(target, d, stop_token_ids=[tok.eos_token_id])
    for text in ("The capital of France is", "def fibonacci(n):\n    "):
        prompt = tok(text)["input_ids"]
        block = dec.generate_block(prompt, 32)
        assert block.tokens == dec.generate_target_only(prompt, 32).tokens
        assert len(block.accept_lengths) <= 32
