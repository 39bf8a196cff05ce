"""Tau by replay equals real greedy speculative decoding: the same tokens and the same accept lengths,
step for step, for block and DDTree verification (float64, where ties cannot flip)."""

import pytest
import torch

from dflash_train.infer.replay import ReplayTurn, greedy_continuations, replay_turn, walk
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.algorithms.dflash.model import DFlashDrafter
from dflash_train.algorithms.dflash.config import make_drafter_config
from dflash_train.target.capture import load_target_model
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
    from dflash_train.algorithms.dflash2.config import make_dflash2_config
    from dflash_train.algorithms.dflash2.model import DFlash2Drafter

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
