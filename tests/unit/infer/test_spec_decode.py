"""Speculative decoding: lossless under greedy (block and tree), tree mask, sampling correctness."""

import math

import pytest
import torch

from dflash_train.infer.spec_decode import SpeculativeDecoder, speculative_accept
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.target.capture import load_target_model


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def make_drafter(target, block_size=4, seed=0):
    torch.manual_seed(seed)
    cfg = make_drafter_config(target.config, num_draft_layers=1, block_size=block_size, target_layer_ids=[1, 4],
                              mask_token_id=16)
    return DFlashDrafter(cfg).eval()


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 13, 30)]


@pytest.fixture(scope="module")
def references(target):
    dec = SpeculativeDecoder(target, make_drafter(target, 4), stop_token_ids=[2])
    return [(p, dec.generate_target_only(p, 32).tokens) for p in prompts()]


@pytest.mark.parametrize("block_size", [2, 8])
def test_block_decoding_is_lossless_under_greedy(target, references, block_size):
    dec = SpeculativeDecoder(target, make_drafter(target, block_size), stop_token_ids=[2])
    for prompt, ref in references:
        out = dec.generate_block(prompt, 32)
        assert out.tokens == ref
        assert all(1 <= a <= block_size for a in out.accept_lengths)
        assert sum(out.accept_lengths) >= len(out.tokens) - 1


@pytest.mark.parametrize("budget", [1, 8, 48])
def test_tree_decoding_is_lossless_under_greedy(target, references, budget):
    dec = SpeculativeDecoder(target, make_drafter(target, 4), stop_token_ids=[2])
    for prompt, ref in references:
        assert dec.generate_tree(prompt, 32, budget).tokens == ref


def test_lossless_with_a_drafter_that_is_often_right(target):
    """Force acceptances (the first two slots of every block propose the target's own tokens): tau
    grows past 2.5 and the outputs stay identical, for block and tree verification."""
    dec = SpeculativeDecoder(target, make_drafter(target, 4), stop_token_ids=[2])
    prompt = prompts()[1]
    ref = dec.generate_target_only(prompt, 30).tokens
    original_hidden, original_logits, seen = dec._draft_hidden, dec.drafter.logits, {}

    def record_start(context, anchor, start, dcache):
        seen["start"] = start
        return original_hidden(context, anchor, start, dcache)

    def oracle(hidden, lm_head):  # [1, bs, V] for the block at seen["start"]; row 0 is the anchor's
        logits = original_logits(hidden, lm_head)
        offset = seen["start"] - len(prompt)  # index of the anchor in ref
        for k in range(logits.shape[1] - 1):
            if offset + 1 + k < len(ref) and k < 2:  # right for two slots, then whatever the drafter says
                logits[0, k + 1] = -1e9
                logits[0, k + 1, ref[offset + 1 + k]] = 0
        return logits

    dec._draft_hidden, dec.drafter.logits = record_start, oracle
    out = dec.generate_block(prompt, 30)
    assert out.tokens == ref
    assert out.tau > 2.5
    tree = dec.generate_tree(prompt, 30, 8)
    assert tree.tokens == ref and tree.tau > 2.5


def test_tree_is_best_first_and_respects_the_budget():
    lp = torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0, -1.0], [1.0, 0.5, 0.0, -3.0], [2.0, 0.0, -1.0, -1.0]]), -1)
    tokens, parents, depths = SpeculativeDecoder.build_tree(lp, 6)
    assert len(tokens) == 6
    # Brute force: the 6 best root-paths (prefix-closed) by summed log-prob.
    import itertools
    paths = []
    for d in range(1, 4):
        for combo in itertools.product(range(4), repeat=d):
            paths.append((sum(lp[i, c].item() for i, c in enumerate(combo)), combo))
    best = sorted(paths, reverse=True)[:6]
    got = []
    for i in range(6):
        path, node = [], i
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        got.append(tuple(reversed(path)))
    assert set(got) == {c for _, c in best}
    for i, p in enumerate(parents):
        assert p < i and (p == -1 or depths[p] == depths[i] - 1)



@pytest.mark.parametrize("budget", [1, 5, 9, 14])
def test_a_tree_given_each_parent_is_best_first_over_conditional_paths(budget):
    """Candidates whose log-probabilities depend on the parent (one row per candidate of the depth before): the
    tree is the `budget` best root paths by summed conditional log-probability, found by brute force."""
    import itertools

    g = torch.Generator().manual_seed(budget)
    k, depth = 3, 3
    ids = [[10 * d + c for c in range(k)] for d in range(depth)]
    rows = [torch.log_softmax(torch.randn(k, k, generator=g), -1) for _ in range(depth)]
    tokens, parents, depths = SpeculativeDecoder.build_tree_from_top(torch.stack(rows), torch.tensor(ids), budget)
    assert len(tokens) == budget
    paths = []
    for d in range(1, depth + 1):
        for combo in itertools.product(range(k), repeat=d):
            score = sum(rows[i][0 if i == 0 else combo[i - 1], c].item() for i, c in enumerate(combo))
            paths.append((score, tuple(ids[i][c] for i, c in enumerate(combo))))
    best = {p for _, p in sorted(paths, reverse=True)[:budget]}
    got = set()
    for i in range(budget):
        path, node = [], i
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        got.add(tuple(reversed(path)))
        assert depths[i] == len(path)
    assert got == best
    # the same rows given once per depth (no dependence on the parent) build the tree of the independent form
    flat = torch.stack([r[0] for r in rows])
    assert (SpeculativeDecoder.build_tree_from_top(flat.unsqueeze(1).expand(depth, k, k), torch.tensor(ids), budget)
            == SpeculativeDecoder.build_tree_from_top(flat, torch.tensor(ids), budget))

def test_tree_mask_is_ancestor_only(target):
    dec = SpeculativeDecoder(target, make_drafter(target, 4))
    parents = [-1, -1, 0, 0, 2, 1]
    mask = dec._tree_mask(parents, past=3, dtype=torch.float32)[0, 0] == 0
    n = len(parents) + 1
    for i in range(n):
        ancestors, node = {i}, i
        while node != 0:
            node = parents[node - 1] + 1
            ancestors.add(node)
        for j in range(n):
            assert bool(mask[i, 3 + j]) == (j in ancestors), (i, j)
        assert mask[i, :3].all()


def test_speculative_sampling_follows_the_target_distribution():
    """Toy vocabulary: the first emitted token's frequencies match p (chi-square, fixed seed)."""
    g = torch.Generator().manual_seed(0)
    v, trials = 6, 20000
    target_logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0], [0.0] * 6])
    draft_logits = torch.tensor([[0.0, 1.5, 0.5, 0.0, -1.0, 1.0]])
    p = torch.softmax(target_logits[0], -1)
    q = torch.softmax(draft_logits[0], -1)
    counts = torch.zeros(v)
    for _ in range(trials):
        d = torch.multinomial(q, 1, generator=g)
        n_acc, bonus = speculative_accept(d, q.unsqueeze(0), target_logits, 1.0, g)
        first = int(d[0]) if n_acc == 1 else bonus
        counts[first] += 1
    expected = p * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    # And it is not trivially q: the draft distribution is far from p.
    assert float(((q * trials - expected) ** 2 / expected).sum()) > 1000


def test_sampled_decoding_runs_and_stops(target):
    dec = SpeculativeDecoder(target, make_drafter(target, 4), stop_token_ids=[2], temperature=0.8, seed=1)
    out = dec.generate_block(prompts()[0], 25)
    assert 1 <= len(out.tokens) <= 25 and all(1 <= a <= 4 for a in out.accept_lengths)


def test_untrained_drafter_tau_is_about_one(target):
    dec = SpeculativeDecoder(target, make_drafter(target, 8), stop_token_ids=[2])
    taus = [dec.generate_block(p, 24).tau for p in prompts()]
    assert all(1.0 <= t < 1.2 for t in taus), taus


def test_growing_cache_and_in_place_tree_cut_equal_the_copying_ones():
    """`new_cache` (keys written into a buffer with room) + `trim_cache` / `accept_tree_path` hold exactly
    what a plain DynamicCache + `select_cache` (index_select of the whole cache) holds, across buffer
    growth, block cuts and tree cuts with contiguous and non-contiguous paths."""
    from transformers import DynamicCache

    from dflash_train.infer.spec_decode import (GrowingLayer, accept_tree_path, new_cache, select_cache,
                                                trim_cache)

    g = torch.Generator().manual_seed(0)
    grow, plain = new_cache(), DynamicCache()
    layers = 3

    def step(n_new):
        for i in range(layers):
            k, v = torch.randn(1, 2, n_new, 4, generator=g), torch.randn(1, 2, n_new, 4, generator=g)
            a, b = grow.update(k, v, i), plain.update(k, v, i)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    step(200)  # prefill
    length = 200
    for it in range(40):  # past the initial 256 + 2x growth
        if it % 2:
            step(16)
            length += int(torch.randint(1, 17, (1,), generator=g))
            trim_cache(grow, length), trim_cache(plain, length)
        else:
            step(9)  # a tree: root + 8 nodes
            path = [0] + sorted(torch.randperm(8, generator=g)[: int(torch.randint(0, 5, (1,), generator=g))].add(1).tolist())
            if it % 4 == 0:
                path = list(range(len(path)))  # contiguous
            accept_tree_path(grow, length, path, torch.tensor(path))
            select_cache(plain, torch.cat([torch.arange(length), length + torch.tensor(path)]))
            length += len(path)
        for a, b in zip(grow.layers, plain.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert all(isinstance(layer, GrowingLayer) for layer in grow.layers)
    assert grow.get_seq_length() == length and grow.layers[0]._kbuf.shape[-2] >= length


def test_prefill_computes_the_last_logits_only(target, monkeypatch):
    dec = SpeculativeDecoder(target, make_drafter(target, 4), stop_token_ids=[2])
    prompt = prompts()[1]
    rows = []
    head = dec.lm_head.forward
    monkeypatch.setattr(dec.lm_head, "forward", lambda x: rows.append(x.shape[-2]) or head(x))
    cache, hidden, first, _ = dec._prefill(prompt)
    assert rows == [1]
    monkeypatch.undo()
    full = target(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1]
    assert first == int(full.argmax()) and hidden.shape[0] == len(prompt)
    assert cache.get_seq_length() == len(prompt)
