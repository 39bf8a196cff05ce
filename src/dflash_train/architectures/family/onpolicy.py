"""The on-policy stage's objective (Draft-OPD, arXiv 2605.29343; `onpolicy.start_from`), at temperature 0, for a
member that declares it (`registry.Options.on_policy`, `Architecture.onpolicy_objective`). The drafter's
probabilities q are those of its own decoding (`draft_log_probs`): each slot's softmax here; a member whose greedy
walk reads more than its slot's logits (a selector, a lattice) overrides that one method.

The data are the target's own greedy answers, so greedy speculative decoding of a row commits exactly its tokens;
what the drafter changes is where each step's block starts and what it drafts. Per micro-batch:

1. acceptance at every anchor, without gradients: the drafter's greedy proposals of a block at every supervised
   position, checked against the target's argmax there (verification), the leading run of matches;
2. the decoding chain of each answer: the first anchor is its first token (the prefill yields it), the next one
   `anchor + accepted + 1` (the target's correction or bonus token anchors the next block);
3. the drafter's blocks at the chain's anchors, with gradients, and two streams of single-token estimators (the
   official implementation's):
   - committed: every slot up to the first rejection, included, on the token the step commits there (the data's),
     `l = p log(p / q) + (1 - p) log((1 - p) / (1 - q))`, p and q the target's and the drafter's probabilities of it;
   - rejected: the first rejected slot k on the draft d the rollout proposed there (step 1's, not drafted again:
     the gradient pass's argmax may differ by a rounding), `l = exp(r) - r - 1`, `r = log p(d) - log q(d)`
     (k3, an estimate of KL(q || p)), weighted `decay ** (k - 1)`;
   `L = (w_c sum l_c + w_r sum decay^(k-1) l_r) / (w_c N_c + w_r sum decay^(k-1))`, each l clamped to `loss_max`,
   log-probabilities to `log_prob_min`; the denominator is the micro-batch's share of the step's (`StepStats.
   normaliser`): the step normalises over every micro-batch and rank, as the official counts are global.

Only the first rejected draft is scored: the drafts before it were accepted, so its target distribution is the
target's at that position of the committed sequence. A later draft sits behind a wrong token, whose distribution
only a verify pass over the drafted prefix gives (the official SGLang fork records it; its vLLM patch and SpecForge's
variant keep the first rejection only, as here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...config.schema import Config
from ...data.batch import Batch
from ..stats import StepStats
from .blocks import Blocks, anchors_a_row
from .loss import CEOptions, chunked_ce_rows
from .objective import BlockObjective, block_stats, shifted_stats


def wide(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32, or wider (float64 in tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


Chain = list[tuple[int, int, int]]  # one row's decoding steps: (anchor, drafts accepted, the first draft rejected)


@dataclass
class DraftLogProbs:
    """The drafter's decoding distribution q at the chain's counted rows, given the committed tokens before each."""

    label: torch.Tensor  # [M] log q of each row's committed token, with gradient
    draft: torch.Tensor  # [R] log q of the rollout's draft at each rejected row, with gradient
    correct: torch.Tensor  # [M] whether q's argmax is the committed token


def decode_chain(accepted: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                 rejected: Optional[torch.Tensor] = None) -> list[Chain]:
    """Each row's decoding steps `(anchor, drafts accepted there, the first draft rejected there)` (host tensors;
    `rejected [B, S]` the rollout's draft after the accepted ones at each anchor, -1 where every draft was accepted
    or none is given): every run of supervised positions (an answer) starts a chain at its first position; the next
    anchor is `a + accepted[a] + 1`, while it leaves a later position of the run."""
    chains = []
    rejected = torch.full_like(accepted, -1) if rejected is None else rejected
    for row, rej, mask, length in zip(accepted.tolist(), rejected.tolist(), loss_mask.tolist(), lengths.tolist()):
        steps, p = [], 0
        while p < length:
            if not mask[p]:
                p += 1
                continue
            end = p
            while end + 1 < length and mask[end + 1]:
                end += 1
            a = p
            while a < end:
                steps.append((a, row[a], rej[a]))
                a += row[a] + 1
            p = end + 1
        chains.append(steps)
    return chains


def accept_lengths(drafts: torch.Tensor, target_next: torch.Tensor, anchors: torch.Tensor,
                   counted: torch.Tensor) -> torch.Tensor:
    """`[B, N]` drafts accepted at each anchor: the leading run of drafts j >= 0 (`drafts [B, N, D]`, the tokens at
    `anchor + 1 + j`) equal to the target's argmax at `anchor + j` (`target_next [B, S]`, the token it predicts
    next) whose labels count (`counted [B, N, D]`, the drafts' slots: supervised, inside the row)."""
    at = (anchors.unsqueeze(-1) + torch.arange(drafts.shape[-1], device=anchors.device))
    verified = torch.gather(target_next, 1, at.clamp(max=target_next.shape[1] - 1).view(at.shape[0], -1))
    return ((drafts == verified.view_as(drafts)) & counted).long().cumprod(-1).sum(-1)


def softmax_log_probs(rows: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rej: torch.Tensor,
                      drafts: torch.Tensor, chunk_size: int) -> DraftLogProbs:
    """`DraftLogProbs` of q = softmax(rows @ weight.T) (chunked over the vocabulary; a weight that requires grad
    gets its gradient) at the labels and at the rollout's `drafts [R]` of the rejected rows."""
    res = chunked_ce_rows(rows, weight, labels, CEOptions(chunk_size))
    logq = wide(-res.loss)
    h_rej = rows.index_select(0, rej)
    gap = wide(torch.einsum("mh,mh->m", h_rej, (weight[drafts] - weight[labels.index_select(0, rej)]).to(h_rej.dtype)))
    return DraftLogProbs(logq, logq.index_select(0, rej) + gap, res.correct)  # log q(d) = log q(c) + z_d - z_c


def committed_loss(logp: torch.Tensor, logq: torch.Tensor, low: float) -> torch.Tensor:
    """The Bernoulli forward KL at the realised token, from its log-probabilities under the target (`logp`) and the
    drafter (`logq`), both clamped to `low`."""
    logp, logq = logp.clamp_min(low), logq.clamp_min(low)
    p = logp.exp()
    log1m = lambda lp: torch.log(-torch.expm1(lp.clamp_max(-1e-7))).clamp_min(low)  # noqa: E731 (log(1 - e^lp))
    return p * (logp - logq) + (1 - p) * (log1m(logp) - log1m(logq))


def rejected_loss(logp: torch.Tensor, logq: torch.Tensor, low: float) -> torch.Tensor:
    """k3's estimate of KL(q || p) at the draft: `exp(r) - r - 1`, `r = log p - log q` (clamped to [-10, 10])."""
    r = (logp.clamp_min(low) - logq.clamp_min(low)).clamp(-10.0, 10.0)
    return r.exp() - r - 1


def onpolicy_total(committed: torch.Tensor, rejected: torch.Tensor, rejected_weights: torch.Tensor,
                   cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """`(w_c sum l_c + w_r sum w_k l_r) / (w_c N_c + w_r sum w_k)`, each term clamped to `onpolicy.loss_max`, and
    its denominator (the micro-batch's share of the step's: `StepStats.normaliser`)."""
    o = cfg.onpolicy
    numerator = (o.committed_weight * committed.clamp_max(o.loss_max).sum()
                 + o.rejected_weight * (rejected_weights * rejected.clamp_max(o.loss_max)).sum())
    denominator = o.committed_weight * committed.numel() + o.rejected_weight * rejected_weights.sum()
    return numerator / denominator.clamp_min(1e-6), denominator.detach()


class OnPolicyObjective(BlockObjective):
    """Draft-OPD on a micro-batch of the target's own answers (module docstring)."""

    # Whether `draft_log_probs` reads every slot of the chain's blocks (a head over whole blocks), not only the
    # counted rows.
    whole_blocks = False
    # The block slot whose label is the first draft (the token after the anchor): 1 where slot k labels `a + k`,
    # 0 in a shifted layout, where slot k labels `a + k + 1`.
    first_draft_slot = 1

    def describe(self) -> str:
        o = self.cfg.onpolicy
        return (f"on-policy (Draft-OPD, greedy): at the anchors greedy speculative decoding visits, "
                f"{o.committed_weight:g} x forward KL on each step's committed tokens + {o.rejected_weight:g} x "
                f"reverse KL (k3) on the first rejected draft, decay {o.decay:g} a slot")

    def __call__(self, batch: Batch, generator: torch.Generator, call: Optional[Callable] = None,
                 hidden: Optional[torch.Tensor] = None) -> StepStats:
        if hidden is not None:
            raise ValueError("the on-policy stage verifies drafts with the target's logits, which a capture computed "
                             "on another rank (parallel.placement=split) does not carry")
        features, final = self.target.capture(batch.input_ids, with_final=True)
        plan = batch.host if batch.host is not None else batch
        target_next = self.target_argmax(final)  # [B, S]: the token the target puts after each position
        chains = self.trained_steps(self.chains(batch, plan, features, target_next.cpu()), generator)
        blocks, idx, rejected_at, drafts = self.chain_blocks(plan, chains, batch.input_ids.device)
        if self.whole_blocks:
            every = torch.arange(blocks.counted.numel(), device=idx.device)
            out = self.block_rows(batch, features, blocks, every, call or self.drafter)
            rows = out.index_select(0, idx)
        else:
            out, rows = None, self.block_rows(batch, features, blocks, idx, call or self.drafter)
        with self.autocast(batch.input_ids.device):
            return self.chain_loss(rows, blocks, idx, rejected_at, drafts, final, target_next, out)

    # ------------------------------------------------------------ decoding's chain under the current weights

    @torch.no_grad()
    def target_argmax(self, final: torch.Tensor) -> torch.Tensor:
        """`[B, S]` the target's greedy token after each position, from its final normed states (chunked)."""
        head = self.target.lm_head.weight
        flat = final.reshape(-1, final.shape[-1])
        step = self.cfg.objective.loss_chunk_size
        out = [(flat[i:i + step].to(head.dtype) @ head.T).argmax(-1) for i in range(0, flat.shape[0], step)]
        return torch.cat(out).view(final.shape[:2])

    @torch.no_grad()
    def chains(self, batch: Batch, plan: Batch, features: torch.Tensor,
               target_next: torch.Tensor) -> list[Chain]:
        """Each row's decoding anchors: the drafter's proposals at every supervised position (in passes of as many
        anchors a row as training's micro-batch of these rows takes), their acceptance, and the chain through them
        with the draft each step's first rejection was of (the rollout's, which the rejected stream scores)."""
        b, s = plan.input_ids.shape
        pos = torch.arange(s)
        candidates = (plan.loss_mask > 0) & (pos.view(1, -1) + 1 < plan.lengths.view(-1, 1))
        accepted = torch.zeros(b, s, dtype=torch.long)
        rejected = torch.full((b, s), -1, dtype=torch.long)
        multiple = self.backend.blocks_multiple_of
        per_pass = int(anchors_a_row(b, self.cfg.objective.max_anchors, self.cfg.objective.max_anchors_per_batch,
                                     multiple))
        order = [row.nonzero().squeeze(1) for row in candidates]
        most = max((len(o) for o in order), default=0)
        for start in range(0, most, per_pass):
            taken = [o[start:start + per_pass] for o in order]
            n = -(-max(len(t) for t in taken) // multiple) * multiple
            anchors = torch.zeros(b, n, dtype=torch.long)
            keep = torch.zeros(b, n, dtype=torch.bool)
            for r, t in enumerate(taken):
                anchors[r, :len(t)], keep[r, :len(t)] = t, True
            blocks = self.build_blocks(plan, anchors, keep)
            device_blocks = blocks.to(batch.input_ids.device)
            every = torch.arange(blocks.counted.numel(), device=batch.input_ids.device)
            out = self.block_rows(batch, features, device_blocks, every, self.drafter)
            bs = self.drafter.block_size
            hidden = out.view(b * n, bs, -1)
            anchor_ids = device_blocks.block_ids.view(b * n, bs)[:, 0]
            # the proposals' vocabulary scores [blocks, bs, V], a loss chunk's rows at a time (what training's memory
            # estimate holds for the CE), not every block's at once
            per_call = max(1, self.cfg.objective.loss_chunk_size // bs)  # blocks
            with self.autocast(batch.input_ids.device):  # a member's own head (float32 masters) meets bf16 states
                drafts = torch.cat([self.drafter.greedy_proposals(hidden[i:i + per_call], self.target.lm_head,
                                                                  anchor_ids[i:i + per_call]).drafts
                                    for i in range(0, b * n, per_call)])
            drafts = drafts.view(b, n, -1).cpu()
            f = self.first_draft_slot
            got = accept_lengths(drafts, target_next, anchors, blocks.counted[..., f:f + drafts.shape[-1]])
            width = drafts.shape[-1]
            first_miss = drafts.gather(-1, got.clamp(max=width - 1).unsqueeze(-1)).squeeze(-1)
            first_miss = torch.where(got < width, first_miss, -1)
            for r, t in enumerate(taken):
                accepted[r, t], rejected[r, t] = got[r, :len(t)], first_miss[r, :len(t)]
        return decode_chain(accepted, plan.loss_mask, plan.lengths, rejected)

    def trained_steps(self, chains: list[Chain], generator: torch.Generator) -> list[Chain]:
        """The steps of each chain this micro-batch trains on: all of them, or a random subset (in chain order) of
        `onpolicy.max_blocks` a row (0: `objective.max_anchors`), capped as training's anchors are (`objective.
        max_anchors_per_batch` shared by the rows, `blocks.anchors_a_row`): every row's blocks are padded to the
        longest row's, so rows x the most steps a row stays within training's memory estimate."""
        per_row = int(anchors_a_row(len(chains), self.cfg.onpolicy.max_blocks or self.cfg.objective.max_anchors,
                                    self.cfg.objective.max_anchors_per_batch, self.backend.blocks_multiple_of))
        kept = [sorted(torch.randperm(len(c), generator=generator)[:per_row].tolist()) if len(c) > per_row
                else list(range(len(c))) for c in chains]
        return [[c[i] for i in row] for c, row in zip(chains, kept)]

    def chain_blocks(self, plan: Batch, chains: list[Chain],
                     device: torch.device) -> tuple[Blocks, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks at the chains' anchors, counting each block's committed slots (the accepted drafts and the
        draft after them, whose token the target corrects; drafted and supervised ones only), which counted rows
        hold the rejected draft (`[M]` bool, in `idx` order: the correction's slot, inside the block) and the
        rollout's draft there (`[R]`, in the same order)."""
        b, bs, multiple = plan.input_ids.shape[0], self.drafter.block_size, self.backend.blocks_multiple_of
        n = max(-(-max((len(c) for c in chains), default=1) // multiple) * multiple, multiple)
        anchors = torch.zeros(b, n, dtype=torch.long)
        accepted = torch.zeros(b, n, dtype=torch.long)
        proposed = torch.full((b, n), -1, dtype=torch.long)  # the rollout's draft after the accepted ones
        keep = torch.zeros(b, n, dtype=torch.bool)
        for r, steps in enumerate(chains):
            if steps:
                anchors[r, :len(steps)], accepted[r, :len(steps)], proposed[r, :len(steps)] = \
                    torch.tensor(steps, dtype=torch.long).T
                keep[r, :len(steps)] = True
        blocks = self.build_blocks(plan, anchors, keep)
        slot = torch.arange(bs).view(1, 1, -1)
        correction = accepted.unsqueeze(-1) + self.first_draft_slot
        drafted = (slot >= self.first_draft_slot) & (slot < self.first_draft_slot + self.drafter.num_drafts())
        counted = blocks.counted & drafted & (slot <= correction)
        rejected = counted & (slot == correction)
        fields = {**blocks.moved(torch.device("cpu")), "counted": counted, "weights": blocks.weights * counted}
        fields.pop("work")
        chain = type(blocks)(**fields)
        idx = chain.counted.view(-1).nonzero().squeeze(1)
        at = rejected.view(-1)[idx]
        drafts = proposed.unsqueeze(-1).expand(-1, -1, bs).reshape(-1)[idx][at]
        if bool((drafts < 0).any()):
            raise ValueError("a chain step with a rejected slot carries no rollout draft")
        return chain.to(device), idx.to(device), at.to(device), drafts.to(device)

    # ------------------------------------------------------------ the two streams

    def chain_loss(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor, rejected_at: torch.Tensor,
                   drafts: torch.Tensor, final: torch.Tensor, target_next: torch.Tensor,
                   out: Optional[torch.Tensor] = None) -> StepStats:
        o, low = self.cfg.onpolicy, self.cfg.onpolicy.log_prob_min
        bs = self.drafter.block_size
        labels = blocks.labels.view(-1).index_select(0, idx)
        rej = rejected_at.nonzero().squeeze(1)
        q = self.draft_log_probs(rows, blocks, idx, labels, rej, drafts, out)
        positions = self.label_positions(blocks, idx, final.shape[1])
        with torch.no_grad():
            logp_label, logp_draft = self.target_logprobs(final, positions, labels, positions.index_select(0, rej),
                                                          drafts)
            off_target = (target_next.to(labels.device).view(-1).index_select(0, positions - 1) != labels).sum()
        weights = (o.decay ** ((idx.index_select(0, rej) % bs) - self.first_draft_slot)).to(wide(q.draft).dtype)
        committed = committed_loss(logp_label, wide(q.label), low)
        rejected = rejected_loss(logp_draft, wide(q.draft), low)
        loss, normaliser = onpolicy_total(committed, rejected, weights, self.cfg)
        stats = self.chain_stats(loss, q.correct, blocks, idx)
        stats.normaliser = normaliser
        zero = loss.detach() * 0
        stats.extra.update({
            "onpolicy_committed_loss": committed.detach().mean() if committed.numel() else zero,
            "onpolicy_rejected_loss": rejected.detach().mean() if rejected.numel() else zero,
            "onpolicy_rejected": rejected_at.sum(),
            "onpolicy_off_target": off_target})
        return stats

    def draft_log_probs(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor, labels: torch.Tensor,
                        rej: torch.Tensor, drafts: torch.Tensor, out: Optional[torch.Tensor] = None) -> DraftLogProbs:
        """q at the counted rows `rows [M, H]` (`labels [M]` their committed tokens, `rej [R]` the rows holding a
        rejected draft, `drafts [R]` the rollout's draft there; `out`: every slot's output `[B * N * bs, H]` where
        `whole_blocks`): each slot's softmax over the target's lm_head."""
        return softmax_log_probs(rows, self.target.lm_head.weight, labels, rej, drafts,
                                 self.cfg.objective.loss_chunk_size)

    def chain_stats(self, loss: torch.Tensor, correct: torch.Tensor, blocks: Blocks, idx: torch.Tensor) -> StepStats:
        """The step's sums from the counted rows' hits (the layout's acceptance estimate: a shifted layout's where
        slot 0 drafts)."""
        stats = shifted_stats if self.first_draft_slot == 0 else block_stats
        return stats(loss, correct, blocks, idx)

    def label_positions(self, blocks: Blocks, idx: torch.Tensor, seq: int) -> torch.Tensor:
        """The flat `[B * S]` position of each counted row's label (its slot's own, one on in a shifted layout)."""
        offset = torch.arange(blocks.anchors.shape[0], device=idx.device).view(-1, 1) * seq
        shift = 1 - self.first_draft_slot
        return (blocks.block_positions + shift + offset).view(-1).index_select(0, idx)

    def target_logprobs(self, final: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
                        draft_positions: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's log-probabilities (float32) of `labels` at their flat positions, and of `drafts` at theirs:
        from the final normed states one position before (those predict the token), through its lm_head."""
        head = self.target.lm_head.weight
        flat = final.reshape(-1, final.shape[-1])
        step = self.cfg.objective.loss_chunk_size

        def at(where: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            out = [torch.log_softmax(wide(flat.index_select(0, where[i:i + step] - 1).to(head.dtype) @ head.T), -1)
                   .gather(1, tokens[i:i + step, None]).squeeze(1) for i in range(0, where.shape[0], step)]
            return torch.cat(out) if out else wide(flat.new_zeros(0))

        return at(positions, labels), at(draft_positions, drafts)
