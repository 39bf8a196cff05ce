"""The training mask against a brute-force enumeration of the spec's rule, and flex vs dense."""

import pytest
import torch

from dflash_train.algorithms.dflash.mask import dense_mask, flex_block_mask
from dflash_train.algorithms.dflash.blocks import sample_anchors


def brute_force(anchors, keep, context_len, block_size, boundary="<"):
    """The spec's rule, one (query, key) pair at a time, with plain Python ints."""
    batch, n = anchors.shape
    q_len, kv_len = n * block_size, context_len + n * block_size
    out = torch.zeros(batch, 1, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for q in range(q_len):
            blk = q // block_size
            a = int(anchors[b, blk])
            if not bool(keep[b, blk]):
                continue
            for k in range(kv_len):
                if k < context_len:
                    visible = k < a if boundary == "<" else k <= a
                else:
                    visible = (k - context_len) // block_size == blk
                out[b, 0, q, k] = visible
    return out


def random_case(seed):
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 4, (1,), generator=g))
    block_size = int(torch.tensor([2, 4, 8, 16])[torch.randint(0, 4, (1,), generator=g)])
    context_len = int(torch.randint(2 * block_size, 80, (1,), generator=g))
    lengths = torch.randint(block_size + 1, context_len + 1, (batch,), generator=g)
    lengths[0] = context_len
    loss_mask = (torch.rand(batch, context_len, generator=g) < 0.7).long()
    max_anchors = int(torch.randint(1, 12, (1,), generator=g))
    anchors, keep = sample_anchors(loss_mask, lengths, block_size, max_anchors, g)
    return anchors, keep, context_len, block_size


@pytest.mark.parametrize("seed", range(12))
def test_dense_mask_equals_brute_force(seed):
    anchors, keep, s, bs = random_case(seed)
    assert torch.equal(dense_mask(anchors, keep, s, bs), brute_force(anchors, keep, s, bs))


def test_boundary_is_strict():
    """The anchor itself is not context: a `<=` boundary would let the block see its own label source."""
    anchors = torch.tensor([[5, 9]])
    keep = torch.tensor([[True, True]])
    m = dense_mask(anchors, keep, 20, 4)
    assert not m[0, 0, 0, 5] and m[0, 0, 0, 4]
    assert not m[0, 0, 4, 9] and m[0, 0, 4, 8]
    assert not torch.equal(m, brute_force(anchors, keep, 20, 4, boundary="<="))


def test_blocks_never_see_each_other_and_unkept_blocks_see_nothing():
    anchors = torch.tensor([[3, 7, 0]])
    keep = torch.tensor([[True, True, False]])
    m = dense_mask(anchors, keep, 16, 4)[0, 0]
    block_part = m[:, 16:]
    for n in range(3):
        rows = block_part[n * 4:(n + 1) * 4]
        others = torch.ones(12, dtype=torch.bool)
        others[n * 4:(n + 1) * 4] = False
        assert not rows[:, others].any()
    assert not m[8:12].any()
    assert m[0:4, 16:20].all()


@pytest.mark.parametrize("seed", range(6))
def test_flex_block_mask_covers_exactly_the_predicate(seed):
    """Tile structure: every visible pair lies in a listed tile, 'full' tiles are entirely visible,
    and no listed tile is entirely invisible (no wasted or missing tiles)."""
    anchors, keep, s, bs = random_case(seed + 100)
    tile = 16
    n = anchors.shape[1]
    pad = (-n * bs) % tile // bs
    if pad:
        anchors = torch.cat([anchors, anchors.new_zeros(anchors.shape[0], pad)], 1)
        keep = torch.cat([keep, keep.new_zeros(keep.shape[0], pad)], 1)
    dense = brute_force(anchors, keep, s, bs)[:, 0]
    bm = flex_block_mask(anchors, keep, s, bs, tile=tile)
    q_len, kv_len = dense.shape[1:]
    for b in range(dense.shape[0]):
        for qt in range(-(-q_len // tile)):
            partial = set(bm.kv_indices[b, 0, qt, : bm.kv_num_blocks[b, 0, qt]].tolist())
            full = set(bm.full_kv_indices[b, 0, qt, : bm.full_kv_num_blocks[b, 0, qt]].tolist())
            assert not partial & full
            for kt in range(-(-kv_len // tile)):
                sub = dense[b, qt * tile:(qt + 1) * tile, kt * tile:(kt + 1) * tile]
                if kt in full:
                    assert sub.all(), (b, qt, kt)
                elif kt in partial:
                    assert sub.any(), (b, qt, kt)
                else:
                    assert not sub.any(), (b, qt, kt)


def test_flex_attention_matches_sdpa_forward_on_cpu():
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.algorithms.dflash.model import sdpa_attention

    anchors, keep, s, bs = random_case(7)
    tile = 128
    n = anchors.shape[1]
    pad = (-n * bs) % tile // bs
    anchors = torch.cat([anchors, anchors.new_zeros(anchors.shape[0], pad)], 1)
    keep = torch.cat([keep, keep.new_zeros(keep.shape[0], pad)], 1)
    batch, n = anchors.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, n * bs, 16, generator=g)
    k = torch.randn(batch, 2, s + n * bs, 16, generator=g)
    v = torch.randn(batch, 2, s + n * bs, 16, generator=g)
    ref = sdpa_attention(q, k, v, dense_mask(anchors, keep, s, bs))
    import warnings

    from dflash_train.model import compile as compile_layer

    # eager flex on purpose: a tiny CPU forward, no compile needed (allowed explicitly: a trainer test earlier in
    # this process may have sealed the compile layer)
    with warnings.catch_warnings(), compile_layer.allow_eager_flex():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out = flex_attention(q, k, v, block_mask=flex_block_mask(anchors, keep, s, bs, tile=tile), enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
