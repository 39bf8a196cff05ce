"""The training mask against a brute-force enumeration of the spec's rule, and flex vs dense."""

import warnings

import pytest
import torch

from dflash_train.architectures.family.mask import dense_mask, flex_block_mask, flex_mask_mod
from dflash_train.architectures.family.blocks import sample_anchors
from dflash_train.accel import compile as compile_layer


def brute_force(anchors, keep, context_len, block_size, boundary="<", window=None, causal=False, window_op="<"):
    """The spec's rule, one (query, key) pair at a time, with plain Python ints. With a window or causality:
    the reference's rule in absolute positions (query slot i at a + i, context key k at k, own-block slot j at
    a + j): causal keeps k_pos <= q_pos; a window W keeps q_pos - k_pos < W, and k_pos - q_pos < W when not
    causal. `window_op="<="` is the off-by-one a test shows is wrong."""
    batch, n = anchors.shape
    q_len, kv_len = n * block_size, context_len + n * block_size
    out = torch.zeros(batch, 1, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for q in range(q_len):
            blk = q // block_size
            a = int(anchors[b, blk])
            if not bool(keep[b, blk]):
                continue
            q_pos = a + q % block_size
            for k in range(kv_len):
                if k < context_len:
                    visible = k < a if boundary == "<" else k <= a
                    k_pos = k
                else:
                    visible = (k - context_len) // block_size == blk
                    k_pos = a + (k - context_len) % block_size
                if causal:
                    visible = visible and k_pos <= q_pos
                if window is not None:
                    def near(d):
                        return d < window if window_op == "<" else d <= window
                    visible = visible and near(q_pos - k_pos) and (causal or near(k_pos - q_pos))
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


def random_kind(seed, block_size):
    """A window from 1 (each query sees itself alone) past the block to beyond any context, and a causal flag."""
    g = torch.Generator().manual_seed(seed + 5000)
    windows = [None, 1, 2, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 37, 500]
    window = windows[int(torch.randint(0, len(windows), (1,), generator=g))]
    return (max(window, 1) if window is not None else None), bool(torch.randint(0, 2, (1,), generator=g))


def pad_blocks(anchors, keep, block_size, tile):
    pad = (-anchors.shape[1] * block_size) % tile // block_size
    if pad:
        anchors = torch.cat([anchors, anchors.new_zeros(anchors.shape[0], pad)], 1)
        keep = torch.cat([keep, keep.new_zeros(keep.shape[0], pad)], 1)
    return anchors, keep


@pytest.mark.parametrize("seed", range(12))
def test_dense_mask_equals_brute_force(seed):
    anchors, keep, s, bs = random_case(seed)
    assert torch.equal(dense_mask(anchors, keep, s, bs), brute_force(anchors, keep, s, bs))


@pytest.mark.parametrize("seed", range(24))
def test_dense_mask_with_a_window_and_causality_equals_brute_force(seed):
    anchors, keep, s, bs = random_case(seed + 200)
    window, causal = random_kind(seed, bs)
    assert torch.equal(dense_mask(anchors, keep, s, bs, window, causal),
                       brute_force(anchors, keep, s, bs, window=window, causal=causal))


@pytest.mark.parametrize("seed", range(12))
def test_flex_mask_mod_equals_brute_force(seed):
    """The flex form's predicate, evaluated by flex's own `create_mask` (vmap over b, h, q, kv) on the CPU."""
    from torch.nn.attention.flex_attention import create_mask

    anchors, keep, s, bs = random_case(seed + 400)
    window, causal = random_kind(seed + 7, bs)
    batch, n = anchors.shape
    mod = flex_mask_mod(anchors, keep, s, bs, window, causal)
    got = create_mask(mod, batch, 1, n * bs, s + n * bs, device="cpu")
    assert torch.equal(got, brute_force(anchors, keep, s, bs, window=window, causal=causal))


def test_a_window_counts_absolute_positions_back_from_each_slot():
    """Slot i at anchor a sees context a+i-W+1 .. a-1 (W-1-i keys): strict `q - k < W`, the context included.
    Inside the block a window >= B never cuts; causality keeps slots j <= i."""
    bs, s, window = 4, 30, 6
    anchors, keep = torch.tensor([[20]]), torch.tensor([[True]])
    m = dense_mask(anchors, keep, s, bs, window, False)[0, 0]
    for i in range(bs):
        assert m[i, :s].nonzero().view(-1).tolist() == list(range(20 + i - window + 1, 20)), i
        assert m[i, s:].all()
    c = dense_mask(anchors, keep, s, bs, window, True)[0, 0]
    assert torch.equal(c[:, :s], m[:, :s])
    assert torch.equal(c[:, s:], torch.tril(torch.ones(bs, bs, dtype=torch.bool)))
    # W = 1: each slot sees itself only (no context); W < B, not causal: |i - j| < W inside the block.
    one = dense_mask(anchors, keep, s, bs, 1, False)[0, 0]
    assert torch.equal(one, torch.cat([torch.zeros(bs, s, dtype=torch.bool), torch.eye(bs, dtype=torch.bool)], 1))
    two = dense_mask(anchors, keep, s, bs, 2, False)[0, 0, :, s:]
    assert torch.equal(two, (torch.arange(bs).view(-1, 1) - torch.arange(bs)).abs() < 2)
    assert not torch.equal(m, brute_force(anchors, keep, s, bs, window=window, window_op="<=")[0, 0])


def test_causality_alone_changes_only_the_block_part():
    anchors, keep, s, bs = random_case(3)
    plain, causal = dense_mask(anchors, keep, s, bs), dense_mask(anchors, keep, s, bs, None, True)
    assert torch.equal(plain[..., :s], causal[..., :s])
    assert not torch.equal(plain, causal) and not (causal & ~plain).any()


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


def check_tiles(bm, dense, tile):
    """Tile structure: every visible pair lies in a listed tile, 'full' tiles are entirely visible,
    and no listed tile is entirely invisible (no wasted or missing tiles)."""
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


@pytest.mark.parametrize("seed", range(6))
def test_flex_block_mask_covers_exactly_the_predicate(seed):
    anchors, keep, s, bs = random_case(seed + 100)
    tile = 16
    anchors, keep = pad_blocks(anchors, keep, bs, tile)
    check_tiles(flex_block_mask(anchors, keep, s, bs, tile=tile), brute_force(anchors, keep, s, bs)[:, 0], tile)


@pytest.mark.parametrize("seed", range(16))
def test_flex_block_mask_covers_exactly_the_predicate_with_windows_and_causality(seed):
    """Also with tiles smaller than the context (8) so that windows leave whole context tiles unseen between
    anchors, and full tiles occur inside windows."""
    anchors, keep, s, bs = random_case(seed + 300)
    window, causal = random_kind(seed, bs)
    tile = max(8, bs)
    anchors, keep = pad_blocks(anchors, keep, bs, tile)
    dense = brute_force(anchors, keep, s, bs, window=window, causal=causal)[:, 0]
    check_tiles(flex_block_mask(anchors, keep, s, bs, tile=tile, window=window, causal=causal), dense, tile)


def test_a_window_lists_only_the_context_tiles_near_each_anchor():
    """Two far-apart anchors in one query tile: the window's tiles near each are listed, the gap between them is
    not (a bound by the smallest and largest anchor would list it), and tiles wholly inside every slot's window
    are full."""
    bs, tile, s, window = 4, 8, 96, 20
    anchors, keep = torch.tensor([[10, 80]]), torch.tensor([[True, True]])
    bm = flex_block_mask(anchors, keep, s, bs, tile=tile, window=window)
    listed = set(bm.kv_indices[0, 0, 0, : bm.kv_num_blocks[0, 0, 0]].tolist())
    full = set(bm.full_kv_indices[0, 0, 0, : bm.full_kv_num_blocks[0, 0, 0]].tolist())
    # anchor 10 sees [0, 10) at slot 0 (tiles 0, 1); anchor 80 sees [61, 80) (tiles 7, 8, 9); own keys: tile 12.
    assert listed | full == {0, 1, 7, 8, 9, 12}
    assert not full  # the block at 10 does not see tiles 8, 9; the one at 80 sees no tile whole at all its slots
    check_tiles(bm, brute_force(anchors, keep, s, bs, window=window)[:, 0], tile)
    # Blocks at 80 and 82, W = 24: their last slots see [60, 80) and [62, 82), so tiles 8, 9 ([64, 80)) are full;
    # slot 0 of each reaches back to 57 / 59 (tile 7) and the block at 82 sees 80, 81 (tile 10): partial.
    anchors, window = torch.tensor([[80, 82]]), 24
    bm = flex_block_mask(anchors, keep, s, bs, tile=tile, window=window)
    assert set(bm.full_kv_indices[0, 0, 0, : bm.full_kv_num_blocks[0, 0, 0]].tolist()) == {8, 9}
    assert set(bm.kv_indices[0, 0, 0, : bm.kv_num_blocks[0, 0, 0]].tolist()) == {7, 10, 12}
    check_tiles(bm, brute_force(anchors, keep, s, bs, window=window)[:, 0], tile)


def _eager_flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    # eager flex on purpose: a tiny CPU forward, no compile needed (allowed explicitly: a trainer test earlier in
    # this process may have sealed the compile layer)
    with warnings.catch_warnings(), compile_layer.allow_eager_flex():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def _qkv(batch, n, bs, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, n * bs, 16, generator=g), torch.randn(batch, 2, s + n * bs, 16, generator=g),
            torch.randn(batch, 2, s + n * bs, 16, generator=g))


def test_flex_attention_matches_sdpa_forward_on_cpu():
    from dflash_train.architectures.attention import sdpa_attention

    anchors, keep, s, bs = random_case(7)
    tile = 128
    anchors, keep = pad_blocks(anchors, keep, bs, tile)
    q, k, v = _qkv(*anchors.shape, bs, s)
    ref = sdpa_attention(q, k, v, dense_mask(anchors, keep, s, bs))
    out = _eager_flex(q, k, v, flex_block_mask(anchors, keep, s, bs, tile=tile))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,causal", [(None, True), (5, False), (5, True), (3, False), (40, True)])
def test_flex_attention_with_a_window_or_causality_matches_sdpa_on_cpu(window, causal):
    """The flex form (block mask + mask_mod) runs the same attention as the dense form, per kind; and the kind
    matters (the plain mask gives another output)."""
    from dflash_train.architectures.attention import sdpa_attention

    anchors, keep, s, bs = random_case(11)
    tile = 128
    anchors, keep = pad_blocks(anchors, keep, bs, tile)
    q, k, v = _qkv(*anchors.shape, bs, s, seed=1)
    ref = sdpa_attention(q, k, v, dense_mask(anchors, keep, s, bs, window, causal))
    out = _eager_flex(q, k, v, flex_block_mask(anchors, keep, s, bs, tile=tile, window=window, causal=causal))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain = sdpa_attention(q, k, v, dense_mask(anchors, keep, s, bs))
    assert not torch.allclose(out, plain, atol=1e-3)
