"""GPU tests (`pytest -m gpu`): DSpark's and Domino's chunked losses with their chunk math compiled (inductor, as
training runs them) against the same losses with the chunk math eager on the GPU and a float64 reference on the
CPU, and no recompile after the first step for other row counts, chunk splits and target spans."""

import pytest
import torch

from _gpu_helpers import _fresh_dynamo_per_test, _rel  # noqa: F401 (the autouse Dynamo reset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, V, R, E, G, SEQ = 256, 32000, 64, 32, 48, 1024


def _eager_chunks(monkeypatch, module):
    """The module's chunk math run eagerly, also on CUDA."""
    monkeypatch.setattr(module, "chunk_function", lambda name, fn, device, eager=None: fn)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _dspark_inputs(m: int, seed: int):
    """bf16 drafter rows and Markov features, the frozen bf16 head, the float32 Markov table, the target's bf16 final
    states `[2, SEQ, H]`, the rows' positions (sorted, ~4 rows a position), labels and coefficients."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(m, H, generator=g) * 0.5).to(torch.bfloat16)
    feature = torch.randn(m, R, generator=g).to(torch.bfloat16)
    head = (torch.randn(V, H, generator=g) * 0.1).to(torch.bfloat16)
    w2 = torch.randn(V, R, generator=g) * 0.05
    final = (torch.randn(2, SEQ, H, generator=g) * 0.5).to(torch.bfloat16)
    source = torch.randint(0, 2 * SEQ, (m // 4 + 1,), generator=g).repeat_interleave(4)[:m].sort().values
    labels = torch.randint(0, V, (m,), generator=g)
    coef = [torch.rand(m, generator=g) / m for _ in range(3)]
    cuda = [t.cuda() for t in (hidden, feature, head, w2, final, labels, *coef)]
    for t in (cuda[0], cuda[1], cuda[3]):
        t.requires_grad_()
    return cuda, source


def _dspark_step(inputs, source, chunk: int, dpard: bool):
    """The chunked loss as the objective runs it (forward under bf16 autocast, backward; D-PARD: its gradient-free
    first pass, then the pass with Renyi coefficients): (loss, per-row terms, gradients of hidden, feature, w2)."""
    from dflash_train.architectures.dspark.loss import chunked_dspark_rows, target_positions

    hidden, feature, head, w2, final, labels, a, b, c = inputs
    targets = target_positions(final, source, chunk)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if dpard:
            with torch.no_grad():
                first = chunked_dspark_rows(hidden.detach(), feature.detach(), head, w2.detach(), targets, labels,
                                            a * 0, b * 0, chunk)
            c = c * (1 - first.l1 / 2).clamp(0, 1)
            a, b = a * 0, b * 0
        out = chunked_dspark_rows(hidden, feature, head, w2, targets, labels, a, b, chunk, c if dpard else None)
    grads = torch.autograd.grad(out.loss, [hidden, feature, w2])
    return out, grads


@pytest.mark.parametrize("dpard", [False, True])
def test_dsparks_compiled_chunk_math_matches_eager_and_never_recompiles(monkeypatch, dpard):
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.dspark import loss as loss_mod

    compile_layer.watch_recompiles()
    inputs, source = _dspark_inputs(3000, 0)
    with monkeypatch.context() as eager:
        _eager_chunks(eager, loss_mod)
        want, want_grads = _dspark_step(_leaves(*inputs), source, 1024, dpard)
    got, got_grads = _dspark_step(inputs, source, 1024, dpard)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-6)
    for name in ("ce", "l1", "renyi"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-4, atol=1e-4, msg=name)
    assert (got.correct == want.correct).float().mean() > 0.999
    for name, x, y in zip(("hidden", "feature", "w2"), got_grads, want_grads):
        assert _rel(x.double(), y.double()) < 1e-2, name

    # against float64 from full logits of the same bf16 inputs (the Markov table rounded as the loss rounds it)
    hidden, feature, head, w2, final, labels, a, b, c = [t.detach().cpu() if t.dtype == torch.long else
                                                         t.detach().double().cpu() for t in inputs]
    if not dpard:
        z = hidden @ head.t() + feature @ w2.to(torch.bfloat16).double().t()
        log_p = torch.log_softmax(z, -1)
        p_t = torch.softmax(final.reshape(-1, H)[source] @ head.t(), -1)
        ce = -log_p.gather(1, labels.view(-1, 1)).squeeze(1)
        l1 = (log_p.exp() - p_t).abs().sum(-1)
        assert float(got.loss) == pytest.approx(float((a * ce + b * l1).sum()), rel=5e-3)

    before = compile_layer.graphs_compiled(), compile_layer.recompiles()
    for m, chunk, seed in ((2999, 1024, 1), (1025, 1024, 2), (517, 256, 3), (2050, 2048, 4)):
        _dspark_step(*_dspark_inputs(m, seed), chunk, dpard)
    assert (compile_layer.graphs_compiled(), compile_layer.recompiles()) == before


def _domino_inputs(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(m, H, generator=g) * 0.5).to(torch.bfloat16)
    features = torch.randn(m, E, generator=g).to(torch.bfloat16)
    features[::16] = 0  # the pure-draft slots
    head = (torch.randn(V, H, generator=g) * 0.1).to(torch.bfloat16)
    correction = torch.randn(V, E, generator=g) * 0.05
    labels = torch.randint(0, V, (m,), generator=g)
    w = torch.rand(m, generator=g)
    cuda = [t.cuda() for t in (hidden, features, head, correction, labels, w / w.sum())]
    for t in (cuda[0], cuda[1], cuda[3]):
        t.requires_grad_()
    return cuda


def _domino_step(inputs, chunk: int, lam: float, transform: dict):
    from dflash_train.architectures.domino.loss import chunked_domino_rows

    hidden, features, head, correction, labels, norm = inputs
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = chunked_domino_rows(hidden, features, head, correction, labels, (1 - lam) * norm, lam * norm, chunk,
                                  **transform)
    return out, torch.autograd.grad(out.loss, [hidden, features, correction])


@pytest.mark.parametrize("transform", [{}, {"output_multiplier": 0.5, "softcap": 30.0}])
def test_dominos_compiled_chunk_math_matches_eager_and_never_recompiles(monkeypatch, transform):
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.domino import loss as loss_mod

    compile_layer.watch_recompiles()
    inputs = _domino_inputs(3000, 0)
    with monkeypatch.context() as eager:
        _eager_chunks(eager, loss_mod)
        want, want_grads = _domino_step(_leaves(*inputs), 1024, 0.3, transform)
    got, got_grads = _domino_step(inputs, 1024, 0.3, transform)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-6)
    for name in ("final_ce", "base_ce"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-4, atol=1e-4, msg=name)
    for name in ("final_correct", "base_correct"):
        assert (getattr(got, name) == getattr(want, name)).float().mean() > 0.999, name
    for name, x, y in zip(("hidden", "features", "correction"), got_grads, want_grads):
        assert _rel(x.double(), y.double()) < 1e-2, name

    hidden, features, head, correction, labels, norm = [t.detach().cpu() if t.dtype == torch.long else
                                                        t.detach().double().cpu() for t in inputs]
    base = hidden @ head.t()
    final = base + features @ correction.to(torch.bfloat16).double().t()
    if transform:
        m, cap = transform["output_multiplier"], transform["softcap"]
        base, final = cap * torch.tanh(m * base / cap), cap * torch.tanh(m * final / cap)
    ce = [torch.nn.functional.cross_entropy(x, labels, reduction="none") for x in (final, base)]
    assert float(got.loss) == pytest.approx(float((0.7 * ce[0] * norm + 0.3 * ce[1] * norm).sum()), rel=5e-3)

    before = compile_layer.graphs_compiled(), compile_layer.recompiles()
    for m, chunk, lam in ((2999, 1024, 0.0), (1025, 1024, 1.0), (517, 256, 0.7), (2050, 2048, 0.25)):
        _domino_step(_domino_inputs(m, m), chunk, lam, transform)
    assert (compile_layer.graphs_compiled(), compile_layer.recompiles()) == before


@pytest.mark.parametrize("transform", [{}, {"output_multiplier": 0.5, "softcap": 30.0}])
def test_dominos_compiled_weights_pass_matches_eager_and_never_recompiles(monkeypatch, transform):
    """The gradient-free pass of the final scores' label log-probabilities (acceptance and dpace slot weights):
    compiled as eager computes it, minus the loss's final CE, and no recompile for other row counts or splits."""
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.domino import loss as loss_mod

    def label_logp(inputs, chunk: int):
        hidden, features, head, correction, labels, _ = inputs
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss_mod.final_label_logp(hidden, features, head, correction, labels, chunk, **transform)

    compile_layer.watch_recompiles()
    inputs = _domino_inputs(3000, 0)
    with monkeypatch.context() as eager:
        _eager_chunks(eager, loss_mod)
        want = label_logp(inputs, 1024)
    got = label_logp(inputs, 1024)
    assert not got.requires_grad and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    out, _ = _domino_step(inputs, 1024, 0.3, transform)
    torch.testing.assert_close(got, -out.final_ce, rtol=1e-4, atol=1e-4)

    before = compile_layer.graphs_compiled(), compile_layer.recompiles()
    for m, chunk in ((2999, 1024), (1025, 1024), (517, 256), (2050, 2048)):
        label_logp(_domino_inputs(m, m), chunk)
    assert (compile_layer.graphs_compiled(), compile_layer.recompiles()) == before
