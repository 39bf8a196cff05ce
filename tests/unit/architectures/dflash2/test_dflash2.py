"""DFlash2: the block-local convolution and the candidate selector against float64 references, the identity
start (an untrained DFlash2 drafter computes what DFlash does), the training objective against a dense
reference, lossless decoding through the selector's path, exact speculative sampling over its candidates, and
the reference export format read back by an independent minimal decoder."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from _reader_math import ReaderMath

from dflash_train.architectures import architecture
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.blocks import build_blocks, sample_anchors
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.family.loss import grouped_topk
from dflash_train.architectures.family.mask import dense_mask
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.family.model import BlockDrafter
from dflash_train.architectures.dflash2.config import make_dflash2_config
from dflash_train.architectures.family.conv import BlockConv
from dflash_train.architectures.dflash2.model import DFlash2Drafter
from dflash_train.architectures.dflash2.objective import DFlash2Objective
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.target.capture import TargetCapture, load_target_model

D2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def dflash2(target, block_size=4, seed=0, perturb=0.0, **kw) -> DFlash2Drafter:
    torch.manual_seed(seed)
    cfg = make_dflash2_config(target.config, num_draft_layers=2, block_size=block_size, target_layer_ids=[1, 4],
                              mask_token_id=16, **{**D2, **kw})
    d = DFlash2Drafter(cfg)
    if perturb:  # away from the identity start: every convolution tap and codebook non-trivial
        with torch.no_grad():
            for name, p in d.named_parameters():
                if "conv" in name or "selector" in name:
                    p.add_(torch.randn_like(p) * perturb)
    return d.eval()


def brute_force_conv(conv: BlockConv, x: torch.Tensor, side: int, block_len: int) -> torch.Tensor:
    """y_t[c] = sum_o (base[side, o, c] + dyn_t[side, o, c // g]) * x_{t-o}[c], x_{t-o} = 0 before the block."""
    b, q, h = x.shape
    dyn = conv.kernel_projection(x).view(b, q, 2, conv.kernel_size, conv.groups)  # taps from x itself here
    y = torch.zeros_like(x)
    for i in range(b):
        for t in range(q):
            for o in range(conv.kernel_size):
                if t % block_len - o < 0:
                    continue
                for c in range(h):
                    coef = conv.base_kernel[side, o, c] + dyn[i, t, side, o, c // conv.group_size]
                    y[i, t, c] += coef * x[i, t - o, c]
    return y


@pytest.mark.parametrize("kernel,block_len", [(2, 4), (3, 4), (3, 2)])
def test_conv_equals_a_brute_force_loop_and_never_crosses_a_block(kernel, block_len):
    torch.manual_seed(0)
    conv = BlockConv(32, kernel, 8).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.3)
    x = torch.randn(2, 3 * block_len, 32, dtype=torch.float64)
    taps = conv.taps(x)
    for side in (0, 1):
        torch.testing.assert_close(conv(x, taps, side, block_len), brute_force_conv(conv, x, side, block_len))
    # changing block 1's inputs leaves blocks 0 and 2 untouched (the taps too are per position)
    y = conv(x, taps, 0, block_len)
    x2 = x.clone()
    x2[:, block_len:2 * block_len] += 1.0
    y2 = conv(x2, conv.taps(x2), 0, block_len)
    outside = torch.ones(3 * block_len, dtype=torch.bool)
    outside[block_len:2 * block_len] = False
    assert torch.equal(y[:, outside], y2[:, outside]) and not torch.equal(y, y2)


@pytest.mark.parametrize("vocab,k,group", [(8192, 16, 128), (5000, 16, 64), (4099, 5, 32), (1000, 4, 16), (300, 16, 32)])
def test_grouped_topk_is_topk(vocab, k, group):
    gen = torch.Generator().manual_seed(vocab + k)
    scores = torch.randn(33, vocab, generator=gen, dtype=torch.float64)
    # plant the best entries together in one group and spread over the last (partial) group: the hard cases
    scores[0, :k] += 10.0
    scores[1, -min(k, vocab % group or group):] += 10.0
    values, ids = grouped_topk(scores, k, group)
    expect = scores.topk(k, dim=-1)
    assert torch.equal(values, expect.values)
    assert torch.equal(ids, expect.indices)
    # with ties (bf16 logits): the same values, and the ids point at them
    coarse = (scores * 4).round().to(torch.bfloat16)
    values, ids = grouped_topk(coarse, k, group)
    assert torch.equal(values, coarse.topk(k, dim=-1).values)
    assert torch.equal(coarse.gather(1, ids), values)
    assert all(len(set(row.tolist())) == k for row in ids)


def test_an_untrained_dflash2_drafter_computes_what_dflash_does(target):
    """The identity start: with DFlash's weights loaded, the hidden states are DFlash's bit for bit in float64,
    and the selector's walk is the per-slot argmax."""
    d2 = dflash2(target).double()
    torch.manual_seed(1)
    d1 = DFlashDrafter(make_drafter_config(target.config, num_draft_layers=2, block_size=4, target_layer_ids=[1, 4],
                                           mask_token_id=16)).double()
    missing, unexpected = d2.load_state_dict(d1.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "selector" in k for k in missing)
    s, bs = 12, 4
    hidden = torch.randn(1, s, 128, dtype=torch.float64)
    anchors, keep = torch.tensor([[2, 7]]), torch.tensor([[True, True]])
    block = torch.randn(1, 8, 64, dtype=torch.float64)
    pos = torch.cat([torch.arange(s).view(1, -1), (anchors.unsqueeze(-1) + torch.arange(bs)).view(1, -1)], 1)
    mask = dense_mask(anchors, keep, s, bs)
    out1, out2 = d1(hidden, block, pos, sdpa_attention, mask), d2(hidden, block, pos, sdpa_attention, mask)
    torch.testing.assert_close(out2, out1, rtol=0, atol=1e-12)
    head = copy.deepcopy(target.get_output_embeddings()).double()  # .double() of a module is in place
    drafts, _ = d2.draft(out2.view(2, bs, -1), head, torch.tensor([5, 9]))
    assert torch.equal(drafts, head(out1.view(2, bs, -1))[:, 1:].argmax(-1))
    # and away from the identity start, the two differ
    assert not torch.allclose(dflash2(target, perturb=0.1).double()(hidden, block, pos, sdpa_attention, mask), out2)


def reference_codebooks(d: DFlash2Drafter, head_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(predecessor, successor) written out: the free tables, or each factored one as the lm_head rows at unit
    root-mean-square times its projection."""
    sel = d.candidate_selector
    if not sel.factored:
        return sel.predecessor_codebook, sel.successor_codebook
    unit = head_w / head_w.pow(2).mean().sqrt()
    return unit @ sel.predecessor_projection.weight.T, unit @ sel.successor_projection.weight.T


def dense_selector_loss(d: DFlash2Drafter, rows: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor,
                        previous: torch.Tensor, weights, weight: float, covered_only: bool = False):
    """The objective written out densely in float64: full logits, CE, top-k, the label forced in, S, k-way CE.
    `weights`: the rows' weights, or a function of the selector's detached log-probabilities of the labels.
    `covered_only`: the selector's CE counts only where the label is among the top-k."""
    predecessor, successor = reference_codebooks(d, head_w)
    logits = rows @ head_w.T
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    k = d.selector_top_k
    top_v, top_i = logits.detach().topk(k, -1)
    sel = d.candidate_selector
    selector_ce, covered = [], []
    for r in range(rows.shape[0]):
        ids, vals = top_i[r].clone(), top_v[r].clone()
        covered.append(bool(labels[r] in ids))
        if labels[r] not in ids:
            ids[-1], vals[-1] = labels[r], logits[r, labels[r]].detach()
        z = sel.hidden_projection.weight @ rows[r]
        s = vals + torch.stack([(predecessor[previous[r]] * z * successor[i]).sum() for i in ids])
        target_idx = int((ids == labels[r]).nonzero()[0])
        selector_ce.append(torch.logsumexp(s, 0) - s[target_idx])
    selector_ce = torch.stack(selector_ce)
    if callable(weights):
        weights = weights(-selector_ce.detach())
    norm = weights.double() / weights.double().sum()
    if covered_only:
        selector_ce = selector_ce * torch.tensor(covered, dtype=selector_ce.dtype)
    return (ce * norm).sum() + weight * (selector_ce * norm).sum()


def brute_force_acceptance(counted: torch.Tensor, idx: torch.Tensor, floor: float):
    """Acceptance weights by loops: counted slot k of a block weighs max(prod of p over the block's counted slots
    before k, floor), with p = exp of the given per-row log-probability (rows in `idx` order)."""
    def weights(logp: torch.Tensor) -> torch.Tensor:
        p = dict(zip(idx.tolist(), logp.exp().tolist()))
        b, n, bs = counted.shape
        out = []
        for flat in idx.tolist():
            block, slot = divmod(flat, bs)
            reach = 1.0
            for j in range(slot):
                if counted.view(-1, bs)[block, j]:
                    reach *= p[block * bs + j]
            out.append(max(reach, floor))
        return torch.tensor(out, dtype=torch.float64)
    return weights


@pytest.mark.parametrize("selector_weight,weighting,rows,codebooks", [
    (1.0, "gamma", "all", "free"), (0.25, "gamma", "all", "free"), (1.0, "selector", "all", "free"),
    (1.0, "gamma", "covered", "free"), (1.0, "selector", "covered", "free"), (1.0, "gamma", "all", "factored"),
    (1.0, "selector", "covered", "factored")])
def test_the_objective_equals_a_dense_float64_reference(target, selector_weight, weighting, rows, codebooks):
    """gamma weights, or (selector) acceptance weights made of the selector's probabilities of the labels; the
    selector's loss over every counted slot (the label forced in) or over the covered ones only (then on a
    target whose head favours the ten token ids the batch is made of, so that the top-k holds some labels); the
    codebooks free tables or factored through the target's lm_head (gradients reach the projections)."""
    if rows == "covered":
        target = copy.deepcopy(target)
        with torch.no_grad():
            head = target.get_output_embeddings().weight  # tied with the input embeddings
            head[13:].mul_(0.01)
            head[3:13].mul_(10.0)
    d = dflash2(target, perturb=0.1, selector_codebooks=codebooks).double().train()
    if weighting == "selector":  # flat unary logits: the labels' selector probabilities (~1/k) stand apart from
        with torch.no_grad():  # their unary ones (~1/vocab), above the floor
            d.norm.weight.mul_(0.01)
    capture = TargetCapture.from_model(target.double(), [1, 4])
    extra = ({"slot_weighting": "gamma"} if weighting == "gamma" else
             {"slot_weighting": "acceptance", "acceptance_from": "selector", "acceptance_floor": 0.01})
    try:
        cfg = config_from_dict({"drafter": {"architecture": "dflash2", "block_size": 4, "num_draft_layers": 2,
                                            "selector_codebooks": codebooks},
                                "objective": {"max_anchors": 6, "gamma": 3.0, **extra,
                                              "selector_loss_weight": selector_weight, "selector_rows": rows},
                                "data": {"max_length": 64, "token_budget": 256}})
        backend = resolve_backend("sdpa", torch.device("cpu"), 4)
        g = torch.Generator().manual_seed(5)
        # a small id range: labels often outside the top-k (with "covered", often inside it too)
        ids = torch.randint(3, 13 if rows == "covered" else 400, (2, 30), generator=g)
        loss_mask = (torch.rand(2, 30, generator=g) < 0.8).long()
        batch = Batch(ids, loss_mask, torch.tensor([30, 22]))
        objective = DFlash2Objective(d, capture, backend, cfg, torch.float64)
        stats = objective(batch, torch.Generator().manual_seed(7))
        params = [p for p in d.parameters() if p.requires_grad]
        grads = torch.autograd.grad(stats.loss, params, allow_unused=True)

        anchors, keep = sample_anchors(loss_mask, batch.lengths, 4, 6, torch.Generator().manual_seed(7), 1)
        blocks = build_blocks(ids, loss_mask, batch.lengths, anchors, keep, 4, 16, 3.0)
        idx = blocks.counted.view(-1).nonzero().squeeze(1)
        hidden = capture(ids)
        embeds = capture.embed_tokens(blocks.block_ids)
        pos = torch.cat([torch.arange(30).expand(2, 30), blocks.block_positions], 1)
        out = d(hidden, embeds, pos, sdpa_attention, dense_mask(blocks.anchors, blocks.keep, 30, 4))
        out_rows = out.reshape(-1, out.shape[-1])[idx]
        labels = blocks.labels.view(-1)[idx]
        previous = torch.cat([blocks.labels[..., :1], blocks.labels[..., :-1]], -1).view(-1)[idx]
        weights = (blocks.weights.view(-1)[idx] if weighting == "gamma" else
                   brute_force_acceptance(blocks.counted, idx, 0.01))
        ref = dense_selector_loss(d, out_rows, capture.lm_head.weight, labels, previous, weights, selector_weight,
                                  covered_only=rows == "covered")
        ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
        if rows == "covered":  # the batch has slots the top-k misses, so the two choices differ here
            forced = dense_selector_loss(d, out_rows, capture.lm_head.weight, labels, previous, weights,
                                         selector_weight)
            assert abs(float(forced - ref)) > 1e-3
        torch.testing.assert_close(stats.loss, ref, rtol=1e-10, atol=1e-12)
        for p, a, b in zip(params, grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
        successor = "successor_codebook" if codebooks == "free" else "successor_projection.weight"
        assert grads[[n for n, _ in d.named_parameters()].index(f"candidate_selector.{successor}")].abs().sum() > 0
    finally:
        target.float()


def test_greedy_decoding_through_the_selector_is_lossless(target):
    """A non-identity DFlash2 drafter: block and DDTree decoding give the target's own greedy tokens (float32)."""
    dec = SpeculativeDecoder(target, dflash2(target, perturb=0.2), stop_token_ids=[2])
    g = torch.Generator().manual_seed(0)
    for n in (5, 17):
        prompt = torch.randint(3, 49152, (n,), generator=g).tolist()
        ref = dec.generate_target_only(prompt, 24).tokens
        assert dec.generate_block(prompt, 24).tokens == ref
        assert dec.generate_tree(prompt, 24, 12).tokens == ref


def test_tree_candidates_score_every_branch_given_its_own_predecessor(target):
    """DDTree for DFlash2, by hand (the selector's scores in float64): each slot's candidates are its 32 best unary tokens; given a
    candidate of the slot before (the anchor for slot 1) as the previous token, the selector's candidates (the
    first top_k) share the unary mass they hold as softmax(S(a, .)) shares it, the rest keep their unary
    log-probability. Following each best candidate from the anchor gives the selector's greedy path; with the
    identity selector the rows are DFlash's marginals (the tree of an untrained DFlash2 drafter is DFlash's)."""
    d = dflash2(target, block_size=5, perturb=0.3).double()
    head = copy.deepcopy(target.get_output_embeddings()).double()  # .double() of a module is in place
    torch.manual_seed(4)
    hidden = torch.randn(2, 5, 64, dtype=torch.float64)
    anchors = torch.tensor([7, 11])
    lp, cand = d.tree_candidates(hidden, head, anchors, 32)
    c = d.selector_top_k
    assert lp.shape == (2, 4, 32, 32) and cand.shape == (2, 4, 32)
    sel = d.candidate_selector
    logits = d.logits(hidden, head)[:, 1:]
    log_p = torch.log_softmax(logits, -1)
    for n in range(2):
        for t in range(4):
            assert torch.equal(cand[n, t], log_p[n, t].topk(32).indices)
            unary_lp = log_p[n, t, cand[n, t]]
            z = sel.hidden_projection(hidden[n, t + 1])
            for p in range(32):
                prev = anchors[n] if t == 0 else cand[n, t - 1, p]
                s = logits[n, t, cand[n, t, :c]] + sel.successor_codebook[cand[n, t, :c]] @ (sel.predecessor_codebook[prev] * z)
                want = unary_lp.clone()
                want[:c] = torch.log_softmax(s, -1) + unary_lp[:c].logsumexp(0)
                torch.testing.assert_close(lp[n, t, p], want, rtol=1e-10, atol=1e-10)
    path, _, _ = sel.walk(logits.topk(c, -1).values, logits.topk(c, -1).indices, hidden[:, 1:], anchors)
    for n in range(2):
        row, greedy = lp[n, 0, 0], []
        for t in range(4):
            j = int(row.argmax())
            greedy.append(int(cand[n, t, j]))
            row = lp[n, t + 1, j] if t < 3 else None
        assert greedy == path[n].tolist()
    identity = dflash2(target, block_size=5).double()
    lp0, cand0 = identity.tree_candidates(hidden, head, anchors, 32)
    want_lp, want_ids = BlockDrafter.tree_candidates(identity, hidden, head, anchors, 32)
    assert torch.equal(cand0, want_ids)
    torch.testing.assert_close(lp0, want_lp.unsqueeze(2).expand_as(lp0), rtol=1e-5, atol=1e-6)  # float32 logits


@pytest.mark.long  # a statistical test over many draws (~35 s)
def test_sampled_drafts_follow_the_returned_candidate_distribution(target):
    """Speculative sampling is exact when each draft is drawn from the q it reports (the accept rule itself is
    tested in test_spec_decode): slot 1's draws follow q_1, and slot 2's, given slot 1's token, follow q_2."""
    d = dflash2(target, perturb=0.3)
    head = target.get_output_embeddings()
    torch.manual_seed(3)
    hidden = torch.randn(1, 4, 64)
    anchor = torch.tensor([7])
    g = torch.Generator().manual_seed(0)
    trials = 4000
    hidden_n = hidden.expand(trials, 4, 64)
    drafts, q = d.draft(hidden_n, head, anchor.expand(trials), temperature=1.0, generator=g)
    assert q.shape == (trials, 3, 49152) and torch.allclose(q.sum(-1), torch.ones(trials, 3))
    q1 = q[0, 0]
    assert torch.allclose(q[:, 0], q1.expand(trials, -1))  # slot 1 depends on the anchor only
    support = q1.nonzero().squeeze(1)
    assert len(support) == d.selector_top_k
    counts = torch.stack([(drafts[:, 0] == t).sum() for t in support]).double()
    expected = q1[support].double() * trials
    assert float(((counts - expected) ** 2 / expected).sum()) < 18.5  # chi-square, 4 dof, p = 0.001
    first = drafts[:, 0] == support[q1[support].argmax()]  # slot 2 given the likeliest slot-1 token
    q2 = q[first][0, 1]
    assert torch.allclose(q[first][:, 1], q2.expand(int(first.sum()), -1))
    support2 = q2.nonzero().squeeze(1)
    counts2 = torch.stack([(drafts[first, 1] == t).sum() for t in support2]).double()
    expected2 = q2[support2].double() * int(first.sum())
    assert float(((counts2 - expected2) ** 2 / expected2).sum()) < 18.5


def test_sampled_decoding_runs_and_stops(target):
    dec = SpeculativeDecoder(target, dflash2(target, perturb=0.2), stop_token_ids=[2], temperature=0.8, seed=1)
    out = dec.generate_block([5, 9, 33, 4], 20)
    assert len(out.tokens) in range(1, 21) and all(a in range(1, 5) for a in out.accept_lengths)


REFERENCE_TENSORS = {
    "fc.weight", "hidden_norm.weight", "norm.weight", "candidate_selector.hidden_projection.weight",
    "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
} | {f"layers.{i}.{name}" for i in range(2) for name in (
    "attention_conv.base_kernel", "attention_conv.kernel_projection.weight", "mlp_conv.base_kernel",
    "mlp_conv.kernel_projection.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight")}


class MinimalDFlash2(ReaderMath):
    """An independent reading of the reference DFlash2 layout: config.json and safetensors by name, plain tensor
    math, one block per call, context keys recomputed from all captured features every call (no cache)."""

    def __init__(self, folder):
        self.cfg = json.loads((folder / "config.json").read_text())
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            self.w = {k: f.get_tensor(k).float() for k in f.keys()}
        dc = self.cfg["dflash_config"]
        self.bs, self.k, self.g, self.top_k = dc["block_size"], dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_top_k"]
        self.mask_id, self.layer_ids = dc["mask_token_id"], dc["target_layer_ids"]
        self.eps = self.cfg["rms_norm_eps"]
        self.heads, self.kv, self.hd = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"], self.cfg["head_dim"]
        theta = self.cfg.get("rope_theta") or self.cfg["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.hd, 2).float() / self.hd)

    def conv(self, p, x, u, side):
        n, h = x.shape
        dyn = (u @ self.w[p + "kernel_projection.weight"].T).view(n, 2, self.k, h // self.g)
        y = torch.zeros_like(x)
        for o in range(self.k):
            coef = self.w[p + "base_kernel"][side, o] + dyn[:, side, o].repeat_interleave(self.g, -1)
            y[o:] += coef[o:] * x[: n - o]
        return y

    def propose(self, features, anchor, start, embed, head):
        """features [start, K*H] of positions 0..start-1; the block anchored at position `start`."""
        ctx = self.rms(features @ self.w["fc.weight"].T, self.w["hidden_norm.weight"])
        x = embed(torch.tensor([anchor] + [self.mask_id] * (self.bs - 1)))
        qpos, kpos = torch.arange(start, start + self.bs), torch.arange(start + self.bs)
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            u = self.rms(x, self.w[p + "input_layernorm.weight"])
            u = self.conv(p + "attention_conv.", u, u, 0)
            un = self.rms(x, self.w[p + "input_layernorm.weight"])
            q = (u @ self.w[p + "self_attn.q_proj.weight"].T).view(self.bs, self.heads, self.hd)
            kv_in = torch.cat([ctx, u])
            k = (kv_in @ self.w[p + "self_attn.k_proj.weight"].T).view(-1, self.kv, self.hd)
            v = (kv_in @ self.w[p + "self_attn.v_proj.weight"].T).view(-1, self.kv, self.hd)
            q = self.rope(self.rms(q, self.w[p + "self_attn.q_norm.weight"]).transpose(0, 1), qpos)
            k = self.rope(self.rms(k, self.w[p + "self_attn.k_norm.weight"]).transpose(0, 1), kpos)
            rep = self.heads // self.kv
            att = torch.softmax(q @ k.repeat_interleave(rep, 0).transpose(1, 2) / self.hd ** 0.5, -1)
            o = (att @ v.transpose(0, 1).repeat_interleave(rep, 0)).transpose(0, 1).reshape(self.bs, -1)
            x = x + self.conv(p + "attention_conv.", o @ self.w[p + "self_attn.o_proj.weight"].T, un, 1)
            u = self.rms(x, self.w[p + "post_attention_layernorm.weight"])
            m_in = self.conv(p + "mlp_conv.", u, u, 0)
            m = (torch.nn.functional.silu(m_in @ self.w[p + "mlp.gate_proj.weight"].T) * (m_in @ self.w[p + "mlp.up_proj.weight"].T))
            x = x + self.conv(p + "mlp_conv.", m @ self.w[p + "mlp.down_proj.weight"].T, u, 1)
        self.last_hidden = self.rms(x, self.w["norm.weight"])
        h = self.last_hidden[1:]
        logits = head(h)
        z = h @ self.w["candidate_selector.hidden_projection.weight"].T
        drafts, prev = [], anchor
        for t in range(self.bs - 1):
            vals, ids = logits[t].topk(self.top_k)
            pair = (self.w["candidate_selector.predecessor_codebook"][prev] * z[t]) @ self.w["candidate_selector.successor_codebook"][ids].T
            prev = int(ids[(vals + pair).argmax()])
            drafts.append(prev)
        return drafts


def test_export_is_the_reference_layout_and_an_independent_reader_decodes_the_same(target, tmp_path):
    d = dflash2(target, perturb=0.2)
    out = save_drafter(d, tmp_path / "export", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    dc = cfg["dflash_config"]
    for key in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                "output_multiplier", "final_logit_softcapping", "mask_token_id", "target_layer_ids"):
        assert key in dc, key
    assert (dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_rank"], dc["selector_top_k"]) == (2, 16, 8, 5)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == REFERENCE_TENSORS
        assert tuple(f.get_slice("layers.0.attention_conv.base_kernel").get_shape()) == (2, 2, 64)
        assert tuple(f.get_slice("layers.0.attention_conv.kernel_projection.weight").get_shape()) == (2 * 2 * 4, 64)
        assert tuple(f.get_slice("candidate_selector.predecessor_codebook").get_shape()) == (49152, 8)
    loaded = load_drafter(out)
    assert type(loaded) is DFlash2Drafter and loaded.selector_top_k == 5
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    # decode with the independent reader: the same drafts at every step, hence the same tokens and acceptance
    ref = MinimalDFlash2(out)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    dec = SpeculativeDecoder(target, loaded, stop_token_ids=[2])
    prompt = [5, 77, 901, 12, 4, 3000, 18]
    seen = []
    original = dec._draft

    def both(context, anchor, start, dcache):
        drafts, q = original(context, anchor, start, dcache)
        seen.append((drafts.tolist(), anchor, start))
        return drafts, q

    dec._draft = both
    result = dec.generate_block(prompt, 20)
    # the target's own features of the accepted text, from one full forward
    text = prompt + result.tokens
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([text]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0] for i in ref.layer_ids], -1)
    with torch.no_grad():
        for drafts, anchor, start in seen:
            assert ref.propose(feats[:start], anchor, start, embed, head) == drafts
            block = torch.tensor([[anchor] + [ref.mask_id] * 3])
            ours = loaded(feats[None, :start], embed(block), torch.arange(start + 4).view(1, -1), sdpa_attention, None)
            torch.testing.assert_close(ours[0], ref.last_hidden, rtol=1e-4, atol=1e-5)  # the numbers, not just argmaxes
    assert len(seen) == len(result.accept_lengths) and sum(result.accept_lengths) >= len(result.tokens) - 1


@pytest.mark.parametrize("weights", [{"gamma": 4.0}, {"slot_weighting": "acceptance", "acceptance_from": "selector"}])
def test_a_dflash2_run_trains_exports_and_evaluates(tiny_target_dir, counting_jsonl, tmp_path, weights):
    from dflash_train.train.trainer import train

    cfg = config_from_dict({
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"architecture": "dflash2", "num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa",
                    "selector_rank": 8, "selector_top_k": 4},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16, **weights},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 0},
    })
    train(cfg, tmp_path / "R", max_steps=4)
    status = json.loads((tmp_path / "R" / "status.json").read_text())
    assert status["phase"] == "done", status
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
    steps = [r for r in records if "selector_loss" in r]
    assert len(steps) == 4 and all(0 <= r["unary_accuracy"] <= 1 and 0 <= r["candidate_coverage"] <= 1 for r in steps)
    assert steps[-1]["candidate_coverage"] > 0
    # the selector picks from the strict candidates: its hits never exceed the label's presence among them
    assert all(r["accuracy"] <= r["candidate_coverage"] + 1e-9 for r in steps)
    # selector_rows=covered (the default): a loss exactly where some counted label is among the candidates
    assert all((r["selector_loss"] > 0) == (r["candidate_coverage"] > 0) for r in steps)
    drafter = load_drafter(tmp_path / "R" / "export")
    assert type(drafter) is DFlash2Drafter
    assert architecture("dflash2").drafter_class is DFlash2Drafter
    # training moved the selector away from its identity start
    assert drafter.candidate_selector.successor_codebook.abs().sum() > 0


def test_dflash2_with_the_newer_fields_stays_lossless_and_exports_them(target, tmp_path):
    """DFlash2 with a sliding window, in-block causality and a softcap: greedy block and tree decoding equal the
    target's own output, and the export carries the fields a reference reader needs."""
    d = dflash2(target, perturb=0.2, sliding_window=6, causal=True, final_logit_softcapping=5.0)
    assert d.final_logit_softcapping == 5.0 and d.needs_masks
    dec = SpeculativeDecoder(target, d, stop_token_ids=[2])
    prompt = [5, 77, 901, 12, 4, 3000, 18, 44, 9]
    ref = dec.generate_target_only(prompt, 20).tokens
    assert dec.generate_block(prompt, 20).tokens == ref and dec.generate_tree(prompt, 20, 8).tokens == ref
    cfg = json.loads((save_drafter(d, tmp_path / "x") / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 6 and cfg["is_causal"] is True
    assert cfg["dflash_config"]["final_logit_softcapping"] == 5.0
    assert load_drafter(tmp_path / "x").final_logit_softcapping == 5.0


def test_acceptance_from_selector_is_refused_where_there_is_no_selector_or_no_acceptance_weighting():
    from dflash_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'objective.acceptance_from'.*drafter.architecture=dflash2"):
        config_from_dict({"objective": {"acceptance_from": "selector"}})
    with pytest.raises(ConfigError, match=r"'objective.acceptance_from'.*'gamma'"):
        config_from_dict({"drafter": {"architecture": "dflash2"},
                          "objective": {"acceptance_from": "selector", "slot_weighting": "gamma"}})
    cfg = config_from_dict({"drafter": {"architecture": "dflash2"},
                            "objective": {"acceptance_from": "selector", "slot_weighting": "dpace"}})
    assert cfg.options.acceptance_from == "selector"


def test_the_selector_trains_at_its_own_learning_rate_through_the_schedule(target):
    """`drafter.selector_lr_scale`: one AdamW step from the same gradients moves each selector weight by scale x
    what it moves at scale 1, every other weight by the same amount, at every step of the warm-up and decay."""
    from dflash_train.train.loop.step import lr_factor, make_optimizer

    def steps(scale: float) -> list[dict[str, torch.Tensor]]:
        d = dflash2(target, perturb=0.1)
        cfg = config_from_dict({"drafter": {"architecture": "dflash2", "selector_lr_scale": scale},
                                "optim": {"lr": 1e-3, "warmup_ratio": 0.5, "schedule": "cosine"}})
        opt = make_optimizer(d, cfg, architecture("dflash2"))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 4, 0.5, 0.0, "cosine", 0.2))
        g = torch.Generator().manual_seed(3)
        grads = {n: torch.randn(p.shape, generator=g) for n, p in d.named_parameters()}
        moves = []
        for _ in range(3):
            before = {n: p.detach().clone() for n, p in d.named_parameters()}
            for n, p in d.named_parameters():
                p.grad = grads[n].clone()
            opt.step()
            sched.step()
            moves.append({n: p.detach() - before[n] for n, p in d.named_parameters()})
        return moves

    plain, scaled = steps(1.0), steps(10.0)
    selector = [n for n in plain[0] if n.startswith("candidate_selector.")]
    assert len(selector) == 3
    for a, b in zip(plain, scaled):
        for n in a:
            want = a[n] * 10 if n in selector else a[n]
            torch.testing.assert_close(b[n], want, rtol=1e-4, atol=1e-9)
        assert a[selector[0]].abs().sum() > 0


def test_a_selector_learning_rate_is_refused_without_a_selector():
    from dflash_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'drafter.selector_lr_scale'.*drafter.architecture=dflash2"):
        config_from_dict({"drafter": {"selector_lr_scale": 10}})
    with pytest.raises(ConfigError, match=r"'drafter.selector_lr_scale'.*> 0"):
        config_from_dict({"drafter": {"architecture": "dflash2", "selector_lr_scale": 0}})


def test_a_selector_rows_choice_is_refused_without_a_selector():
    from dflash_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'objective.selector_rows'.*drafter.architecture=dflash2"):
        config_from_dict({"objective": {"selector_rows": "all"}})
    assert config_from_dict({"drafter": {"architecture": "dflash2"},
                             "objective": {"selector_rows": "all"}}).options.selector_rows == "all"
    assert config_from_dict({"drafter": {"architecture": "dflash2"}}).options.selector_rows == "covered"


def test_factored_codebooks_are_the_heads_rows_through_two_projections_and_start_as_the_identity(target):
    """Each factored codebook is the lm_head's rows at unit root-mean-square times its projection (float64, written
    out); the successor starts at zero (S = U: the walk is the per-slot argmax) and the predecessor's entries at the
    free table's scale. Decoding recomputes its cached tables once a projection changes."""
    d = dflash2(target, selector_codebooks="factored").double()
    sel = d.candidate_selector
    head = copy.deepcopy(target.get_output_embeddings()).double()
    assert sel.factored and not hasattr(sel, "predecessor_codebook")
    predecessor, successor = sel.codebooks(head.weight)
    want_p, want_s = reference_codebooks(d, head.weight)
    torch.testing.assert_close(predecessor, want_p, rtol=1e-9, atol=1e-13)
    assert torch.equal(successor, torch.zeros(49152, 8, dtype=torch.float64))
    assert 0.015 < float(predecessor.std()) < 0.025  # the free table's N(0, 0.02)
    torch.manual_seed(2)
    hidden = torch.randn(3, 4, 64, dtype=torch.float64)
    drafts, _ = d.draft(hidden, head, torch.tensor([5, 9, 11]))
    assert torch.equal(drafts, d.logits(hidden, head)[:, 1:].argmax(-1))
    with torch.no_grad():
        first = sel.decode_codebooks(head.weight)
        assert sel.decode_codebooks(head.weight)[0] is first[0]  # reused while nothing changed
        sel.successor_projection.weight.add_(torch.randn_like(sel.successor_projection.weight))
        again = sel.decode_codebooks(head.weight)
    torch.testing.assert_close(again[1], reference_codebooks(d, head.weight)[1], rtol=1e-9, atol=1e-13)
    assert again[1].abs().sum() > 0
    # training's fused AdamW updates the projections in place without bumping their tensor versions
    optimizer = torch.optim.AdamW(sel.parameters(), lr=0.1, fused=True)
    for p in sel.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    with torch.no_grad():
        stepped = sel.decode_codebooks(head.weight)
    torch.testing.assert_close(stepped[0], reference_codebooks(d, head.weight)[0], rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(stepped[1], reference_codebooks(d, head.weight)[1], rtol=1e-9, atol=1e-13)
    assert not torch.allclose(stepped[1], again[1])
    with pytest.raises(ValueError, match="lm_head weight"):
        sel.codebooks(None)


def test_a_factored_selector_exports_free_tables_that_an_independent_reader_decodes_the_same(target, tmp_path):
    """A training checkpoint keeps the projections (config: selector_codebooks factored; reloads as it was); the
    export is the reference layout, whose tables the independent reader decodes into the drafts the factored
    drafter proposes, step by step."""
    d = dflash2(target, perturb=0.2, selector_codebooks="factored")
    ckpt = save_drafter(d, tmp_path / "ckpt", dtype="float32")
    assert json.loads((ckpt / "config.json").read_text())["dflash_config"]["selector_codebooks"] == "factored"
    again = load_drafter(ckpt)
    assert again.candidate_selector.factored
    assert all(torch.equal(again.state_dict()[k], v) for k, v in d.state_dict().items())

    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    out = save_drafter(d.materialized(head.weight), tmp_path / "export", dtype="float32")
    assert "selector_codebooks" not in json.loads((out / "config.json").read_text())["dflash_config"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == REFERENCE_TENSORS
    exported = load_drafter(out)
    assert not exported.candidate_selector.factored
    want_p, want_s = reference_codebooks(d, head.weight)
    torch.testing.assert_close(exported.candidate_selector.successor_codebook, want_s, rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(exported.candidate_selector.predecessor_codebook, want_p, rtol=1e-4, atol=2e-6)

    ref = MinimalDFlash2(out)
    dec = SpeculativeDecoder(target, d, stop_token_ids=[2])
    seen, original = [], dec._draft

    def both(context, anchor, start, dcache):
        drafts, q = original(context, anchor, start, dcache)
        seen.append((drafts.tolist(), anchor, start))
        return drafts, q

    dec._draft = both
    prompt = [5, 77, 901, 12, 4, 3000, 18]
    result = dec.generate_block(prompt, 20)
    assert result.tokens == dec.generate_target_only(prompt, 20).tokens
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([prompt + result.tokens]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0] for i in ref.layer_ids], -1)
        for drafts, anchor, start in seen:
            assert ref.propose(feats[:start], anchor, start, embed, head) == drafts
    assert len(seen) == len(result.accept_lengths)


def test_a_factored_dflash2_run_trains_resumes_and_exports_the_reference_layout(tiny_target_dir, counting_jsonl,
                                                                                 tmp_path):
    """Whole trainer: the checkpoints hold the trained projections, a resume continues from them, the run's export
    and `dflash-train export` of a checkpoint (the target found through the run's config) carry the free tables
    computed from them; an export without the run's config says to pass --target."""
    from dflash_train.cli import main
    from dflash_train.commands.export import export_checkpoint
    from dflash_train.train.trainer import train

    cfg = config_from_dict({
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"architecture": "dflash2", "num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa",
                    "selector_rank": 8, "selector_top_k": 4, "selector_codebooks": "factored"},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16, "selector_rows": "all"},  # the random start's top-4 rarely holds a label
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 2, "progress_bar": False, "eval_every": 0},
    })
    run = tmp_path / "R"
    train(cfg, run, max_steps=2)
    first = load_drafter(run / "checkpoints" / "step-00000002" / "drafter")
    assert first.candidate_selector.factored and first.candidate_selector.successor_projection.weight.abs().sum() > 0
    train(cfg, run, max_steps=4, resume=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if "selector_loss" in r) == [1, 2, 3, 4]
    ckpt = run / "checkpoints" / "step-00000004"
    trained = load_drafter(ckpt / "drafter")
    assert not torch.equal(trained.candidate_selector.successor_projection.weight,
                           first.candidate_selector.successor_projection.weight)
    head_w = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu")).get_output_embeddings().weight
    want_p, want_s = reference_codebooks(trained, head_w.detach())
    for folder in (run / "export", export_checkpoint(ckpt, tmp_path / "X", dtype="float32")):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert set(k for k in f.keys() if k.startswith("candidate_selector.")) == {
                "candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                "candidate_selector.successor_codebook"}
        exported = load_drafter(folder, dtype=torch.float32)
        tol = dict(rtol=1e-4, atol=2e-6) if folder.name == "X" else dict(rtol=2e-2, atol=1e-4)  # run export: bf16
        torch.testing.assert_close(exported.candidate_selector.successor_codebook, want_s, **tol)
        torch.testing.assert_close(exported.candidate_selector.predecessor_codebook, want_p, **tol)
    # without the run's config.yaml the export cannot find the target's lm_head: one clear line, no traceback
    lone = tmp_path / "lone" / "checkpoints" / "step-00000004"
    lone.parent.mkdir(parents=True)
    import shutil
    shutil.copytree(ckpt, lone)
    assert main(["export", str(lone), "--out", str(tmp_path / "Y")]) != 0
    assert not (tmp_path / "Y").exists()
    assert main(["export", str(lone), "--out", str(tmp_path / "Y"), "--target", str(tiny_target_dir)]) == 0
    assert load_drafter(tmp_path / "Y").candidate_selector.successor_codebook.abs().sum() > 0
    # a checkpoint's drafter folder on its own is no reference export yet: export takes it, with --target
    solo = tmp_path / "solo"
    shutil.copytree(ckpt / "drafter", solo)
    assert main(["export", str(solo), "--out", str(tmp_path / "Z")]) != 0 and not (tmp_path / "Z").exists()
    assert main(["export", str(solo), "--out", str(tmp_path / "Z"), "--target", str(tiny_target_dir)]) == 0
    assert not load_drafter(tmp_path / "Z").candidate_selector.factored


def test_factored_codebooks_are_refused_without_a_selector():
    from dflash_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'drafter.selector_codebooks'.*drafter.architecture=dflash2"):
        config_from_dict({"drafter": {"selector_codebooks": "factored"}})
    with pytest.raises(ConfigError, match=r"'drafter.selector_codebooks'"):
        config_from_dict({"drafter": {"architecture": "dflash2", "selector_codebooks": "tied"}})
