"""`family.loss.candidate_logits`: each row's logits at its candidates under a frozen head, chunked, against the
float64 einsum over the whole gather; the values-given path; what it keeps to the backward (no [M, k, H] gather)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.architectures.family.loss import candidate_logits


def _case(m=13, k=5, hidden=24, vocab=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    cand = torch.randint(0, vocab, (m, k), generator=g)
    return rows, head, cand


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
def test_the_chunked_logits_and_row_gradients_equal_the_whole_gathers(chunk):
    rows, head, cand = _case()
    weights = torch.randn(cand.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z = candidate_logits(rows, head, cand, chunk)
    want = torch.einsum("mh,mkh->mk", rows, head[cand])
    torch.testing.assert_close(z, want, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad((z * weights).sum(), rows)
    (ref,) = torch.autograd.grad((want * weights).sum(), rows)
    torch.testing.assert_close(grad, ref, rtol=0, atol=1e-12)


def test_given_values_come_back_as_they_are_with_the_gradient_of_the_logits():
    rows, head, cand = _case()
    known = torch.randn(cand.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    z = candidate_logits(rows, head, cand, 4, values=known)
    assert torch.equal(z, known) and z.data_ptr() != known.data_ptr()
    (grad,) = torch.autograd.grad(z.sum(), rows)
    torch.testing.assert_close(grad, head[cand].sum(1), rtol=0, atol=1e-12)


def test_nothing_the_size_of_the_gather_is_kept_to_the_backward():
    rows, head, cand = _case(m=64, k=8, hidden=32)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        z = candidate_logits(rows, head, cand, 16)
    assert sorted(t.numel() for t in kept) == sorted([head.numel(), cand.numel()])
    assert z.requires_grad


def test_a_trained_head_is_refused():
    rows, head, cand = _case()
    with pytest.raises(ValueError, match="frozen"):
        candidate_logits(rows, head.requires_grad_(), cand)
