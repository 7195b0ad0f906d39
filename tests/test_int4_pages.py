"""Paged int4 caches (mmha.int4_pages): a pool's rows read, step and take trees exactly as
contiguous int4 caches do, and bad tables write nothing."""

import pytest
import torch

from mmha import int4, int4_pages
from mmha.spec import AttentionSpec, Rotary

SPEC = AttentionSpec(rotary=Rotary(dim=64, theta=10000.0))
TABLES = [[5, 2, 7], [0, 6, 3]]  # rows 0 and 1: three 64-slot blocks each, out of order


def _pair(lengths, seed=0, dtype=torch.float16):
    """The same prompts in a paged pool and in a contiguous cache."""
    pages = int4_pages.Int4Pages.empty(8, 64, 2, 2, 64, dtype)
    flat = int4.Int4Cache.empty(2, 2, 192, 64, dtype)
    g = torch.Generator().manual_seed(seed)
    for row, n in enumerate(lengths):
        k, v = torch.randn(2, n, 64, generator=g), torch.randn(2, n, 64, generator=g)
        k[:, :, 9] *= 15.0
        flat.prefill(row, k, v)
        int4_pages.prefill(pages, row, TABLES[row], k, v)
    return pages, flat


def _same_rows(pages, flat, n):
    for row in range(2):
        got, want = pages.gather(row, TABLES[row]), flat
        for a, b in zip(got.read(0, n[row]), want.read(row, n[row]), strict=True):
            assert torch.equal(a, b)


def test_pool_shapes_and_block_size():
    p = int4_pages.Int4Pages.empty(4, 128, 3, 2, 64, torch.bfloat16)
    assert p.k_codes.shape == (4, 2, 2, 128, 16) and p.k_scale.shape == (4, 2, 2, 64)
    assert p.v_codes.shape == (4, 2, 128, 32) and p.k_residual.shape == (3, 2, 128, 64)
    with pytest.raises(ValueError, match="block_size must be a multiple of 64"):
        int4_pages.Int4Pages.empty(4, 32, 3, 2, 64, torch.bfloat16)


def test_paged_steps_equal_contiguous_steps():
    pages, flat = _pair([60, 130])
    tables = torch.tensor(TABLES)
    g = torch.Generator().manual_seed(1)
    for step in range(6):  # row 0 crosses its first group's end
        qkv = torch.randn(2, (8 + 4) * 64, generator=g).to(torch.float16)
        lengths = torch.tensor([60 + step, 130 + step])
        got = int4_pages.decode_step_paged(
            qkv, pages, tables, lengths, num_heads=8, num_kv_heads=2, attention=SPEC
        )
        want = int4.decode_step(qkv, flat, lengths, num_heads=8, num_kv_heads=2, attention=SPEC)
        assert torch.equal(got, want)
    _same_rows(pages, flat, [66, 136])
    assert flat.k_scale[0, :, 0].count_nonzero() > 0  # the group was committed in both


def test_paged_tree_and_accept_equal_contiguous():
    pages, flat = _pair([62, 100], seed=2)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 5, (8 + 4) * 64, generator=g).to(torch.float16)
    parents = torch.tensor([[-1, 0, 0, 1, 3], [-1, 0, 1, 2, 3]])
    lengths = torch.tensor([62, 100])
    kwargs = dict(num_heads=8, num_kv_heads=2, attention=SPEC)
    got = int4_pages.decode_tree_paged(qkv, pages, torch.tensor(TABLES), lengths, parents, **kwargs)
    want = int4.decode_tree(qkv, flat, lengths, parents, **kwargs)
    assert torch.equal(got, want)
    for row, path in enumerate(([0, 1, 3, 4], [0, 1])):
        int4_pages.accept(pages, row, TABLES[row], int(lengths[row]), path)
        flat.accept(row, int(lengths[row]), path)
    _same_rows(pages, flat, [66, 102])


def test_bad_tables_and_rows_write_nothing():
    pages, _ = _pair([60, 130])
    before = {k: t.clone() for k, t in vars(pages).items()}
    qkv = torch.zeros(2, (8 + 4) * 64, dtype=torch.float16)
    lengths = torch.tensor([60, 130])
    bad = [
        (torch.tensor([[5, 2, 7], [0, 6, 9]]), lengths, r"block_tables\[1, 2\] must be in \[0, 7\]"),
        (torch.tensor([[5], [0]]), lengths, "block_tables must hold 3 blocks for row 1"),
        (torch.tensor([[5, 2, 7], [0, 6, 6]]), lengths, r"block_tables\[1\] must not repeat a block"),
        (torch.tensor(TABLES), torch.tensor([60, -2]), r"lengths\[1\] must be >= 0"),
    ]
    for tables, lens, message in bad:
        with pytest.raises(ValueError, match=message):
            int4_pages.decode_step_paged(qkv, pages, tables, lens, num_heads=8, num_kv_heads=2)
    with pytest.raises(ValueError, match="qkv must have the cache's activation dtype"):
        int4_pages.decode_step_paged(
            qkv.float(), pages, torch.tensor(TABLES), lengths, num_heads=8, num_kv_heads=2
        )
    with pytest.raises(ValueError, match="positions must have shape"):
        int4_pages.decode_step_paged(qkv, pages, torch.tensor(TABLES), lengths, num_heads=8, num_kv_heads=2,
                                     positions=torch.tensor([1]))  # fmt: skip
    with pytest.raises(ValueError, match=r"block_tables must hold 3 blocks for row 1"):
        int4_pages.decode_tree_paged(qkv[:, None], pages, torch.tensor([[5, 2], [0, 6]]),
                                     torch.tensor([60, 128]), torch.tensor([[-1], [-1]]), num_heads=8,
                                     num_kv_heads=2)  # fmt: skip
    for name, t in vars(pages).items():
        assert torch.equal(t, before[name]), name
