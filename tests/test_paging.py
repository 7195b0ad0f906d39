"""Paged caches on the CPU (the reference path): the page allocator, paged against contiguous
steps bit for bit, fork and copy-on-write, the checks on block tables, and a fuzz of allocator
operations against a contiguous cache that mirrors them."""

from __future__ import annotations

import random

import pytest
import torch

from mmha import checks, layout, paging, reference
from mmha.cache import KVCache
from mmha.spec import AttentionSpec, Rotary

FP8 = torch.float8_e4m3fn


pytestmark = pytest.mark.usefixtures("no_reference_warning")


# ------------------------------------------------------------------ the allocator
def test_pool_ensure_release_and_invariants():
    pool = paging.PagePool(6, 16, 3, 4, "cpu")
    pool.ensure([0, 1], [0, 16])  # row 1 at length 16 owns the blocks of slots 0..16: two
    assert pool.rows == [[0], [1, 2], []] and pool.free_blocks == 3
    assert pool.tables[1, :3].tolist() == [1, 2, paging.NO_BLOCK]
    pool.ensure([1], [3])  # shrinks: block 2 goes back
    assert pool.rows[1] == [1] and pool.free_blocks == 4
    pool.release([0, 1])
    assert pool.free_blocks == 6
    pool.check()


def test_pool_is_all_or_nothing():
    pool = paging.PagePool(4, 16, 3, 4, "cpu")
    pool.ensure([0], [40])  # 3 blocks
    with pytest.raises(paging.PoolExhausted, match="1 free blocks of 16 slots, 3 are needed"):
        pool.ensure([1, 2], [0, 16])
    assert pool.rows[1] == [] and pool.rows[2] == [] and pool.free_blocks == 1
    with pytest.raises(ValueError, match="more than max_blocks_per_row"):
        pool.ensure([1], [64])
    with pytest.raises(paging.PoolExhausted, match="fork"):
        pool.fork(0, [1, 2], 40)
    assert pool.rows[1] == [] and pool.refs == [1, 1, 1, 0]
    pool.check()


def test_pool_fork_shares_full_blocks_and_copies_the_partial_one():
    pool = paging.PagePool(8, 16, 3, 4, "cpu")
    pool.ensure([0], [37])  # slots 0..37: blocks 0, 1, 2
    copies = pool.fork(0, [1, 2], 37)
    assert pool.rows[1][:2] == [0, 1] and pool.rows[2][:2] == [0, 1]
    assert copies == [(2, pool.rows[1][2]), (2, pool.rows[2][2])]
    assert pool.refs[0] == pool.refs[1] == 3 and pool.refs[2] == 1
    pool.release([0])
    assert pool.refs[0] == 2 and pool.refs[2] == 0
    pool.check()
    # At a block boundary nothing is copied: the next slot's block is new.
    pool2 = paging.PagePool(8, 16, 2, 4, "cpu")
    pool2.ensure([0], [32])
    assert pool2.fork(0, [1], 32) == [] and pool2.rows[1][:2] == pool2.rows[0][:2]
    pool2.check()


def test_block_sizes_checked():
    with pytest.raises(ValueError, match=r"block_size must be one of \(16, 32, 64, 128\)"):
        paging.PagePool(4, 8, 1, 1, "cpu")
    with pytest.raises(ValueError, match="block_size must be one of"):
        KVCache(1, 1, 32, 2, 1, 32, torch.float32, "cpu", paged=True, block_size=24)
    with pytest.raises(ValueError, match="num_blocks must be an int >= max_batch"):
        KVCache(1, 4, 32, 2, 1, 32, torch.float32, "cpu", paged=True, num_blocks=3)


# ------------------------------------------------------------------ the reference
def test_check_block_tables_names_the_argument():
    t = torch.tensor([[0, 1], [2, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_tables\[1\] must not repeat a block"):
        checks.block_tables(t, [20, 20], 4, 16)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] must be in \[0, 3\], got 7"):
        checks.block_tables(torch.tensor([[0, 7]]), [16], 4, 16)
    with pytest.raises(ValueError, match="block_tables must hold 3 blocks for row 0"):
        checks.block_tables(torch.tensor([[0, 1]]), [32], 4, 16)
    checks.block_tables(torch.tensor([[3, 9]]), [15], 4, 16)  # entries past the need: ignored


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_reference_equals_contiguous_on_shuffled_tables(block_size, dtype):
    g = torch.Generator().manual_seed(block_size)
    hq, hkv, d, s_max = 6, 2, 32, 300
    lengths = [0, block_size - 1, block_size, 2 * block_size + 5, 299]
    b = len(lengths)
    k = torch.randn(b, s_max, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, s_max, hkv, d, generator=g).to(dtype)
    kc, vc = layout.pack_k(k, s_max), layout.pack_v(v, s_max)
    max_blocks = -(-s_max // block_size)
    num_blocks = b * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    kp = torch.zeros(layout.k_pages_shape(num_blocks, hkv, block_size, d, dtype), dtype=dtype)
    vp = torch.zeros(layout.v_pages_shape(num_blocks, hkv, block_size, d), dtype=dtype)
    for row in range(b):
        layout.write_pages(kp, vp, tables[row].tolist(), k[row], v[row])
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    kw = dict(num_heads=hq, num_kv_heads=hkv, attention=AttentionSpec(rotary=Rotary(d)), return_lse=True)
    out_c, lse_c = reference.decode_step(qkv, kc, vc, lens, **kw)
    out_p, lse_p = reference.decode_step_paged(qkv, kp, vp, tables, lens, **kw)
    assert torch.equal(out_c, out_p) and torch.equal(lse_c, lse_p)
    for row in range(b):
        blocks = tables[row].tolist()
        n = lengths[row] + 1
        assert torch.equal(layout.gather_k(kp, blocks)[..., :n, :], kc[row : row + 1, :, :, :n])
        assert torch.equal(layout.gather_v(vp, blocks)[:, :, :n], vc[row : row + 1, :, :n])


# ------------------------------------------------------------------ KVCache
def pair(kv_dtype=None, dtype=torch.float16, block_size=16, num_blocks=None, max_batch=4, s_max=70):
    kw = dict(rotary_dim=32, kv_dtype=kv_dtype)
    paged = KVCache(2, max_batch, s_max, 4, 2, 32, dtype, "cpu", paged=True, block_size=block_size,
                    num_blocks=num_blocks, **kw)  # fmt: skip
    flat = KVCache(2, max_batch, s_max, 4, 2, 32, dtype, "cpu", **kw)
    return paged, flat


def rows_equal(paged: KVCache, flat: KVCache, rows) -> None:
    for layer in range(paged.num_layers):
        for r in rows:
            n = paged.host_lengths[r]
            blocks = paged.pool.rows[r]
            got_k = layout.gather_k(paged.k_caches[layer], blocks)[0, :, :, :n]
            got_v = layout.gather_v(paged.v_caches[layer], blocks)[0, :, :n]
            assert torch.equal(got_k.view(torch.uint8), flat.k_caches[layer][r, :, :, :n].view(torch.uint8))
            assert torch.equal(got_v.view(torch.uint8), flat.v_caches[layer][r, :, :n].view(torch.uint8))
            ours, theirs = (
                paged.storage.scales_view(layer, 0),
                flat.storage.scales_view(layer, flat.max_batch),
            )
            for name in ours:  # an int8 cache's token scales
                got = layout.gather_v(ours[name][..., None], blocks)[0, :, :n, 0]
                assert torch.equal(got, theirs[name][r, :, :n])


@pytest.mark.parametrize("kv_dtype", [None, FP8, torch.int8], ids=["16-bit", "fp8", "int8"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_kvcache_paged_steps_equal_contiguous(kv_dtype, block_size):
    paged, flat = pair(kv_dtype, block_size=block_size)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 33, 2, 32, generator=g).half()
    v = torch.randn(4, 33, 2, 32, generator=g).half()
    for c in (paged, flat):
        for layer in range(2):
            c.prefill(layer, k, v, [0, 15, 16, 33])
    for _ in range(20):
        qkv = torch.randn(4, 8 * 32, generator=g).half()
        for layer in range(2):
            assert torch.equal(paged.step(layer, qkv), flat.step(layer, qkv))
        paged.advance()
        flat.advance()
        paged.pool.check()
    rows_equal(paged, flat, range(4))


def test_fork_then_diverge_copies_on_write():
    paged, flat = pair(max_batch=4)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 37, 2, 32, generator=g).half()
    paged.release([1, 2, 3])
    flat.release([1, 2, 3])
    for layer in range(2):
        paged.prefill(layer, k, k, [37], rows=[0])
        flat.prefill(layer, k, k, [37], rows=[0])
    paged.fork(0, [2, 3])
    flat.admit([2, 3])
    for layer in range(2):  # the contiguous mirror of a fork: copied rows
        for dst in (2, 3):
            flat.k_caches[layer][dst] = flat.k_caches[layer][0]
            flat.v_caches[layer][dst] = flat.v_caches[layer][0]
    flat.rows.set_lengths([2, 3], [37, 37])
    shared = paged.pool.rows[0][:2]
    assert all(paged.pool.refs[b] == 3 for b in shared)
    for _ in range(30):  # every row gets its own tokens: the shared prefix stays as it was
        qkv = torch.zeros(4, 8 * 32).half()
        qkv[[0, 2, 3]] = torch.randn(3, 8 * 32, generator=g).half()
        for layer in range(2):
            a, b = paged.step(layer, qkv), flat.step(layer, qkv)
            assert torch.equal(a[[0, 2, 3]], b[[0, 2, 3]])
        paged.advance()
        flat.advance()
    rows_equal(paged, flat, [0, 2, 3])
    paged.pool.check()
    with pytest.raises(ValueError, match="dst_rows must be free"):
        paged.fork(0, [2])
    with pytest.raises(ValueError, match="src_row must be an active row"):
        paged.fork(1, [1])


def test_rejected_calls_change_nothing():
    paged, _ = pair(num_blocks=5, max_batch=4, s_max=64)  # 4 rows hold a block each: 1 free
    k = torch.randn(1, 40, 2, 32).half()
    before = (list(map(list, paged.pool.rows)), paged.host_lengths, paged.k_caches[0].clone())
    with pytest.raises(paging.PoolExhausted, match="prefill"):
        paged.prefill(0, k, k, [40], rows=[1])  # needs 3 blocks, 2 available
    assert (list(map(list, paged.pool.rows)), paged.host_lengths) == before[:2]
    assert torch.equal(paged.k_caches[0].view(torch.uint8), before[2].view(torch.uint8))
    paged.prefill(0, k[:, :20], k[:, :20], [20], rows=[1])  # takes the last free block
    for _ in range(11):
        paged.advance()  # row 1 reaches 31; rows 0, 2, 3 reach 11
    with pytest.raises(paging.PoolExhausted, match="advance"):
        paged.advance()  # row 1's slot 32 needs a third block
    assert paged.host_lengths == [11, 31, 11, 11]
    paged.release([3])
    paged.advance()
    assert paged.host_lengths == [12, 32, 12, 0] and len(paged.pool.rows[1]) == 3
    paged.pool.check()


# ------------------------------------------------------------------ fuzz
@pytest.mark.parametrize("seed", range(6))
def test_fuzz_allocator_operations_against_a_contiguous_mirror(seed):
    """Random admit / prefill / step / fork / release on a small pool: after every operation the
    pool's invariants hold (no block leaked, counts match the tables), a block is shared only by
    rows descended from one fork, and every active row reads exactly the tokens the contiguous
    mirror holds (nothing a row still reads was overwritten). Rejected operations change nothing."""
    rng = random.Random(seed)
    bs = rng.choice([16, 32])
    paged, flat = pair(block_size=bs, num_blocks=rng.randint(6, 12), max_batch=4, s_max=96)
    paged.release(range(4))
    flat.release(range(4))
    family = {}  # row -> fork family id (rows of one family may share blocks)
    next_family = 0
    g = torch.Generator().manual_seed(seed)
    for _ in range(60):
        op = rng.choice(["admit", "prefill", "step", "step", "fork", "release"])
        active, free = paged.active_rows, paged.free_rows
        snapshot = (list(map(list, paged.pool.rows)), paged.host_lengths)
        try:
            if op == "admit" and free:
                rows = rng.sample(free, rng.randint(1, len(free)))
                paged.admit(rows)
                flat.admit(rows)
                for r in rows:
                    family[r] = next_family
                    next_family += 1
            elif op == "prefill" and free:
                r = rng.choice(free)
                n = rng.randint(0, 80)
                k = torch.randn(1, max(n, 1), 2, 32, generator=g).half()
                for layer in range(2):
                    paged.prefill(layer, k, k, [n], rows=[r])
                for layer in range(2):
                    flat.prefill(layer, k, k, [n], rows=[r])
                family[r] = next_family
                next_family += 1
            elif op == "step" and active:
                batch = max(active) + 1
                qkv = torch.randn(batch, 8 * 32, generator=g).half()
                for layer in range(2):
                    a, b = paged.step(layer, qkv), flat.step(layer, qkv)
                    assert torch.equal(a[active], b[active])
                paged.advance()
                flat.advance()
            elif op == "fork" and active and free:
                src = rng.choice(active)
                dsts = rng.sample(free, rng.randint(1, len(free)))
                paged.fork(src, dsts)
                flat.admit(dsts)
                for layer in range(2):
                    for d in dsts:
                        flat.k_caches[layer][d] = flat.k_caches[layer][src]
                        flat.v_caches[layer][d] = flat.v_caches[layer][src]
                flat.rows.set_lengths(dsts, [flat.host_lengths[src]] * len(dsts))
                for d in dsts:
                    family[d] = family[src]
            elif op == "release" and active:
                rows = rng.sample(active, rng.randint(1, len(active)))
                paged.release(rows)
                flat.release(rows)
        except (paging.PoolExhausted, ValueError) as exc:
            assert isinstance(exc, paging.PoolExhausted) or "max_seq_len" in str(exc) or "full" in str(exc), (
                exc
            )
            assert (list(map(list, paged.pool.rows)), paged.host_lengths) == snapshot, f"{op} changed state"
            if op == "step":  # the step ran on both; only advance was refused
                pass
        paged.pool.check()
        assert paged.host_lengths == flat.host_lengths
        owners = {}
        for r in paged.active_rows:
            for blk in paged.pool.rows[r]:
                owners.setdefault(blk, set()).add(family[r])
        assert all(len(f) == 1 for f in owners.values()), "a block shared across rows that never forked"
        rows_equal(paged, flat, paged.active_rows)


def fork_and_release(paged: KVCache, flat: KVCache, k: torch.Tensor, lengths: list[int]) -> None:
    """Rows 0-2 prefilled with k (as k and v) at lengths, row 3 a fork of row 0 (the contiguous
    cache: a copy), row 1 released."""
    for c in (paged, flat):
        c.release(range(4))
        for layer in range(c.num_layers):
            c.prefill(layer, k, k, lengths, rows=[0, 1, 2])
    paged.fork(0, [3])
    flat.admit([3])
    for layer in range(flat.num_layers):
        flat.k_caches[layer][3] = flat.k_caches[layer][0]
        flat.v_caches[layer][3] = flat.v_caches[layer][0]
        for t in flat.storage.scales_view(layer, flat.max_batch).values():  # int8's token scales
            t[3] = t[0]
    flat.rows.set_lengths([3], [lengths[0]])
    for c in (paged, flat):
        c.release([1])


def tree_rounds(paged: KVCache, flat: KVCache, rounds: int, nodes: int, seed: int, tensor_paths=(1,)):
    """Tree steps and accept on both caches (rows' paths at random through random trees; round r
    passes the paths as a tensor when r is in tensor_paths): outputs equal, the kept K/V equal."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b = paged.max_batch
    dev = paged.device
    wide = (paged.num_heads + 2 * paged.num_kv_heads) * paged.head_dim
    for rnd in range(rounds):
        parents = torch.tensor(
            [[-1] + [rng.randrange(-1, i) for i in range(1, nodes)] for _ in range(b)], dtype=torch.int32
        ).to(dev)
        qkv = torch.randn(b, nodes, wide, generator=g).to(paged.dtype).to(dev)
        for layer in range(paged.num_layers):
            a, c = paged.step_tree(layer, qkv, parents), flat.step_tree(layer, qkv, parents)
            live = paged.active_rows
            assert torch.equal(a[live].view(torch.uint8), c[live].view(torch.uint8)), f"round {rnd}"
        paths = []
        for r in range(b):  # a root-first path of this row's tree (possibly empty)
            host = parents[r].tolist()
            node = rng.randrange(-1, nodes)
            path = []
            while node >= 0:
                path.append(node)
                node = host[node]
            paths.append(path[::-1])
        rows = paged.active_rows
        chosen = [paths[r] for r in rows]
        if rnd in tensor_paths:
            width = max(1, max(len(p) for p in chosen))
            t = torch.tensor([p + [-1] * (width - len(p)) for p in chosen], dtype=torch.int64).to(dev)
            paged.accept(rows, t)
            flat.accept(rows, t)
        else:
            paged.accept(rows, chosen)
            flat.accept(rows, chosen)
        assert paged.host_lengths == flat.host_lengths
        paged.pool.check()
    rows_equal(paged, flat, paged.active_rows)


@pytest.mark.parametrize("kv_dtype", [None, FP8, torch.int8], ids=["16-bit", "fp8", "int8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kvcache_paged_tree_steps_and_accept_equal_contiguous(kv_dtype, block_size):
    """Tree steps over pages (the nodes' blocks taken before the step), accept through the tables
    (host and tensor paths), a forked row sharing its prefix blocks and a released row: outputs
    and kept tokens equal a contiguous cache's."""
    paged, flat = pair(kv_dtype, block_size=block_size, s_max=140)
    g = torch.Generator().manual_seed(block_size)
    fork_and_release(paged, flat, torch.randn(3, 40, 2, 32, generator=g).half(), [40, 15, 16])
    tree_rounds(paged, flat, 4, 7, seed=block_size)


def test_paged_tree_step_takes_blocks_all_or_nothing():
    paged, _ = pair(block_size=16, num_blocks=5, max_batch=2, s_max=64)
    k = torch.randn(2, 15, 2, 32).half()
    for layer in range(2):
        paged.prefill(layer, k, k, [15, 15])
    parents = torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6]] * 2, dtype=torch.int32)
    qkv = torch.randn(2, 8, 8 * 32).half()
    paged.step_tree(0, qkv, parents)  # slots 15..22: one more block per row (4 of 5 taken)
    assert paged.pool.free_blocks == 1
    before = (paged.pool.tables.clone(), paged.k_caches[0].clone())
    big = torch.tensor([[-1] + list(range(19))] * 2, dtype=torch.int32)
    with pytest.raises(paging.PoolExhausted):  # slots 15..34 need 3 blocks per row: 2 more free needed
        paged.step_tree(0, torch.randn(2, 20, 8 * 32).half(), big)
    assert torch.equal(paged.pool.tables, before[0])
    unused_bits = (paged.k_caches[0].view(torch.uint8), before[1].view(torch.uint8))  # NaN != NaN
    assert torch.equal(*unused_bits)
    paged.pool.check()
