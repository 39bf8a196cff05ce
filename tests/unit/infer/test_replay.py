"""Tau by replay equals real greedy speculative decoding: the same tokens and the same accept lengths,
step for step, for block and DDTree verification (float64, where ties cannot flip)."""

import copy

import pytest
import torch

from dflash_train.infer.replay import ReplayTurn, greedy_continuations, replay_turn, walk
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.target.capture import load_target_model
from _lilicorr_drafters import backbone_alone, perturbed_lilicorr
from _memorise import memorise


STOPS = [2]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 19, 33)]


def _drafter(target, block_size: int) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = make_drafter_config(target.config, num_draft_layers=1, block_size=block_size, target_layer_ids=[1, 4],
                              mask_token_id=16)
    return DFlashDrafter(cfg).double()


def test_batched_greedy_continuations_equal_one_prompt_at_a_time(target):
    prompts = _prompts()
    dec = SpeculativeDecoder(target, _drafter(target, 4), stop_token_ids=[])
    want = [dec.generate_target_only(p, 12).tokens for p in prompts]
    assert greedy_continuations(target, prompts, 12, batch_size=2) == want


@pytest.mark.parametrize("max_new", [9, 24])
def test_walk_reproduces_the_decoders_steps_and_stopping(target, max_new):
    """A drafter forced to be right for exactly r(j) slots at the anchor j tokens into the output: real
    decoding's accept lengths and tokens are what `walk` computes from r alone (the step and stop rules)."""
    bs = 6
    prompt = _prompts()[1]
    dec = SpeculativeDecoder(target, _drafter(target, bs), stop_token_ids=STOPS)
    cont = greedy_continuations(target, [prompt], max_new + bs - 1)[0]
    seen: list[int] = []
    # without a stop in the output (the token budget ends it), and with one of its own tokens as the stop
    for stops in ([2], [cont[max_new // 2]]):
        dec.stop = set(stops)
        right = lambda j: (j * 7 + 3) % bs  # noqa: E731  0..bs-1 accepted drafts
        original_hidden, original_logits, at = dec._draft_hidden, dec.drafter.logits, {}

        def record_start(context, anchor, start, dcache, original_hidden=original_hidden):
            at["start"] = start
            return original_hidden(context, anchor, start, dcache)

        def forced(hidden, lm_head, original_logits=original_logits):  # [1, bs, V], row 0 the anchor's
            logits = original_logits(hidden, lm_head)
            j = at["start"] - len(prompt)
            for k in range(logits.shape[1] - 1):
                logits[0, k + 1] = -1e9
                good = k < right(j)
                want = cont[j + 1 + k]
                logits[0, k + 1, want if good else (want + 1) % logits.shape[2]] = 0
            return logits

        dec._draft_hidden, dec.drafter.logits = record_start, forced
        real = dec.generate_block(prompt, max_new)
        del dec._draft_hidden, dec.drafter.logits  # back to the methods
        tokens, accepts = walk(right, cont, max_new, stops)
        assert real.tokens == tokens
        assert real.accept_lengths == accepts
        seen += accepts
    assert len(set(seen)) > 1


@pytest.fixture(scope="module")
def memorised(target):
    """(prompts, their greedy continuations of 24 tokens, a block-5 drafter taught them): shared by the tests of
    real decoding along these texts (memorising is most of their time)."""
    prompts = _prompts()
    conts = greedy_continuations(target, prompts, 24)
    return prompts, conts, memorise(_drafter(target, 5), target, [p + c for p, c in zip(prompts, conts)])


def test_replay_equals_real_decoding_for_block_and_tree(target, memorised):
    bs, max_new = 5, 20
    prompts, conts, drafter = memorised
    assert all(len(c) == max_new + bs - 1 for c in conts)
    dec = SpeculativeDecoder(target, drafter, stop_token_ids=STOPS)
    taus = []
    for i, (p, c) in enumerate(zip(prompts, conts)):
        rep = replay_turn(target, drafter, ReplayTurn("toy", str(i), 0, p, c), max_new, (3, 8), STOPS)
        assert rep.argmax_mismatches == 0
        real = {"block": dec.generate_block(p, max_new), "tree-3": dec.generate_tree(p, max_new, 3),
                "tree-8": dec.generate_tree(p, max_new, 8)}
        for mode, res in real.items():
            tokens, accepts = rep.modes[mode]
            assert tokens == res.tokens, mode
            assert accepts == res.accept_lengths, mode
        taus.append(sum(rep.modes["block"][1]) / len(rep.modes["block"][1]))
    assert max(taus) > 1.5  # the comparison covered multi-token steps, not only tau = 1


@pytest.mark.long  # ~30 s: memorising takes 40 float64 steps for DFlash2's drafter to accept multi-token steps
def test_replay_equals_real_decoding_for_a_dflash2_drafter_block_and_tree(target):
    """DFlash2: the selector's path (block) and its parent-conditioned tree replay as real decoding decodes them."""
    from dflash_train.architectures.dflash2.config import make_dflash2_config
    from dflash_train.architectures.dflash2.model import DFlash2Drafter

    bs, max_new = 5, 20
    prompts = _prompts()
    conts = greedy_continuations(target, prompts, max_new + bs - 1)
    torch.manual_seed(0)
    cfg = make_dflash2_config(target.config, num_draft_layers=1, block_size=bs, target_layer_ids=[1, 4],
                              mask_token_id=16, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    drafter = memorise(DFlash2Drafter(cfg).double(), target, [p + c for p, c in zip(prompts, conts)], steps=40)
    with torch.no_grad():  # a selector that is not the identity: the path and the tree's rows depend on it
        drafter.candidate_selector.successor_codebook.normal_(0.0, 0.1)
    dec = SpeculativeDecoder(target, drafter, stop_token_ids=STOPS)
    taus = []
    for i, (p, c) in enumerate(zip(prompts, conts)):
        rep = replay_turn(target, drafter, ReplayTurn("toy", str(i), 0, p, c), max_new, (3, 8), STOPS)
        real = {"block": dec.generate_block(p, max_new), "tree-3": dec.generate_tree(p, max_new, 3),
                "tree-8": dec.generate_tree(p, max_new, 8)}
        for mode, res in real.items():
            assert rep.modes[mode] == (res.tokens, res.accept_lengths), mode
        taus.append(sum(rep.modes["tree-8"][1]) / len(rep.modes["tree-8"][1]))
    assert max(taus) > 1.5


def test_replay_refuses_a_continuation_too_short_for_the_block(target):
    drafter = _drafter(target, 8)
    with pytest.raises(ValueError, match="needs 23"):
        replay_turn(target, drafter, ReplayTurn("toy", "x", 0, [5, 6, 7], list(range(10, 30))), 16, (), STOPS)


@pytest.mark.long  # ~18 s: decodes every turn for real beside the replay
def test_eval_by_replay_reports_what_decoding_reports_multi_turn(target, tiny_target_dir, tmp_path):
    """`evaluate_by_replay` against `evaluate` (real decoding) on chat prompts, one of them two turns: the same
    outputs turn by turn (the second turn's prompt holds the first answer) and the same tau and histogram."""
    import json

    from dflash_train.infer.evaluate import evaluate, evaluate_by_replay
    from dflash_train.infer.replay import build_corpus
    from dflash_train.target.capture import load_tokenizer

    tok = load_tokenizer(tiny_target_dir)
    rows = [{"id": "a", "turns": ["Count to three.", "And back down."]}, {"id": "b", "turns": ["Name a river."]}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bs, max_new = 4, 14
    corpus = build_corpus(target, tok, [{"dataset": str(data), **r} for r in rows], max_new, bs, STOPS)
    assert [(t.id, t.turn) for t in corpus] == [("a", 0), ("b", 0), ("a", 1)]
    drafter = memorise(_drafter(target, bs), target, [t.prompt + t.continuation for t in corpus])
    kwargs = dict(max_new_tokens=max_new, tree_budgets=(4,), stop_token_ids=STOPS)
    decoded = evaluate(target, tok, drafter, [str(data)], measure_speedup=False, **kwargs)
    replayed = evaluate_by_replay(target, tok, drafter, [str(data)], **kwargs)
    for d, r in zip(decoded["outputs"], replayed["outputs"]):
        for mode in ("block", "tree-4"):
            assert [o["token_ids"] for o in d["modes"][mode]] == [o["token_ids"] for o in r["modes"][mode]]
            assert [o["accept_lengths"] for o in d["modes"][mode]] == [o["accept_lengths"] for o in r["modes"][mode]]
    for mode in ("block", "tree-4"):
        want, got = decoded["datasets"][str(data)]["modes"][mode], replayed["datasets"][str(data)]["modes"][mode]
        assert (got["tau"], got["histogram"], got["tokens"]) == (want["tau"], want["histogram"], want["tokens"])
    assert replayed["datasets"][str(data)]["modes"]["block"]["tau"] > 1.2  # multi-token steps were compared
    assert replayed["config"]["method"] == "replay"


def test_cli_eval_replay_refuses_sampling(tmp_path, capsys):
    from dflash_train.cli import main

    assert main(["eval", "--target", "smollm2", "--drafter", str(tmp_path), "--replay", "--temperature", "0.7"]) != 0
    assert "--replay measures greedy decoding" in capsys.readouterr().err


def test_teacher_forced_walk_along_greedy_text_is_real_decoding(target, memorised):
    """Validation's walk along a response that is the target's greedy output takes the steps real decoding
    takes (all but the last, which decoding may extend past the text's end)."""
    from dflash_train.infer.replay import teacher_forced_walk

    n = 20
    prompts, longer, drafter = memorised
    conts = [c[:n] for c in longer]  # greedy text of n tokens: the first n of the longer continuations
    dec = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    lengths = []
    for p, c in zip(prompts, conts):
        ids = p + c
        with torch.no_grad():
            hs = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in drafter.target_layer_ids], -1)
        walked = teacher_forced_walk(drafter, target.get_input_embeddings(), target.get_output_embeddings(), context,
                                     ids, len(p))
        real = dec.generate_block(p, n).accept_lengths
        assert walked[:-1] == real[:len(walked) - 1]
        assert walked[-1] <= real[len(walked) - 1]
        lengths += walked
    assert max(lengths) > 2


# --------------------------------------------------------------------------- per-slot acceptance and confidence


def test_confidence_sums_and_slot_acceptance_of_a_block_walk_by_hand():
    """Steps accepting 2, 0, 3 (all) and 1 drafts of width 3, walked from anchor 0 (anchors 0, 3, 4, 8): a step
    reaches the slots up to its first rejected one, and only those add their predicted acceptance."""
    from dflash_train.infer.replay import confidence_sums, slot_acceptance

    conf = torch.arange(30, dtype=torch.float64).view(10, 3) / 100  # row j: the anchor j tokens in
    accepts = [3, 1, 4, 2]
    sums = confidence_sums(conf, accepts)
    # anchor 0 reaches slots 0-2, anchor 3 slot 0, anchor 4 slots 0-2, anchor 8 slots 0-1
    want = [(0 + 9 + 12 + 24) / 100, (1 + 13 + 25) / 100, (2 + 14) / 100]
    assert sums == pytest.approx(want)
    second = {"accept_lengths": [1, 2], "confidence_sums": [0.5, 0.25, 0.0]}
    got = slot_acceptance([{"accept_lengths": accepts, "confidence_sums": sums}, second], 3)
    assert got["reached"] == [6, 4, 2] and got["accepted"] == [4, 2, 1]
    assert got["acceptance"] == pytest.approx([4 / 6, 2 / 4, 1 / 2])
    assert got["predicted"] == pytest.approx([(want[0] + 0.5) / 6, (want[1] + 0.25) / 4, want[2] / 2])
    # an output without confidence (a drafter without the head): no prediction; a slot never reached: None
    got = slot_acceptance([{"accept_lengths": [1, 1]}, second], 3)
    assert got["predicted"] is None and got["reached"] == [4, 1, 0] and got["acceptance"] == [0.25, 0.0, None]


def _dspark(target, block_size: int, confidence: bool = True, markov_rank: int = 8):
    from dflash_train.architectures.dspark.model import DSparkDrafter

    torch.manual_seed(0)
    cfg = make_drafter_config(target.config, num_draft_layers=1, block_size=block_size, target_layer_ids=[1, 4],
                              mask_token_id=16)
    cfg.architectures = ["Qwen3DSparkModel"]
    cfg.markov_rank, cfg.markov_head_type = markov_rank, "vanilla"
    cfg.enable_confidence_head, cfg.confidence_head_with_markov = confidence, markov_rank > 0
    return DSparkDrafter(cfg).double().eval()


def test_replay_of_a_dspark_drafter_drafts_every_slot_and_sums_the_confidence_decoding_computes(target):
    """A DSpark block of B slots drafts B tokens: replay needs a continuation B tokens past max_new (not B - 1) and
    takes real decoding's steps; the confidence it sums per slot is what the drafter predicts at each of decoding's
    steps, over the slots that step reached."""
    bs, max_new = 4, 14
    d = _dspark(target, bs)
    assert d.num_drafts() == bs and d.has_confidence
    prompts = _prompts()
    conts = greedy_continuations(target, prompts, max_new + bs)
    with pytest.raises(ValueError, match=f"needs {max_new + bs}"):
        replay_turn(target, d, ReplayTurn("toy", "0", 0, prompts[0], conts[0][:-1]), max_new, (4,), STOPS)
    seen = []
    original = d.draft_with_confidence

    def draft(hidden, lm_head, anchor_ids, temperature=0.0, generator=None):  # decoding's drafts, confidence kept
        ids, q, conf = original(hidden, lm_head, anchor_ids, temperature, generator)
        seen.append(conf[0].tolist())
        return ids, q

    d.draft = draft
    dec = SpeculativeDecoder(target, d, stop_token_ids=STOPS)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        seen.clear()
        real = dec.generate_block(p, max_new)
        rep = replay_turn(target, d, ReplayTurn("toy", str(i), 0, p, c), max_new, (4,), STOPS)
        assert rep.modes["block"] == (real.tokens, real.accept_lengths)
        assert rep.modes["tree-4"][0] == real.tokens
        want = [0.0] * bs
        for conf, a in zip(seen, real.accept_lengths):
            for k in range(min(a, bs)):
                want[k] += conf[k]
        assert rep.confidence_sums == pytest.approx(want, rel=1e-6)  # the head scores in float32
    del d.draft
    assert replay_turn(target, _dspark(target, bs, confidence=False), ReplayTurn("toy", "0", 0, prompts[0], conts[0]),
                       max_new, (), STOPS).confidence_sums is None


def test_replay_of_a_drafter_that_refuses_ddtree_gives_its_block_mode_only(target, tiny_target_dir):
    """Domino refuses DDTree (`check_tree_decoding`): replay asked for tree budgets replays block verification alone
    (as real decoding decodes it), and its turn records carry no tree mode, instead of failing the replay of every
    drafter."""
    from dflash_train.architectures.domino.config import make_domino_config
    from dflash_train.architectures.domino.model import DominoDrafter
    from dflash_train.infer.replay import tree_refusal, turn_records
    from dflash_train.target.capture import load_tokenizer

    bs, max_new = 4, 10
    torch.manual_seed(0)
    d = DominoDrafter(make_domino_config(target.config, num_draft_layers=1, block_size=bs, target_layer_ids=[1, 4],
                                         mask_token_id=16, gru_hidden_dim=8, emb_dim=8)).double().eval()
    dflash = _drafter(target, bs)
    assert "domino" in tree_refusal(d) and tree_refusal(dflash) is None
    p = _prompts()[0]
    turn = ReplayTurn("toy", "0", 0, p, greedy_continuations(target, [p], max_new + bs - 1)[0])
    rep = replay_turn(target, d, turn, max_new, (4,), STOPS)
    real = SpeculativeDecoder(target, d, stop_token_ids=STOPS).generate_block(p, max_new)
    assert rep.modes == {"block": (real.tokens, real.accept_lengths)}
    records = dict(turn_records(target, load_tokenizer(tiny_target_dir), {"dflash": dflash, "domino": d}, [turn],
                                max_new, (4,), STOPS))
    assert set(records["domino"]["modes"]) == {"block"} and set(records["dflash"]["modes"]) == {"block", "tree-4"}


# --------------------------------------------------------------------------- confidence truncation


@pytest.fixture(scope="module")
def confident_dspark(target):
    """(prompts, continuations, block size, max_new, a DSpark drafter taught them whose confidence head is spread
    over (0, 1)): steps that accept several drafts, and predictions on both sides of 0.5 (the tiny head's random
    start is ~0.5 everywhere). No Markov head: its random bias would keep the memorised drafts from being right."""
    bs, max_new = 4, 20
    prompts = _prompts()
    conts = greedy_continuations(target, prompts, max_new + bs)
    d = memorise(_dspark(target, bs, markov_rank=0), target, [p + c for p, c in zip(prompts, conts)])
    torch.manual_seed(3)
    with torch.no_grad():
        d.confidence_head.proj.weight.normal_(0, 5.0)
        d.confidence_head.proj.bias.zero_()
    return prompts, conts, bs, max_new, d


def test_confidence_truncated_replay_equals_decoding_with_the_threshold(target, tiny_target_dir, confident_dspark):
    """Replay's `block-conf-C` takes real decoding's steps under `confidence_threshold=C`: the same tokens, accept
    lengths and tokens verified per step, turn by turn; eval's `verified_per_step` of both is the same. The threshold
    truncates some steps (fewer tokens verified, and fewer accepted than untruncated block decoding) but not all."""
    from dflash_train.infer.evaluate import summarize_records
    from dflash_train.infer.replay import prompt_records, turn_records
    from dflash_train.target.capture import load_tokenizer

    prompts, conts, bs, max_new, d = confident_dspark
    c, mode = 0.5, "block-conf-0.5"
    dec = SpeculativeDecoder(target, d, stop_token_ids=STOPS, confidence_threshold=c)
    turns = [ReplayTurn("toy", str(i), 0, p, cont) for i, (p, cont) in enumerate(zip(prompts, conts))]
    decoded, verified, cut_short = [], [], 0
    for turn in turns:
        rep = replay_turn(target, d, turn, max_new, (), STOPS, confidence_thresholds=(c,))
        real = dec.generate_block(turn.prompt, max_new)
        assert set(rep.modes) == {"block", mode}
        assert rep.modes[mode] == (real.tokens, real.accept_lengths)
        assert rep.verified[mode] == real.verified_lengths
        cut_short += rep.modes["block"][1] != real.accept_lengths
        verified += real.verified_lengths
        decoded.append({"id": turn.id, "modes": {mode: [{"token_ids": real.tokens, "accept_lengths": real.accept_lengths,
                                                         "verified_lengths": real.verified_lengths, "decode_s": 0.0}]}})
    assert min(verified) < bs + 1 and max(verified) == bs + 1  # truncated at some steps, not at all
    assert cut_short > 0  # and it changed what some turn accepted
    records = prompt_records(rec for _, rec in turn_records(target, load_tokenizer(tiny_target_dir), {"d": d}, turns,
                                                             max_new, (), STOPS, confidence_thresholds=(c,)))
    replayed = summarize_records(records, ["block", mode])["modes"]
    want = summarize_records(decoded, [mode])["modes"][mode]
    assert replayed[mode]["verified_per_step"] == want["verified_per_step"] == sum(verified) / len(verified)
    assert replayed[mode]["tau"] == want["tau"]
    assert "verified_per_step" not in replayed["block"]  # replay's untruncated block records stay as they were


def test_confidence_truncation_accepts_no_more_and_verifies_between_the_anchor_and_every_draft(target,
                                                                                              confident_dspark):
    """Per threshold, tau <= the untruncated block's (each anchor accepts no more; along a walk that is not a theorem,
    a truncated step can land on a better anchor, so this checks these texts) and the tokens verified per step lie in
    [1, 1 + drafts]; threshold 0 and a drafter without a confidence head give no truncated mode."""
    prompts, conts, bs, max_new, d = confident_dspark
    thresholds = (0.0, 0.2, 0.5, 0.8)
    taus: dict[str, list[int]] = {}
    verified: dict[str, list[int]] = {}
    for i, (p, cont) in enumerate(zip(prompts, conts)):
        rep = replay_turn(target, d, ReplayTurn("toy", str(i), 0, p, cont), max_new, (), STOPS,
                          confidence_thresholds=thresholds)
        assert list(rep.modes) == ["block", "block-conf-0.2", "block-conf-0.5", "block-conf-0.8"]
        for mode, (tokens, accepts) in rep.modes.items():
            assert tokens == rep.modes["block"][0]  # lossless: the target's greedy output whatever is verified
            taus.setdefault(mode, []).extend(accepts)
            verified.setdefault(mode, []).extend(rep.verified.get(mode, [1 + bs] * len(accepts)))
    tau = {m: sum(a) / len(a) for m, a in taus.items()}
    per_step = {m: sum(v) / len(v) for m, v in verified.items()}
    assert all(1 <= v <= 1 + bs for vs in verified.values() for v in vs)
    assert all(t <= tau["block"] for t in tau.values()) and tau["block-conf-0.8"] < tau["block"]
    assert per_step["block-conf-0.8"] < per_step["block-conf-0.2"] < 1 + bs
    turn = ReplayTurn("toy", "0", 0, prompts[0], conts[0])
    assert set(replay_turn(target, d, turn, max_new, (), STOPS, confidence_thresholds=(0.0,)).modes) == {"block"}
    headless = replay_turn(target, _dspark(target, bs, confidence=False), turn, max_new, (), STOPS,
                           confidence_thresholds=(0.5,))
    assert set(headless.modes) == {"block"} and headless.verified == {}


def _dflash2(target, block_size: int):
    from dflash_train.architectures.dflash2.config import make_dflash2_config
    from dflash_train.architectures.dflash2.model import DFlash2Drafter

    torch.manual_seed(0)
    cfg = make_dflash2_config(target.config, num_draft_layers=1, block_size=block_size, target_layer_ids=[1, 4],
                              mask_token_id=16, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    drafter = DFlash2Drafter(cfg).double()
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(0.0, 0.1)
    return drafter


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark", "dspark-no-confidence", "dspark-no-markov"])
def test_replays_proposals_come_from_one_head_product_and_equal_the_separate_calls(target, kind):
    """Every drafter that supports DDTree gives replay's greedy drafts, DDTree candidates and confidence from one
    product with the head (the largest part of its work on a small target), equal to `draft`, `tree_candidates`
    and `draft_with_confidence` called apart; without candidates asked for, none come back."""
    head = target.lm_head
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 5, target.config.hidden_size, generator=g, dtype=torch.float64)
    anchors = torch.randint(3, 400, (6,), generator=g)
    drafter = {"dflash": lambda: _drafter(target, 5), "dflash2": lambda: _dflash2(target, 5),
               "dspark": lambda: _dspark(target, 5),
               "dspark-no-confidence": lambda: _dspark(target, 5, confidence=False),
               "dspark-no-markov": lambda: _dspark(target, 5, confidence=False, markov_rank=0)}[kind]()
    calls = []
    hook = head.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            together = drafter.greedy_proposals(hidden, head, anchors, 8)
            assert len(calls) == 1
            block_only = drafter.greedy_proposals(hidden, head, anchors)
            apart_lp, apart_ids = drafter.tree_candidates(hidden, head, anchors, 8)
            apart_drafts = drafter.draft(hidden, head, anchors)[0]
            apart_conf = drafter.draft_with_confidence(hidden, head, anchors)[2] if drafter.has_confidence else None
    finally:
        hook.remove()
    assert together.drafts.shape == (6, drafter.num_drafts())
    assert torch.equal(together.drafts, apart_drafts) and torch.equal(block_only.drafts, apart_drafts)
    assert torch.equal(together.top_ids, apart_ids) and torch.equal(together.top_lp, apart_lp)
    assert block_only.top_lp is None and block_only.top_ids is None
    if apart_conf is None:
        assert together.confidence is None and kind != "dspark"
    else:
        assert torch.equal(together.confidence, apart_conf) and torch.equal(block_only.confidence, apart_conf)


# --------------------------------------------------------------------------- a reranker against its backbone's argmax


def _without_reranker(drafter, target):
    """The same backbone drafting its own argmax: LiLiCorr's as a DFlash drafter holding every backbone weight,
    DFlash2's with the identity selector (zero successor codebook: its path is the unary argmax)."""
    if drafter.architecture == "lilicorr":
        return backbone_alone(drafter, target.config)
    plain = copy.deepcopy(drafter)
    with torch.no_grad():
        plain.candidate_selector.successor_codebook.zero_()
    return plain.eval()


@pytest.mark.parametrize("kind", ["lilicorr", "dflash2"])
def test_a_reranking_drafters_replay_adds_its_backbones_argmax_as_the_backbone_alone_drafts_it(target, kind):
    """A drafter that reranks its backbone's candidates (LiLiCorr's walk, DFlash2's selector) replays block decoding
    with the backbone's argmax beside its own drafts (`ARGMAX_MODE`): the tokens and accept lengths of the same
    backbone without the reranker. Its drafts differ from that argmax; a DFlash drafter has no such mode."""
    from dflash_train.infer.replay import ARGMAX_MODE, drafter_proposals, target_pass

    bs, max_new = 5, 12
    if kind == "lilicorr":
        drafter = perturbed_lilicorr(target.config, bs).double().eval()
    else:
        drafter = _dflash2(target, bs).eval()
        with torch.no_grad():  # a selector strong enough to leave the untrained unary argmax
            for param in drafter.candidate_selector.parameters():
                param.normal_(0.0, 1.0)
    plain = _without_reranker(drafter, target)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    reranked = False
    for i, p in enumerate(_prompts()):
        turn = ReplayTurn("toy", str(i), 0, p, greedy_continuations(target, [p], max_new + bs - 1)[0])
        rep, alone = (replay_turn(target, d, turn, max_new, (), STOPS) for d in (drafter, plain))
        assert set(rep.modes) == {"block", ARGMAX_MODE} and rep.modes[ARGMAX_MODE] == alone.modes["block"]
        assert ARGMAX_MODE not in alone.modes or kind == "dflash2"
        ids = turn.prompt + turn.continuation
        states = target_pass(target, ids)[0]
        props, props_alone = (drafter_proposals(d, embed, head, states, ids, len(p), max_new) for d in (drafter, plain))
        assert torch.equal(props.argmax, props_alone.drafts)
        reranked |= not torch.equal(props.drafts, props.argmax)
    assert reranked
    dflash = _drafter(target, bs)
    turn = ReplayTurn("toy", "0", 0, _prompts()[0], greedy_continuations(target, [_prompts()[0]], max_new + bs - 1)[0])
    assert set(replay_turn(target, dflash, turn, max_new, (), STOPS).modes) == {"block"}
