"""Greedy acceptance by replay: the tau of real greedy speculative decoding, computed from the target's own
greedy continuation instead of by decoding step by step.

Under greedy verification the output is the target's greedy continuation `y` whatever the drafter does
(lossless), and what a step accepts depends only on `y`: at anchor position `s` the drafter sees the
target's hidden states of positions `< s` and the block `[y_s, MASK ...]`; the step accepts the longest
prefix of its proposals (block) or the deepest path of its tree (DDTree) that agrees with `y`, plus the
target's bonus token, and the next step is anchored where that ends. So:

1. generate `y` once per prompt, batched, with the target alone (`greedy_continuations`), a block longer
   than `max_new_tokens` so that the last step can verify past it as real decoding does;
2. per turn, one target forward over prompt + `y` and one drafter forward with an anchor at every
   generated position (the training layout, `dense_masks`: one per layer kind), giving every possible step's
   proposals (`embed_block` inputs, `logits` scores: what decoding forms);
3. walk from the first generated token, jumping by each visited anchor's acceptance (`walk`).

The result equals real greedy decoding (`SpeculativeDecoder.generate_block` / `generate_tree`) up to
floating-point ties; `quality.py --check-decode` compares the two on real prompts. Decoding all of
MT-Bench, HumanEval and held-out ShareGPT this way takes a minute on one GPU instead of an hour, and
`y` and the target's hidden states are shared by every drafter evaluated.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
from transformers import DynamicCache

from ..data.batch import left_pad
from ..data.chat import prompt_ids
from ..architectures.attention import sdpa_attention
from ..architectures.drafter import Drafter
from .spec_decode import SpeculativeDecoder, confident_drafts
from ..target.hf_model import forward_with_layer_states


@dataclass
class ReplayTurn:
    """One prompt turn and the target's greedy continuation (`max_new_tokens + block_size - 1` tokens,
    generated past any stop token)."""

    dataset: str
    id: str
    turn: int
    prompt: list[int]
    continuation: list[int]


def finish(tokens: Sequence[int], max_new: int, stops: Iterable[int]) -> list[int]:
    """What decoding returns: at most `max_new` tokens, cut after the first stop token."""
    stop = set(stops)
    out = list(tokens[:max_new])
    for i, t in enumerate(out):
        if t in stop:
            return out[: i + 1]
    return out


def _cache_kwarg(target) -> str:
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy_continuations(target, prompts: list[list[int]], num_new: int, batch_size: int = 32,
                         pad_id: int = 0, done: Optional[Callable[[int], None]] = None) -> list[list[int]]:
    """The target's greedy continuation of every prompt, `num_new` tokens each (no stopping), in batches
    of prompts of similar length (left padding). `done(n)`: called as each batch of n prompts is finished."""
    device = next(target.parameters()).device
    kwarg = _cache_kwarg(target)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Optional[list[int]]] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        ids, mask = left_pad([prompts[i] for i in rows], pad_id)
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache()
        logits = target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **{kwarg: cache}).logits[:, -1]
        token = logits.argmax(-1)
        generated = [token]
        last = positions[:, -1]
        for _ in range(num_new - 1):
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
            last = last + 1
            logits = target(input_ids=token.view(-1, 1), attention_mask=mask, position_ids=last.view(-1, 1),
                            use_cache=True, **{kwarg: cache}).logits[:, -1]
            token = logits.argmax(-1)
            generated.append(token)
        table = torch.stack(generated, 1).tolist()
        for r, i in enumerate(rows):
            out[i] = table[r]
        if done:
            done(len(rows))
    return [o for o in out]  # type: ignore[misc]


@dataclass
class Proposals:
    """What the drafter would propose at every anchor `prompt_len + j`, j < `num_anchors`: greedy drafts
    `[N, D]` (D = `num_drafts()`), the tree candidates per drafted slot (`Drafter.tree_candidates`: ids
    `[N, D, k]`, log-probabilities `[N, D, k]` or, given the previous slot's candidate, `[N, D, k, k]`) and, for
    a drafter with a confidence head, each draft's predicted acceptance `[N, D]`, and for a drafter that reranks its
    backbone's candidates, the backbone's argmax drafts `[N, D]` (`Drafter.greedy_proposals` of each chunk of
    anchors)."""

    drafts: torch.Tensor
    top_lp: Optional[torch.Tensor]
    top_ids: Optional[torch.Tensor]
    confidence: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None


@torch.no_grad()
def target_pass(target, ids: list[int]):
    """(the residual stream after each layer, embeddings first (`forward_with_layer_states`), argmax of the
    logits) over `ids`, no cache."""
    device = next(target.parameters()).device
    out, states = forward_with_layer_states(target, input_ids=torch.tensor([ids], device=device), use_cache=False)
    return states, out.logits[0].argmax(-1)


@torch.no_grad()
def drafter_proposals(drafter: Drafter, embed: Callable, lm_head: torch.nn.Module, hidden_states,
                      ids: list[int], prompt_len: int, num_anchors: int, top_k: int = 0,
                      anchors_per_chunk: int = 64) -> Proposals:
    """The drafter's proposals for blocks anchored at `prompt_len .. prompt_len + num_anchors - 1`, each
    seeing the target's features of every position before its anchor (the training layout)."""
    context = torch.cat([hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)  # [1, L, K*H]
    return proposals_from_context(drafter, embed, lm_head, context, ids, prompt_len, num_anchors, top_k,
                                  anchors_per_chunk)


@torch.no_grad()
def proposals_from_context(drafter: Drafter, embed: Callable, lm_head: torch.nn.Module, context: torch.Tensor,
                           ids: Sequence[int], prompt_len: int, num_anchors: int, top_k: int = 0,
                           anchors_per_chunk: int = 64) -> Proposals:
    """`drafter_proposals` from the captured target features `[1, L, K*H]` (layers already concatenated)."""
    device = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    bs = drafter.block_size
    context = context.to(dtype)
    length = context.shape[1]
    ids_t = torch.tensor(ids, device=device)
    drafts, top_lp, top_ids, confidence, argmax = [], [], [], [], []
    for first in range(prompt_len, prompt_len + num_anchors, anchors_per_chunk):
        anchors = torch.arange(first, min(first + anchors_per_chunk, prompt_len + num_anchors), device=device)
        n = len(anchors)
        block = torch.full((n, bs), drafter.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = ids_t[anchors]
        positions = (anchors.view(-1, 1) + torch.arange(bs, device=device)).view(1, -1)
        keep = torch.ones(1, n, dtype=torch.bool, device=device)
        masks = drafter.dense_masks(anchors.view(1, -1), keep, length)  # one per layer kind
        position_ids = torch.cat([torch.arange(length, device=device).view(1, -1), positions], 1)
        out = drafter(context, drafter.embed_block(embed, block.view(1, -1)).to(dtype), position_ids, sdpa_attention,
                      masks)
        hidden = out[0].view(n, bs, -1)
        chunk = drafter.greedy_proposals(hidden, lm_head, block[:, 0], top_k)
        drafts.append(chunk.drafts)  # [n, num_drafts]
        if chunk.confidence is not None:
            confidence.append(chunk.confidence.float())
        if chunk.argmax is not None:
            argmax.append(chunk.argmax)
        if top_k:
            top_lp.append(chunk.top_lp)
            top_ids.append(chunk.top_ids)
    return Proposals(torch.cat(drafts), torch.cat(top_lp) if top_k else None, torch.cat(top_ids) if top_k else None,
                     torch.cat(confidence) if confidence else None, torch.cat(argmax) if argmax else None)


def _block_accepts(drafts: torch.Tensor, ids: torch.Tensor, prompt_len: int) -> list[int]:
    """Accepted drafts (0..B-1) at each anchor: the leading run of drafts equal to the continuation
    (a slot past the end of `ids` never matches)."""
    n, width = drafts.shape
    idx = (prompt_len + torch.arange(n, device=ids.device)).view(-1, 1) + torch.arange(1, width + 1, device=ids.device)
    padded = torch.cat([ids, ids.new_full((width,), -1)])
    hits = drafts == padded[idx]
    return hits.long().cumprod(-1).sum(-1).tolist()


def teacher_forced_walk(drafter: Drafter, embed: Callable, lm_head: torch.nn.Module, context: torch.Tensor,
                        ids: Sequence[int], start: int) -> list[int]:
    """Accept lengths of greedy block decoding along the given text from position `start` to its end: each
    step anchored where the last one ended, accepting the drafts that agree with the text. Equal to real
    decoding's when the text after `start` is the target's own greedy output (regenerated data); on other
    text, the acceptance the drafter would get if the target had written it. `context`: `[1, L, K*H]`."""
    n = len(ids) - start
    if n < 1:
        return []
    props = proposals_from_context(drafter, embed, lm_head, context, ids, start, n)
    ids_t = torch.as_tensor(list(ids), device=props.drafts.device)
    accepted = _block_accepts(props.drafts, ids_t, start)
    _, accepts = walk(lambda j: accepted[j], list(ids[start:]), n, [])
    return accepts


def _tree_accepts(top_lp: torch.Tensor, top_ids: torch.Tensor, budget: int, truth: Sequence[int]) -> int:
    """Depth reached in the DDTree built from one anchor's top-k lists by following the true continuation."""
    tokens, parents, _ = SpeculativeDecoder.build_tree_from_top(top_lp, top_ids, budget)
    children: dict[int, dict[int, int]] = {}
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        children.setdefault(par + 1, {}).setdefault(tok, i + 1)
    node, depth = 0, 0
    while depth < len(truth) and truth[depth] in children.get(node, {}):
        node = children[node][truth[depth]]
        depth += 1
    return depth


def walk(accepted_at: Callable[[int], int], continuation: Sequence[int], max_new: int,
         stops: Iterable[int]) -> tuple[list[int], list[int]]:
    """(tokens, accept lengths) of decoding that accepts `accepted_at(j)` drafts at the anchor `j` tokens
    into the continuation, with the stopping rule of `SpeculativeDecoder`."""
    stop = set(stops)
    tokens, new = [continuation[0]], [continuation[0]]
    accepts: list[int] = []
    j = 0
    while len(tokens) < max_new and not any(t in stop for t in new):
        n_acc = accepted_at(j)
        new = list(continuation[j + 1: j + n_acc + 2])
        tokens += new
        accepts.append(n_acc + 1)
        j += n_acc + 1
    return finish(tokens, max_new, stop), accepts


# Block decoding with the backbone's argmax drafts of a drafter that reranks its candidates (Proposals.argmax): what
# the reranker adds, measured on the same turns. Replay only (no engine decodes it).
ARGMAX_MODE = "block-argmax"


def confidence_mode(threshold: float) -> str:
    """The name of block decoding truncated at confidence `threshold` (`block-conf-0.3`)."""
    return f"block-conf-{threshold:g}"


def verified_lengths(keeps: Sequence[int], accepts: Sequence[int]) -> list[int]:
    """Tokens the target verifies at each step of a walk (`accepts`, from anchor 0 on): the anchor's slot (its bonus
    token) and the `keeps[j]` drafts it is given at anchor j, 1 + keep_j. `DecodeResult.verified_lengths` counts the
    same, so the mean over steps is what eval reports as `verified_per_step`."""
    out, j = [], 0
    for a in accepts:
        out.append(1 + keeps[j])
        j += a
    return out


def tree_refusal(drafter: Drafter) -> Optional[str]:
    """Why this drafter cannot be decoded with DDTree (`Drafter.check_tree_decoding`'s message), or None."""
    try:
        drafter.check_tree_decoding()
    except ValueError as e:
        return str(e)
    return None


def confidence_sums(confidence: torch.Tensor, accepts: Sequence[int]) -> list[float]:
    """Per drafted slot, the sum of its predicted acceptance (`confidence [N, D]`, row j: the anchor j tokens into
    the continuation) over the steps of a block walk (`accepts`, from anchor 0 on) that reached the slot: every
    draft before it accepted. Divided by the steps that reached each slot (`slot_acceptance`), the mean prediction
    to set against the measured conditional acceptance."""
    conf = confidence.detach().double().cpu()
    width = conf.shape[1]
    sums = torch.zeros(width, dtype=torch.float64)
    j = 0
    for a in accepts:  # a step accepting a - 1 drafts reached slots 0 .. a - 1 (all of them when a - 1 = width)
        reached = min(a, width)
        sums[:reached] += conf[j, :reached]
        j += a
    return sums.tolist()


def slot_acceptance(outputs: Iterable[dict], width: int) -> dict:
    """Conditional acceptance per drafted slot over block outputs (`{"accept_lengths"[, "confidence_sums"]}`,
    `width` = `num_drafts()`): `reached[k]`, the steps whose drafts before slot k were all accepted, `accepted[k]`,
    those of them that accepted slot k too, `acceptance[k]` = accepted / reached (None where never reached) and,
    when every output has `confidence_sums` (a drafter with a confidence head), `predicted[k]`: the mean predicted
    acceptance of slot k over the steps that reached it (else None). Slot k = 0 is the first draft."""
    reached, accepted = [0] * width, [0] * width
    sums: Optional[list[float]] = [0.0] * width
    for out in outputs:
        for a in out["accept_lengths"]:
            for k in range(min(a, width)):
                reached[k] += 1
            for k in range(min(a - 1, width)):
                accepted[k] += 1
        if sums is not None and out.get("confidence_sums") is not None:
            sums = [x + y for x, y in zip(sums, out["confidence_sums"])]
        else:
            sums = None
    return {"reached": reached, "accepted": accepted,
            "acceptance": [a / r if r else None for a, r in zip(accepted, reached)],
            "predicted": None if sums is None else [x / r if r else None for x, r in zip(sums, reached)]}


@dataclass
class TurnReplay:
    """Per mode: (tokens, accept lengths); how many positions' target argmax in the full forward disagree with
    the continuation (0 unless ties flipped between batched generation and this pass); for a drafter with a
    confidence head, the block walk's `confidence_sums` and, per confidence-truncated mode, the tokens verified at
    each step (`verified_lengths`)."""

    modes: dict[str, tuple[list[int], list[int]]]
    argmax_mismatches: int
    confidence_sums: Optional[list[float]] = None
    verified: dict[str, list[int]] = field(default_factory=dict)


def replay_turn(target, drafter: Drafter, turn: ReplayTurn, max_new: int, tree_budgets: Sequence[int],
                stops: Iterable[int], target_out=None, confidence_thresholds: Sequence[float] = ()) -> TurnReplay:
    """Block and DDTree-`b` decoding of one turn by replay (block only for a drafter that refuses DDTree:
    `tree_refusal`), block decoding with the backbone's argmax drafts (`ARGMAX_MODE`) for a drafter that reranks
    its candidates and, for a drafter with a confidence head, block decoding truncated at each threshold C > 0 of
    `confidence_thresholds` (`confidence_mode(C)`: a step accepts at most the drafts before the first predicted below
    C; the others give none). `target_out`: `target_pass` of prompt + continuation, when already computed (several
    drafters share it)."""
    stops = list(stops)
    if tree_refusal(drafter) is not None:
        tree_budgets = ()
    ids = turn.prompt + turn.continuation
    p = len(turn.prompt)
    need = max_new + drafter.num_drafts()
    if len(turn.continuation) < need:
        raise ValueError(f"{turn.dataset}/{turn.id} turn {turn.turn}: continuation has {len(turn.continuation)} "
                         f"tokens, replay with block size {drafter.block_size} ({drafter.num_drafts()} drafts) needs "
                         f"{need}")
    hidden_states, argmax = target_out if target_out is not None else target_pass(target, ids)
    ids_t = torch.tensor(ids, device=argmax.device)
    mismatches = int((argmax[p - 1:len(ids) - 1] != ids_t[p:]).sum())
    anchors = max_new  # anchors j = 0 .. max_new - 1 (the walk never starts a step at j >= max_new - 1)
    props = drafter_proposals(drafter, target.get_input_embeddings(), target.get_output_embeddings(),
                              hidden_states, ids, p, anchors, top_k=max(tree_budgets, default=0))
    cont = turn.continuation
    block = _block_accepts(props.drafts, ids_t.to(props.drafts.device), p)
    modes = {"block": walk(lambda j: block[j], cont, max_new, stops)}
    if props.argmax is not None:
        plain = _block_accepts(props.argmax, ids_t.to(props.argmax.device), p)
        modes[ARGMAX_MODE] = walk(lambda j: plain[j], cont, max_new, stops)
    sums = None if props.confidence is None else confidence_sums(props.confidence, modes["block"][1])
    if tree_budgets:
        top_lp, top_ids = props.top_lp.cpu(), props.top_ids.cpu()  # the tree builder reads a few rows of each
        width = drafter.num_drafts()  # the tree's depth
        for budget in tree_budgets:
            modes[f"tree-{budget}"] = walk(
                lambda j: _tree_accepts(top_lp[j], top_ids[j], budget, cont[j + 1:j + 1 + width]), cont, max_new, stops)
    verified: dict[str, list[int]] = {}
    for c in (t for t in confidence_thresholds if t > 0 and props.confidence is not None):
        keeps = confident_drafts(props.confidence, c).tolist()
        mode = confidence_mode(c)
        modes[mode] = walk(lambda j: min(block[j], keeps[j]), cont, max_new, stops)
        verified[mode] = verified_lengths(keeps, modes[mode][1])
    return TurnReplay(modes, mismatches, sums, verified)


# --------------------------------------------------------------------------- prompts -> corpus -> records


def build_corpus(target, tokenizer, items: list[dict], max_new: int, block_size: int, stops: Iterable[int],
                 batch_size: int = 32, template_kwargs: Optional[dict] = None,
                 done: Optional[Callable[[int], None]] = None) -> list[ReplayTurn]:
    """Every turn of every item (`{"dataset", "id", "turns"}`) with the target's greedy continuation. A later
    turn's prompt holds the earlier turns' answers as decoding would have written them (`finish`ed, decoded),
    so multi-turn prompts (MT-Bench) replay exactly what `run_prompt` would decode."""
    stops = list(stops)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    histories: list[list[dict]] = [[] for _ in items]
    corpus: list[ReplayTurn] = []
    for t in range(max((len(i["turns"]) for i in items), default=0)):
        rows = [k for k, item in enumerate(items) if t < len(item["turns"])]
        prompts = []
        for k in rows:
            histories[k].append({"role": "user", "content": items[k]["turns"][t]})
            prompts.append(prompt_ids(tokenizer, histories[k], template_kwargs))
        conts = greedy_continuations(target, prompts, max_new + block_size - 1, batch_size, pad, done)
        for k, prompt, cont in zip(rows, prompts, conts):
            answer = tokenizer.decode(finish(cont, max_new, stops), skip_special_tokens=True)
            histories[k].append({"role": "assistant", "content": answer})
            corpus.append(ReplayTurn(items[k]["dataset"], str(items[k]["id"]), t, prompt, cont))
    return corpus


def turn_records(target, tokenizer, drafters: dict[str, Drafter], corpus: list[ReplayTurn], max_new: int,
                 tree_budgets: Sequence[int], stops: Iterable[int],
                 done: Callable[[str, ReplayTurn], bool] = lambda name, turn: False,
                 confidence_thresholds: Sequence[float] = ()) -> Iterator[tuple[str, dict]]:
    """(drafter name, record of one turn) for each turn and drafter, in corpus order, skipping the pairs `done`
    says are done (a resumed replay). A turn's record: `{"dataset", "id", "turn", "argmax_mismatches",
    "modes": {mode: output}}` (no tree modes for a drafter that refuses DDTree; the block output of a drafter with
    a confidence head has `confidence_sums`, and its confidence-truncated modes (`replay_turn`'s
    `confidence_thresholds`) have `verified_lengths`, as real decoding's outputs). The target runs once per turn for
    all drafters that need it."""
    stops = list(stops)
    for turn in corpus:
        todo = [name for name in drafters if not done(name, turn)]
        shared = target_pass(target, turn.prompt + turn.continuation) if todo else None
        for name in todo:
            rep = replay_turn(target, drafters[name], turn, max_new, tree_budgets, stops, shared,
                              confidence_thresholds)
            modes = {mode: {"token_ids": tokens, "text": tokenizer.decode(tokens, skip_special_tokens=True),
                            "tau": sum(accepts) / max(len(accepts), 1), "accept_lengths": accepts, "decode_s": 0.0}
                     for mode, (tokens, accepts) in rep.modes.items()}
            if rep.confidence_sums is not None:
                modes["block"]["confidence_sums"] = rep.confidence_sums
            for mode, verified in rep.verified.items():
                modes[mode]["verified_lengths"] = verified
            yield name, {"dataset": turn.dataset, "id": turn.id, "turn": turn.turn,
                         "argmax_mismatches": rep.argmax_mismatches, "modes": modes}


def prompt_records(turns: Iterable[dict]) -> list[dict]:
    """Turn records (`turn_records`) -> one record per prompt in `run_prompt`'s shape (`{"dataset", "id",
    "modes": {mode: [output per turn]}}`, decode_s 0: nothing was timed), plus `"replay": {"argmax_mismatches":
    n}`; prompts in the order of their first turn, turns in order."""
    by_prompt: dict[tuple, list[dict]] = {}
    for rec in turns:
        by_prompt.setdefault((rec["dataset"], rec["id"]), []).append(rec)
    out = []
    for (dataset, pid), recs in by_prompt.items():
        recs = sorted(recs, key=lambda r: r["turn"])
        modes: dict[str, list] = {}
        for rec in recs:
            for mode, output in rec["modes"].items():
                modes.setdefault(mode, []).append(output)
        out.append({"dataset": dataset, "id": pid, "modes": modes,
                    "replay": {"argmax_mismatches": sum(r["argmax_mismatches"] for r in recs)}})
    return out


def replay_records(target, tokenizer, drafters: dict[str, Drafter], corpus: list[ReplayTurn], max_new: int,
                   tree_budgets: Sequence[int], stops: Iterable[int],
                   done: Optional[Callable[[int], None]] = None,
                   confidence_thresholds: Sequence[float] = ()) -> dict[str, list[dict]]:
    """Per drafter: one record per prompt (`prompt_records`) of every turn of `corpus`. `done(1)`: called as
    each turn is replayed (by every drafter). `confidence_thresholds`: as `replay_turn`'s."""
    turns: dict[str, list[dict]] = {name: [] for name in drafters}
    for name, rec in turn_records(target, tokenizer, drafters, corpus, max_new, tree_budgets, stops,
                                  confidence_thresholds=confidence_thresholds):
        turns[name].append(rec)
        if done and name == next(iter(drafters)):
            done(1)
    return {name: prompt_records(recs) for name, recs in turns.items()}
