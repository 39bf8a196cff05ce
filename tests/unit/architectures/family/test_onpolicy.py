"""The on-policy objective against independent references, in float64, for each member that declares it: on the
target's own greedy answers its chain of anchors and accepted drafts is the one real greedy speculative decoding
takes, and its loss and gradients equal Draft-OPD's two streams computed block by block from full distributions of
the target's logits and of the drafter's decoding (DFlash: each slot's softmax; DFlash2: the selector's rescoring of
the unary top-k given the committed token before, which shares the mass those candidates hold; LiLiCorr: the
lattice's row leaving the committed token's candidate, over the slot's candidates; Domino, shifted one slot: the
corrected scores after the GRU over the committed tokens; DSpark, B drafts a block: the base scores plus the Markov
head's bias from the committed token before, its gated or recurrent state teacher-forced)."""

from __future__ import annotations

import copy

import pytest
import torch
from _memorise import memorise

from dflash_train.architectures import architecture
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.onpolicy import OnPolicyObjective, committed_loss, decode_chain, rejected_loss
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.target.capture import TargetCapture, load_target_model
from dflash_train.target.hf_model import forward_with_layer_states
from dflash_train.train.loop.step import MicroBatch, TrainStep

BLOCK, LAYERS, MASK, NEW = 5, [1, 3], 23, 28  # 3: the target's last layer


@pytest.fixture(scope="module", params=["dflash", "dflash2", "lilicorr", "domino", "dspark", "dspark-rnn"])
def setup(request, tmp_path_factory, tokenizer_dir):
    """A 4-layer target over 24 tokens in float64, the greedy answers it gives three prompts, and a drafter taught
    them until it is often right (varied acceptance); DFlash2's selector away from its identity start (S != U)."""
    from conftest import make_tiny_target

    path = make_tiny_target(tmp_path_factory.mktemp("opd-target"), tokenizer_dir, layers=4, vocab_size=24)
    target = load_target_model(path, torch.float64, torch.device("cpu"))
    own = {"dflash2": {"dflash2": {"selector_top_k": 4, "selector_rank": 8, "conv_kernel_size": 3}},
           "lilicorr": {"lilicorr": {"candidate_topk": 4, "head_hidden_size": 32, "factor_dim": 16,
                                     "head_num_heads": 2}},
           "domino": {"domino": {"gru_hidden_dim": 16, "emb_dim": 16, "pure_draft_prefix_len": 1}},
           "dspark": {"dspark": {"markov_rank": 8, "markov_head_type": "gated"}},
           "dspark-rnn": {"dspark": {"markov_rank": 8, "markov_head_type": "rnn"}}}.get(request.param, {})
    name = request.param.split("-")[0]
    cfg = config_from_dict({"drafter": {"block_size": BLOCK, "num_draft_layers": 1, "architecture": name},
                            **own,
                            "objective": {"max_anchors": 7, "loss_chunk_size": 13},
                            "onpolicy": {"start_from": "unused", "decay": 0.7, "rejected_weight": 1.5, "max_blocks": 64},
                            "data": {"max_length": 64, "token_budget": 256}})
    torch.manual_seed(0)
    arch = architecture(name)
    drafter = arch.drafter_class(arch.config_for_run(target.config, cfg, LAYERS, MASK)).double()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 23, (n,), generator=g).tolist() for n in (6, 11, 9)]
    plain = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    answers = [plain.generate_target_only(p, NEW).tokens for p in prompts]
    memorise(drafter, target, [p + a for p, a in zip(prompts, answers)], steps=24 if name == "dspark" else 12)
    if name == "dspark":  # a small Markov bias beside the memorised base scores: drafts often right
        with torch.no_grad():
            drafter.markov_head.markov_w2.weight.normal_(0.0, 0.05, generator=g)
    if request.param == "dflash2":
        with torch.no_grad():
            drafter.candidate_selector.successor_codebook.normal_(0.0, 1.0, generator=g)
            drafter.candidate_selector.predecessor_codebook.normal_(0.0, 1.0, generator=g)
    return target, drafter.eval(), cfg, prompts, answers


def batch_of(prompts, answers) -> Batch:
    rows = [p + a for p, a in zip(prompts, answers)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (p, a) in enumerate(zip(prompts, answers)):
        ids[r, :len(p) + len(a)] = torch.tensor(p + a)
        mask[r, len(p):len(p) + len(a)] = 1
    return Batch(ids, mask, torch.tensor([len(r) for r in rows]))


def objective_for(target, drafter, cfg):
    capture = TargetCapture.from_model(target, LAYERS)
    stage = architecture(cfg.drafter.architecture).onpolicy_objective
    assert issubclass(stage, OnPolicyObjective)
    return stage(drafter, capture, resolve_backend("sdpa", torch.device("cpu"), BLOCK), cfg, torch.float64), capture


def decoding_log_probs(drafter, hidden, head, seq, anchor):
    """`[bs, V]` log q of each slot given the committed token before it (`seq`'s): DFlash's softmax, or DFlash2's
    candidate rescoring written out from its parameters."""
    if hasattr(drafter, "prefix_gru"):
        return corrected_log_probs(drafter, hidden, head, seq, anchor)
    if hasattr(drafter, "markov_head"):
        return markov_log_probs(drafter, hidden, head, seq, anchor)
    logu = torch.log_softmax(drafter.logits(hidden, head)[0].double(), -1)
    if hasattr(drafter, "lilicorr"):
        return lattice_log_probs(drafter, hidden, head, seq, anchor)
    if not hasattr(drafter, "candidate_selector"):
        return logu
    sel, out = drafter.candidate_selector, logu.clone()
    projected = sel.hidden_projection(hidden[0]).double()  # [bs, R]
    for k in range(1, logu.shape[0]):
        cand = logu[k].topk(drafter.selector_top_k).indices
        previous = seq[0, min(anchor + k - 1, seq.shape[1] - 1)]  # slots past the data are never read
        pair = (sel.predecessor_codebook[previous].double() * projected[k]) @ sel.successor_codebook[cand].double().T
        scores = drafter.logits(hidden, head)[0, k].double()[cand] + pair
        out[k, cand] = torch.log_softmax(scores, -1) + logu[k, cand].logsumexp(-1)
    return out


def test_the_chain_on_the_targets_answers_is_greedy_speculative_decodings(setup, monkeypatch):
    target, drafter, cfg, prompts, answers = setup
    objective, capture = objective_for(target, drafter, cfg)
    batch = batch_of(prompts, answers)
    with torch.no_grad():
        features, final = capture.capture(batch.input_ids, with_final=True)
        chains = objective.chains(batch, batch, features, objective.target_argmax(final))
    decoder = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    seen = set()
    for prompt, answer, chain in zip(prompts, answers, chains):
        result = decoder.generate_block(prompt, NEW)
        assert result.tokens == answer  # lossless: the data are what decoding commits
        anchor, steps = len(prompt), []
        for accept in result.accept_lengths[:-1]:  # the last step is cut by the token limit, the chain by the data
            steps.append((anchor, accept - 1))
            anchor += accept
        assert [step[:2] for step in chain[:len(steps)]] == steps
        # the rollout's draft after the accepted ones: recorded wherever a draft was left (scored in the loss test)
        assert all((rejected == -1) == (n == drafter.num_drafts()) for _, n, rejected in chain)
        seen |= {n for _, n in steps}
    assert len(seen) >= 3  # acceptance varies: rejections at several slots and full blocks

    # the proposals' vocabulary scores a loss chunk's rows at a time: the same chain
    # and its passes take a row's share of objective.max_anchors_per_batch, as training's micro-batch does
    small = copy.deepcopy(cfg)
    small.objective.loss_chunk_size = 2 * drafter.block_size
    rows = batch.input_ids.shape[0]
    small.objective.max_anchors_per_batch = 4 * rows
    chunked, _ = objective_for(target, drafter, small)
    calls: list[int] = []
    passes: list[int] = []
    real, real_blocks = type(drafter).greedy_proposals, type(chunked).build_blocks

    def counting(self, hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        return real(self, hidden, *args, **kwargs)

    def planned(self, plan, anchors, keep):
        passes.append(anchors.numel())
        return real_blocks(self, plan, anchors, keep)

    monkeypatch.setattr(type(drafter), "greedy_proposals", counting)
    monkeypatch.setattr(type(chunked), "build_blocks", planned)
    with torch.no_grad():
        assert chunked.chains(batch, batch, features, objective.target_argmax(final)) == chains
    assert len(calls) > 1 and max(calls) <= 2, calls
    assert len(passes) > 1 and max(passes) <= 4 * rows, passes


def decode_chain_by_hand():
    accepted = torch.tensor([[0, 0, 2, 0, 1, 3, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1]])
    return decode_chain(accepted, mask, torch.tensor([10]))


def test_a_chain_restarts_at_each_answer_and_stops_at_its_last_token():
    # answer 1: positions 2-6 (2 accepts 2 -> 5 accepts 3, past the answer's end); answer 2: 8-9
    assert decode_chain_by_hand() == [[(2, 2, -1), (5, 3, -1), (8, 0, -1)]]


def markov_log_probs(drafter, hidden, head, seq, anchor):
    """DSpark's q of the token at anchor + k (row k, 1 <= k <= B): slot k - 1's scores from its own sequential
    decoding, every choice forced to the committed token (rows past the data stay -inf)."""
    bs = hidden.shape[1]
    forced = iter(seq[0, anchor + 1:anchor + bs + 1].tolist() + [0] * bs)
    choose = lambda z: torch.full((z.shape[0],), next(forced), dtype=torch.long)  # noqa: E731
    _, logits, _ = drafter.sequential_logits(hidden, head, seq[0, anchor].view(1), choose)
    out = torch.full((bs + 1, head.weight.shape[0]), float("-inf"), dtype=torch.float64)
    out[1:] = torch.log_softmax(logits[0].double(), -1)
    return out


def corrected_log_probs(drafter, hidden, head, seq, anchor):
    """Domino's q of the token at anchor + k (row k, k >= 1): slot k - 1's head scores, plus from slot
    pure_draft_prefix_len on embed_proj([z ; g]), g the GRU's state after the committed tokens anchor .. anchor + k - 1
    (the anchor row and rows past the data stay -inf)."""
    bs = hidden.shape[1]
    out = torch.full((bs, head.weight.shape[0]), float("-inf"), dtype=torch.float64)
    tokens = seq[0, anchor:anchor + bs - 1]
    states = drafter.prefix_gru(drafter._token_embed(tokens).view(1, len(tokens), -1).to(hidden.dtype))[0][0]
    for k in range(1, len(tokens) + 1):
        z = hidden[0, k - 1]
        scores = head(z).double()
        if k - 1 >= drafter.pure_draft_prefix_len:
            scores = scores + drafter.embed_proj(torch.cat([z, states[k - 1]])).double()
        out[k] = torch.log_softmax(scores, -1)
    return out


def lattice_log_probs(drafter, hidden, head, seq, anchor):
    """LiLiCorr's q: slot k's candidates (the top-k of its log-softmax), softmax of the lattice row leaving the
    committed token before it (log_start at slot 1), -inf outside the candidates."""
    lp, cand = torch.log_softmax(drafter.logits(hidden[:, 1:], head).double(), -1).topk(drafter.topk, dim=-1)
    log_start, log_pair = drafter.lattice(hidden, lp, cand, drafter._embed())
    out = torch.full((hidden.shape[1], head.weight.shape[0]), float("-inf"), dtype=torch.float64)
    for k in range(1, hidden.shape[1]):
        if k == 1:
            row = log_start[0]
        else:
            previous = seq[0, min(anchor + k - 1, seq.shape[1] - 1)]
            ranks = (cand[0, k - 2] == previous).nonzero()
            if not len(ranks):  # off the lattice: decoding never reaches this slot
                continue
            row = log_pair[0, k - 2, ranks[0, 0]]
        out[k, cand[0, k - 1]] = torch.log_softmax(row.double(), -1)
    return out


def test_a_micro_batch_trains_on_a_seeded_subset_of_each_chain_within_the_block_caps(setup):
    """Every row's blocks are padded to the longest row's, so the caps bound the steps a row: onpolicy.max_blocks,
    and objective.max_anchors_per_batch shared by the rows as training's anchors share it."""
    target, drafter, cfg, _, _ = setup
    chains = [[(p, p % 3) for p in range(10, 40, 2)], [(5, 0), (7, 1)], []]  # 15, 2 and 0 steps
    capped = copy.deepcopy(cfg)
    capped.onpolicy.max_blocks, capped.objective.max_anchors_per_batch = 4, 0
    objective, _ = objective_for(target, drafter, capped)
    got = objective.trained_steps(chains, torch.Generator().manual_seed(1))
    assert got == objective.trained_steps(chains, torch.Generator().manual_seed(1))  # the step's generator: resumable
    assert [len(r) for r in got] == [4, 2, 0]
    for row, chain in zip(got, chains):
        assert row == [s for s in chain if s in row]  # a subset, in chain order
    capped.objective.max_anchors_per_batch = 9  # 3 a row: the padded micro-batch holds 3 x 3 blocks
    got = objective.trained_steps(chains, torch.Generator().manual_seed(1))
    assert [len(r) for r in got] == [3, 2, 0] and len(chains) * max(map(len, got)) <= 9
    capped.onpolicy.max_blocks, capped.objective.max_anchors_per_batch = 0, 0  # objective.max_anchors a row
    assert [len(r) for r in objective.trained_steps(chains, torch.Generator().manual_seed(1))] == [7, 2, 0]


def reference_loss(target, drafter, cfg, prompts, answers, redraft=None):
    """Draft-OPD's streams block by block: every decoding step's block run on its own (the context before its
    anchor), full softmaxes in float64. `redraft`: the rollout's draft at each rejection from q's argmax there
    (the argmax itself when None)."""
    o = cfg.onpolicy
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    decoder = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    committed, rejected, weights = [], [], []
    for prompt, answer in zip(prompts, answers):
        seq = torch.tensor([prompt + answer])
        out, states = forward_with_layer_states(target, input_ids=seq)  # the last layer's own output, as trained
        logp_target = torch.log_softmax(out.logits[0].double(), -1)
        features = torch.cat([states[i + 1] for i in LAYERS], -1)
        end = len(prompt) + len(answer)
        anchor = len(prompt)
        for accept in decoder.generate_block(prompt, NEW).accept_lengths:
            n = accept - 1
            block = torch.tensor([[seq[0, anchor].item()] + [MASK] * (BLOCK - 1)])
            positions = torch.arange(anchor + BLOCK).view(1, -1)
            hidden = drafter(features[:, :anchor], drafter.embed_block(embed, block), positions, sdpa_attention, None)
            logq = decoding_log_probs(drafter, hidden, head, seq, anchor)
            for k in range(1, min(n + 1, drafter.num_drafts()) + 1):
                if anchor + k >= end:
                    break
                c = seq[0, anchor + k]
                committed.append(committed_loss(logp_target[anchor + k - 1, c], logq[k, c], o.log_prob_min))
                if k == n + 1:
                    d = logq[k].argmax() if redraft is None else redraft(logq[k].argmax())
                    rejected.append(rejected_loss(logp_target[anchor + k - 1, d], logq[k, d], o.log_prob_min))
                    weights.append(o.decay ** (k - 1))
            anchor += accept
            if anchor >= end - 1:
                break
    c, r, w = torch.stack(committed), torch.stack(rejected), torch.tensor(weights, dtype=torch.float64)
    total = (o.committed_weight * c.clamp_max(o.loss_max).sum() + o.rejected_weight * (w * r.clamp_max(o.loss_max)).sum())
    return total / (o.committed_weight * len(c) + o.rejected_weight * w.sum()), len(c), len(r)


def test_the_loss_and_gradients_equal_draft_opds_streams_block_by_block(setup):
    target, drafter, cfg, prompts, answers = setup
    drafter.train()
    try:
        objective, _ = objective_for(target, drafter, cfg)
        stats = objective(batch_of(prompts, answers), torch.Generator().manual_seed(0))
        ref, n_committed, n_rejected = reference_loss(target, drafter, cfg, prompts, answers)
        assert n_rejected >= 3 and n_committed > n_rejected
        assert int(stats.counted_per_slot.sum()) == n_committed
        assert int(stats.extra["onpolicy_rejected"]) == n_rejected
        assert int(stats.extra["onpolicy_off_target"]) == 0  # the data are the target's own answers
        # each decoding step commits its accepted drafts (q's argmax, its label) and, where one was rejected, the
        # target's correction: the layout's acceptance estimate reads 1 + the accepted drafts of every step
        accepted = n_committed - n_rejected
        assert int(stats.accepted_sum) == int(stats.kept_blocks) + accepted
        params = [p for p in drafter.parameters() if p.requires_grad]
        grads = torch.autograd.grad(stats.loss, params, allow_unused=True)
        ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
        # float64, yet not to the last bits: where the memorised drafter is nearly sure (q ~ 1 - 1e-9) the Bernoulli
        # term's log(1 - q) magnifies the last bits of log q, which the chunked CE and a full softmax round apart
        torch.testing.assert_close(stats.loss, ref, rtol=1e-7, atol=1e-9)
        for a, b, p in zip(grads, ref_grads, params):
            torch.testing.assert_close(torch.zeros_like(p) if a is None else a, torch.zeros_like(p) if b is None else b,
                                       rtol=1e-5, atol=1e-7)
        assert any(g is not None and g.abs().sum() > 0 for g in grads)
    finally:
        drafter.eval()


def test_the_rejected_stream_scores_the_rollouts_draft_not_the_gradient_passs_argmax(setup, monkeypatch):
    """Each rejection's draft is the rollout's, recorded in the chain: a rollout whose drafts were other tokens (as a
    rounding flip between the two passes would make them) is scored at those tokens, as the reference scores them."""
    target, drafter, cfg, prompts, answers = setup
    objective, _ = objective_for(target, drafter, cfg)
    vocab = target.config.vocab_size
    other = lambda d: (d + 1) % vocab  # noqa: E731
    real = objective.chains
    monkeypatch.setattr(objective, "chains", lambda *a: [[(anchor, n, -1 if d < 0 else other(d)) for anchor, n, d in c]
                                                          for c in real(*a)])
    with torch.no_grad():
        stats = objective(batch_of(prompts, answers), torch.Generator().manual_seed(0))
        ref, _, n_rejected = reference_loss(target, drafter, cfg, prompts, answers, redraft=other)
        plain, _, _ = reference_loss(target, drafter, cfg, prompts, answers)
    assert n_rejected >= 3 and abs(float(ref - plain)) > 1e-6
    torch.testing.assert_close(stats.loss, ref, rtol=1e-7, atol=1e-9)


def gradients_of(loss, drafter):
    params = [p for p in drafter.parameters() if p.requires_grad]
    return [torch.zeros_like(p) if g is None else g for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True),
                                                                    params)]


def step_gradients(step: TrainStep, micro: list[MicroBatch]) -> list[torch.Tensor]:
    """The gradients one optimizer step trained on (unclipped): they stay on the parameters until the next step."""
    step(micro, 0)
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for p in step.drafter.parameters() if p.requires_grad]


def unclipped(cfg):
    cfg = copy.deepcopy(cfg)
    cfg.optim.grad_clip = 0.0
    return cfg


def test_a_step_of_several_micro_batches_trains_on_the_mean_over_all_their_terms(setup):
    """The official estimator normalises over the whole batch: a micro-batch of one answer and one of two, in one
    step, give the gradients of the loss over the three answers pooled, not the mean of the two micro-batches'."""
    target, drafter, cfg, prompts, answers = setup
    model = copy.deepcopy(drafter).train()
    expected = gradients_of(reference_loss(target, model, cfg, prompts, answers)[0], model)
    step = TrainStep(model, TargetCapture.from_model(target, LAYERS),
                     resolve_backend("sdpa", torch.device("cpu"), BLOCK), unclipped(cfg), 10, torch.float64,
                     torch.device("cpu"))
    got = step_gradients(step, [MicroBatch(batch_of(prompts[:1], answers[:1])),
                                MicroBatch(batch_of(prompts[1:], answers[1:]))])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in got)


def _onpolicy_rank(rank: int, init_file: str, target_dir: str, cfg, rows, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        target = load_target_model(target_dir, torch.float64, torch.device("cpu"))
        arch = architecture(cfg.drafter.architecture)
        drafter = arch.drafter_class(arch.config_for_run(target.config, cfg, LAYERS, MASK)).double()
        drafter.load_state_dict(torch.load(f"{out}/drafter.pt"))
        step = TrainStep(drafter.train(), TargetCapture.from_model(target, LAYERS),
                         resolve_backend("sdpa", torch.device("cpu"), BLOCK), cfg, 10, torch.float64,
                         torch.device("cpu"), rank=rank)
        torch.save(step_gradients(step, [MicroBatch(batch_of(*rows[rank]))]), f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.long  # ~17 s: two ranks in real processes
@pytest.mark.parametrize("setup", ["dflash"], indirect=True)
def test_ranks_with_unequal_answers_train_on_the_mean_over_every_ranks_terms(setup, tmp_path):
    """Two data-parallel ranks over gloo, one answer on the first and two on the second: both step on the gradients
    of the loss over the three answers pooled (DDP alone would average the two ranks' means)."""
    import torch.multiprocessing as mp

    target, drafter, cfg, prompts, answers = setup
    model = copy.deepcopy(drafter).train()
    expected = gradients_of(reference_loss(target, model, cfg, prompts, answers)[0], model)
    target.save_pretrained(tmp_path / "target")
    torch.save(drafter.state_dict(), tmp_path / "drafter.pt")
    rows = [(prompts[:1], answers[:1]), (prompts[1:], answers[1:])]
    mp.spawn(_onpolicy_rank, args=(str(tmp_path / "init"), str(tmp_path / "target"), unclipped(cfg), rows,
                                   str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        for a, b in zip(torch.load(tmp_path / f"{rank}.pt"), expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_estimators_are_zero_where_the_drafter_matches_the_target_and_grow_apart():
    logp = torch.log(torch.tensor([0.3, 0.3, 0.9], dtype=torch.float64))
    same = committed_loss(logp, logp, -20.0)
    assert torch.allclose(same, torch.zeros(3, dtype=torch.float64), atol=1e-15)
    assert torch.allclose(rejected_loss(logp, logp, -20.0), torch.zeros(3, dtype=torch.float64), atol=1e-15)
    further = torch.log(torch.tensor([0.2, 0.05, 0.5], dtype=torch.float64))
    p, q = logp.exp(), further.exp()
    bernoulli = p * (logp - further) + (1 - p) * (torch.log(1 - p) - torch.log(1 - q))
    assert torch.allclose(committed_loss(logp, further, -20.0), bernoulli, rtol=1e-12)
    r = logp - further
    assert torch.allclose(rejected_loss(logp, further, -20.0), r.exp() - r - 1, rtol=1e-12)
