"""KVCache semantics on the CPU (reference path): prefill, step, advance, release/admit,
capacity errors with nothing written, lengths bookkeeping over many steps."""

from __future__ import annotations

import warnings

import pytest
import torch

from mmha import KVCache, dispatch, layout, reference

HQ, HKV, D = 4, 2, 16
WIDTH = (HQ + 2 * HKV) * D


pytestmark = pytest.mark.usefixtures("no_reference_warning")


def make(layers=2, batch=3, smax=12, dtype=torch.float32, **kw):
    return KVCache(layers, batch, smax, HQ, HKV, D, dtype, "cpu", **kw)


def snapshot(cache):
    return (
        [c.clone() for c in cache.k_caches],
        [c.clone() for c in cache.v_caches],
        cache.lengths.clone(),
        cache.host_lengths,
    )


def assert_unchanged(cache, snap):
    ks, vs, lengths, host = snap
    for a, b in zip(cache.k_caches + cache.v_caches, ks + vs, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(cache.lengths, lengths)
    assert cache.host_lengths == host


def prompt(n, s, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, s, HKV, D, generator=g).to(dtype),
        torch.randn(n, s, HKV, D, generator=g).to(dtype),
    )


def test_construction_reports_bytes_and_layouts():
    cache = make(layers=3, batch=2, smax=8, dtype=torch.float16)
    assert cache.nbytes == 2 * 3 * 2 * HKV * 8 * D * 2
    assert cache.k_caches[0].shape == (2, HKV, D // 8, 8, 8)
    assert cache.v_caches[0].shape == (2, HKV, 8, D)
    assert cache.lengths.dtype == torch.int32 and cache.host_lengths == [0, 0]
    assert not cache.use_kernel


def test_reference_path_warns_once():
    import mmha.cache as cache_mod

    cache_mod._warned_reference = False
    with pytest.warns(RuntimeWarning, match="reference path"):
        make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make()


def test_prefill_ragged_then_steps_match_reference_decoding():
    cache = make()
    lens = [5, 0, 9]
    for layer in range(2):
        k, v = prompt(3, 9, seed=layer)
        cache.prefill(layer, k, v, lens)
        got_k = layout.unpack_k(cache.k_caches[layer])
        for r, n in enumerate(lens):
            assert torch.equal(got_k[r, :n], k[r, :n])
    assert cache.host_lengths == lens and cache.lengths.tolist() == lens
    mirror_k = [c.clone() for c in cache.k_caches]
    mirror_v = [c.clone() for c in cache.v_caches]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for layer in range(2):
            qkv = torch.randn(3, WIDTH, generator=g)
            lens_t = torch.tensor([n + step for n in lens], dtype=torch.int32)
            expect = reference.decode_step(
                qkv, mirror_k[layer], mirror_v[layer], lens_t, num_heads=HQ, num_kv_heads=HKV
            )
            torch.testing.assert_close(cache.step(layer, qkv), expect)
        cache.advance()
    assert cache.host_lengths == [n + 3 for n in lens]
    assert cache.lengths.tolist() == cache.host_lengths


def test_step_returns_lse_and_does_not_move_lengths():
    cache = make()
    out, lse = cache.step(0, torch.randn(3, WIDTH), return_lse=True)
    assert out.shape == (3, HQ * D) and lse.shape == (3, HQ)
    assert cache.host_lengths == [0, 0, 0]


def test_row_filled_exactly_to_capacity_then_rejected_with_nothing_written():
    cache = make(batch=2, smax=4)
    k, v = prompt(2, 3)
    for layer in range(2):
        cache.prefill(layer, k, v, [3, 1])
    for layer in range(2):  # slot 3 is the last one: allowed
        cache.step(layer, torch.randn(2, WIDTH))
    cache.advance()
    assert cache.host_lengths == [4, 2]
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"rows \[0\] are full: length 4 == max_seq_len"):
        cache.step(0, torch.randn(2, WIDTH))
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match=r"rows \[0\] would exceed max_seq_len \(4\)"):
        cache.advance()
    assert_unchanged(cache, snap)
    # Releasing the full row makes the batch usable again.
    cache.release([0])
    cache.step(0, torch.randn(2, WIDTH))


def test_prefill_over_capacity_for_one_row_writes_nothing():
    cache = make(batch=2, smax=4)
    snap = snapshot(cache)
    k, v = prompt(2, 5)
    with pytest.raises(
        ValueError, match=r"lengths\[1\] \(5\) exceeds the cache capacity max_seq_len \(4\) for row 1"
    ):
        cache.prefill(0, k, v, [2, 5])
    assert_unchanged(cache, snap)


def test_release_and_admit_reuse_slots_without_reallocating():
    cache = make(batch=3)
    ptrs = [c.data_ptr() for c in cache.k_caches + cache.v_caches]
    k, v = prompt(3, 4)
    for layer in range(2):
        cache.prefill(layer, k, v, [4, 2, 3])
    cache.release([1])
    assert cache.active_rows == [0, 2] and cache.free_rows == [1]
    assert cache.host_lengths == [4, 0, 3]
    cache.step(0, torch.randn(3, WIDTH))
    cache.advance()
    assert cache.host_lengths == [5, 0, 4]  # the free row does not advance
    assert cache.admit(count=1) == [1]
    k1, v1 = prompt(1, 2, seed=5)
    cache.prefill(0, k1, v1, [2], rows=[1])
    assert cache.host_lengths == [5, 2, 4]
    assert [c.data_ptr() for c in cache.k_caches + cache.v_caches] == ptrs
    with pytest.raises(
        ValueError, match=r"rows must be free \(released\) to be admitted, got active rows \[0\]"
    ):
        cache.admit([0])
    with pytest.raises(ValueError, match=r"count must be <= the 0 free rows, got 1"):
        cache.admit(count=1)


def test_lengths_bookkeeping_over_many_steps():
    cache = make(layers=1, batch=2, smax=64)
    for i in range(50):
        if i == 20:
            cache.release([1])
        if i == 30:
            cache.admit([1])
        cache.step(0, torch.randn(2, WIDTH))
        cache.advance()
    assert cache.host_lengths == [50, 20]
    assert cache.lengths.tolist() == [50, 20]


def test_smaller_batch_steps_use_the_first_rows():
    cache = make(batch=3)
    out = cache.step(0, torch.randn(2, WIDTH))
    assert out.shape == (2, HQ * D)


def test_plan_on_the_reference_path_is_that_of_one_sm():
    cache = KVCache(1, 3, 12, 4, 2, 64, torch.float16, "cpu")
    plan = cache.plan(2)
    assert plan == dispatch.choose_variant(2, 4, 2, 64, 1, torch.float16, dispatch.ONE_SM)
    assert plan.num_splits >= 1


def test_account_replay_moves_the_host_mirror_only():
    cache = make(layers=1, batch=2, smax=8)
    cache.account_replay(3)
    assert cache.host_lengths == [3, 3]
    assert cache.lengths.tolist() == [0, 0]
    with pytest.raises(ValueError, match="would exceed max_seq_len"):
        cache.account_replay(6)


def test_workspace_check_raises_for_flagged_rows_and_clears():
    from mmha import ops

    ws = ops.Workspace.allocate("cpu", 3, 4, 64, 2)
    # merge + work counters (3 * 4 + 2), then a one-node tree's area from an even offset (3 * 3 + 3)
    assert ws.fits(3, 4, 64, 2) and ws.counters.numel() == 3 * 4 + 2 + 3 * 3 + 3 and ws.status.numel() == 3
    assert not ws.fits(3, 4, 64, 2, nodes=2)
    ws.check()  # nothing raised
    ws.status[2] = 1
    with pytest.raises(ops.LengthError, match=r"lengths of rows \[2\] were outside \[0, S_max - 1\]"):
        ws.check()
    assert not ws.status.any()
    cache = KVCache(1, 2, 8, 4, 2, 64, torch.float32, "cpu")
    assert cache.capacity == 8  # the CPU path keeps the exact capacity
    cache.check()  # no workspace yet: nothing to check
