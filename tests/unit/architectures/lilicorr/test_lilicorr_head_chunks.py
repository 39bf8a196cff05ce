"""The head trains over chunks of whole blocks, each recomputed in the backward: the scores and every gradient equal
the head's over all blocks at once (float64), and what autograd keeps to the backward shrinks from every node's
activations to the chunk inputs."""

from __future__ import annotations

import pytest
import torch

from dflash_train.architectures import architecture
from dflash_train.architectures.lilicorr import model as model_module
from dflash_train.config.load import config_from_dict
from dflash_train.target.capture import load_target_model


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))


def drafter(target):
    cfg = config_from_dict({"drafter": {"architecture": "lilicorr", "block_size": 5, "num_draft_layers": 1},
                            "lilicorr": {"candidate_topk": 4, "head_hidden_size": 32, "head_num_layers": 2,
                                         "head_num_heads": 4, "factor_dim": 16}})
    torch.manual_seed(0)
    arch = architecture("lilicorr")
    d = arch.drafter_class(arch.config_for_run(target.config, cfg, [1, 4], 16)).double()
    with torch.no_grad():
        for p in d.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return d


def lattice_inputs(target, blocks=7):
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(blocks, 5, target.config.hidden_size, generator=g, dtype=torch.float64)
    hidden[2, 0] = 0  # a block without an anchor row
    lp = torch.log_softmax(torch.randn(blocks, 4, 9, generator=g, dtype=torch.float64), -1).topk(4, -1).values
    cand = torch.randint(3, 1000, (blocks, 4, 4), generator=g)
    return hidden.requires_grad_(), lp.requires_grad_(), cand


def head_at_once(d, target):
    """The head over every block in one call, no chunks (the reference)."""
    def lattice(hidden, lp, cand, embed):
        anchor = hidden[:, 0]
        return d.lilicorr(embed(cand).detach(), hidden[:, 1:], lp, anchor, anchor.ne(0).any(-1))
    return lattice


def scores_and_grads(d, target, inputs, lattice=None):
    lattice = lattice or d.lattice
    hidden, lp, cand = (t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    d.zero_grad()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        start, pair = lattice(hidden, lp, cand, target.get_input_embeddings())
    (start.square().sum() + (pair * torch.linspace(-1, 1, pair.shape[-1], dtype=pair.dtype)).sum()).backward()
    grads = {n: p.grad.clone() for n, p in d.lilicorr.named_parameters()}
    return start.detach(), pair.detach(), hidden.grad, lp.grad, grads, sum(saved)


def test_chunked_scores_and_gradients_equal_the_whole_lattices_and_keep_less(target, monkeypatch):
    d, inputs = drafter(target), lattice_inputs(target)
    whole = scores_and_grads(d, target, inputs, head_at_once(d, target))
    monkeypatch.setattr(model_module, "CHUNK_NODES", 32)  # two blocks of 16 nodes a chunk: four chunks of 7 blocks
    chunked = scores_and_grads(d, target, inputs)
    for a, b in zip(whole[:4], chunked[:4]):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert whole[4].keys() == chunked[4].keys()
    assert all(torch.allclose(whole[4][n], chunked[4][n], rtol=1e-10, atol=1e-12) for n in whole[4])
    assert chunked[5] < whole[5] / 3  # the chunk inputs, not the layers' activations of every node
    with torch.no_grad():  # decoding and replay: no chunks, the same scores
        start, pair = d.lattice(*inputs[:2], inputs[2], target.get_input_embeddings())
    assert torch.allclose(start, whole[0], rtol=1e-12, atol=1e-12) and torch.allclose(pair, whole[1], rtol=1e-12,
                                                                                       atol=1e-12)


def test_compiled_head_pads_every_chunk_to_one_shape_and_equals_the_eager_head(target, monkeypatch, fresh_dynamo):
    """After `compile_layers` the training step's chunks run through one compiled graph of the head's vectors:
    7 blocks in chunks of 2 pad the last chunk, so Dynamo captures a single graph for all four calls (a second shape
    would be a recompile mid-run); the scores and every gradient equal the eager head's over all blocks at once, and
    no-grad calls (decoding, validation) keep the eager head."""
    from dflash_train.accel import compile as compile_layer

    monkeypatch.setattr(compile_layer, "_compiled", {})  # this test's graphs stay out of other tests
    monkeypatch.setattr(compile_layer, "_codes", {})
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    d, inputs = drafter(target), lattice_inputs(target)
    whole = scores_and_grads(d, target, inputs, head_at_once(d, target))
    monkeypatch.setattr(model_module, "CHUNK_NODES", 32)
    d.compile_layers(backend=recorder)
    chunked = scores_and_grads(d, target, inputs)
    # the family's layers do not run here: every graph is the head's; one static chunk shape, [2 blocks, 4 slots,
    # 4 candidates, H] for the candidates' embeddings
    assert len(graphs) == 1 and (2, 4, 4, target.config.hidden_size) in graphs[0], graphs
    for a, b in zip(whole[:4], chunked[:4]):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert all(torch.allclose(whole[4][n], chunked[4][n], rtol=1e-10, atol=1e-12) for n in whole[4])
    seen = len(graphs)
    with torch.no_grad():
        start, _ = d.lattice(*inputs[:2], inputs[2], target.get_input_embeddings())
    assert len(graphs) == seen and torch.allclose(start, whole[0], rtol=1e-12, atol=1e-12)


def test_the_compiled_head_compiles_once_with_its_backward_under_bf16_autocast(target, monkeypatch, fresh_dynamo):
    """As training runs it: bf16 autocast, AOTAutograd's joint graph (aot_eager), the backward recomputing each chunk
    through the compiled graph: two steps over full and padded chunks compile one graph and recompile nothing, and
    the scores match the eager head's to bf16 rounding."""
    from dflash_train.accel import compile as compile_layer

    monkeypatch.setattr(compile_layer, "_compiled", {})
    monkeypatch.setattr(compile_layer, "_codes", {})
    monkeypatch.setattr(model_module, "CHUNK_NODES", 32)  # 7 blocks: three chunks of 2, one padded
    d = drafter(target).float()
    hidden, lp, cand = lattice_inputs(target)

    def step():
        h, p = (t.detach().float().requires_grad_() for t in (hidden, lp))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            start, pair = d.lattice(h, p, cand, target.get_input_embeddings())
        (start.square().sum() + pair.sum()).backward()
        return start.detach(), h.grad

    eager = step()
    d.compile_layers(backend="aot_eager")
    graphs, recompiles = compile_layer.graphs_compiled(), compile_layer.recompiles()
    first, second = step(), step()
    assert compile_layer.graphs_compiled() - graphs == 1 and compile_layer.recompiles() == recompiles
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    torch.testing.assert_close(first[0], eager[0], rtol=0.05, atol=0.05)
    assert first[1].abs().sum() > 0
