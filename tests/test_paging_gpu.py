"""Paged caches on the GPU: the kernel reading pages through block tables against the same step on
a contiguous cache (bit for bit: same plan, same arithmetic) and against mmha.reference, every
block size, dtype (fp8 included) and head dim, single pass and split, random non-monotonic tables
with NaN in every unused slot and block; the device guard on block ids; rows that take no part;
KVCache with fork, release / admit (continuous batching) and CUDA graphs; generation."""

from __future__ import annotations

import pytest
import torch
from fp8_cases import fp8_case
from helpers import FLOOR, gpu, make_case
from test_paging import fork_and_release, rows_equal, tree_rounds

from mmha import layout, ops, paging, reference
from mmha.cache import KVCache

pytestmark = gpu

FP8 = torch.float8_e4m3fn


def to_pages(k_cache, v_cache, block_size, seed, spare=3):
    """A contiguous cache's rows as pages of a pool at random (non-monotonic) blocks; the pool's
    other blocks hold NaN (never read)."""
    b, hkv, dx, s, x = k_cache.shape
    d = v_cache.shape[-1]
    max_blocks = s // block_size
    nb = b * max_blocks + spare
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(nb, generator=g)[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    kp = torch.full((nb, hkv, dx, block_size, x), float("nan"), device="cuda").to(k_cache.dtype)
    vp = torch.full((nb, hkv, block_size, d), float("nan"), device="cuda").to(v_cache.dtype)
    for row in range(b):
        for j in range(max_blocks):
            blk = int(tables[row, j])
            kp[blk] = k_cache[row, :, :, j * block_size : (j + 1) * block_size]
            vp[blk] = v_cache[row, :, j * block_size : (j + 1) * block_size]
    return kp, vp, tables.cuda()


def gathered(kp, vp, tables):
    """The pools read back as contiguous caches (one row per table row)."""
    ks = [layout.gather_k(kp, t.tolist()) for t in tables.cpu()]
    vs = [layout.gather_v(vp, t.tolist()) for t in tables.cpu()]
    return torch.cat(ks), torch.cat(vs)


def bits(t):
    return t.contiguous().view(torch.uint8)


def run_both(case, block_size, splits, seed=0, scales=None, source="auto", **kw):
    """The step on the contiguous caches (cp.async tiles) and on their pages (tiles from
    `source`): outputs, lse and the caches afterwards (pages gathered back)."""
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, block_size, seed)
    extra = dict(k_scale=scales[0], v_scale=scales[1]) if scales else {}
    common = dict(num_splits=splits, stages=2, return_lse=True, **case.kwargs(), **extra, **kw)
    kc, vc = case.clone_caches()
    flat = ops.decode_attention(case.qkv, kc, vc, case.lengths, tile_source="cp_async", **common)
    paged = ops.decode_attention(
        case.qkv, kp, vp, case.lengths, block_tables=tables, tile_source=source, **common
    )
    torch.cuda.synchronize()
    gk, gv = gathered(kp, vp, tables)
    return flat, paged, (kc, vc), (gk, gv)


def assert_same_step(case, flat, paged, caches, pages):
    assert torch.equal(bits(flat[0]), bits(paged[0])) and torch.equal(flat[1], paged[1])
    for row, n in enumerate(case.lengths.tolist()):  # slots 0..n: the cache and the new token
        assert torch.equal(bits(caches[0][row, :, :, : n + 1]), bits(pages[0][row, :, :, : n + 1]))
        assert torch.equal(bits(caches[1][row, :, : n + 1]), bits(pages[1][row, :, : n + 1]))


@pytest.mark.parametrize("block_size", paging.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_pages_equal_contiguous_bit_for_bit(block_size, dtype, splits, source):
    # Rows whose new token sits at a block's first and last slot, one empty, one full.
    if dtype == torch.float32 and source == "tma":
        pytest.skip("fp32 caches run the CUDA-core loop")
    lengths = [0, block_size - 1, block_size, 3 * block_size + 5, 383, 511]
    case = make_case(len(lengths), 8, 2, 128, lengths, 512, dtype, seed=block_size + splits, rotary_dim=64)
    assert_same_step(case, *run_both(case, block_size, splits, seed=splits, source=source))


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_every_head_dim(head_dim, dtype):
    lengths = [3, 100, 255]
    case = make_case(3, 4, 2, head_dim, lengths, 256, dtype, seed=head_dim, bias=True)
    assert_same_step(case, *run_both(case, 32, 2, seed=head_dim))


@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_pages(block_size, head_dim, splits):
    lengths = [0, 17, 200, 511]
    case, ks, vs = fp8_case(
        len(lengths), 8, 2, head_dim, lengths, 512, torch.float16, seed=head_dim + block_size
    )
    for source in ("cp_async", "auto"):
        flat, paged, caches, pages = run_both(case, block_size, splits, block_size, (ks, vs), source)
        assert_same_step(case, flat, paged, caches, pages)


@pytest.mark.parametrize("heads", [(8, 8), (8, 1), (32, 8), (12, 4)], ids=str)
def test_groups_and_reference(heads):
    hq, hkv = heads
    lengths = [1, 250, 1000]
    case = make_case(3, hq, hkv, 128, lengths, 1024, torch.float16, seed=hq + hkv, rotary_dim=128)
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 16, seed=7)
    ref_out, ref_lse = reference.decode_step_paged(
        case.qkv.float(), kp.float(), vp.float(), tables, case.lengths, return_lse=True, **case.kwargs()
    )
    for splits in (1, 5):
        kp2, vp2 = kp.clone(), vp.clone()
        out, lse = ops.decode_attention(
            case.qkv, kp2, vp2, case.lengths, block_tables=tables, num_splits=splits, return_lse=True,
            **case.kwargs(),
        )  # fmt: skip
        err = (out.float() - ref_out).abs().max().item()
        assert err <= FLOOR[torch.float16] * ref_out.abs().max().item() * 4, err
        assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)


def test_windows_read_only_their_blocks():
    """A sliding window's row reads only blocks from the window's start on: entries before it
    may name no block at all (a server that freed them)."""
    lengths = [40, 300, 700]
    case = make_case(3, 8, 2, 128, lengths, 768, torch.float16, seed=3)
    case.mods = dict(window=100)
    flat, paged, caches, pages = run_both(case, 16, 3, seed=3)
    assert_same_step(case, flat, paged, caches, pages)
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 16, seed=3)
    for row, n in enumerate(lengths):
        tables[row, : max(0, n - 99) // 16] = paging.NO_BLOCK  # blocks wholly before the window
    ws = ops.Workspace.allocate("cuda", 3, 8, 128, 3)
    out, lse = ops.decode_attention(
        case.qkv, kp, vp, case.lengths, block_tables=tables, num_splits=3, stages=2, return_lse=True,
        workspace=ws, validate_lengths=False, **case.kwargs(),
    )  # fmt: skip
    assert torch.equal(bits(out), bits(paged[0]))
    ws.check()


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("where", ["append_slot", "first_block", "middle", "past_pool"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("source", ["cp_async", "auto"])
def test_bad_block_refuses_the_row_and_writes_nothing(splits, where, dtype, source):
    lengths = [100, 500, 333, 0]
    case = make_case(4, 8, 2, 128, lengths, 512, dtype, seed=11)
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 32, seed=11)
    good_out, good_lse = ops.decode_attention(
        case.qkv, kp.clone(), vp.clone(), case.lengths, block_tables=tables, num_splits=splits, stages=2,
        return_lse=True, **case.kwargs(),
    )  # fmt: skip
    bad_row, n = 1, lengths[1]
    entry = {"append_slot": n // 32, "first_block": 0, "middle": n // 64, "past_pool": n // 32 - 1}[where]
    tables[bad_row, entry] = kp.shape[0] if where == "past_pool" else paging.NO_BLOCK
    before = (bits(kp).clone(), bits(vp).clone())
    ws = ops.Workspace.allocate("cuda", 4, 8, 128, splits)
    out, lse = ops.decode_attention(
        case.qkv, kp, vp, case.lengths, block_tables=tables, num_splits=splits, stages=2, return_lse=True,
        workspace=ws, validate_lengths=False, tile_source=source, **case.kwargs(),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert out[bad_row].isnan().all() and lse[bad_row].isnan().all()
    others = [0, 2, 3]
    assert torch.equal(bits(out[others]), bits(good_out[others])) and torch.equal(
        lse[others], good_lse[others]
    )
    # Only the other rows' new tokens were written.
    changed_k = (bits(kp) != before[0]).nonzero()[:, 0].unique().tolist()
    good_blocks = {int(tables[r, lengths[r] // 32]) for r in others}
    assert set(changed_k) <= good_blocks
    with pytest.raises(ops.PageError, match=r"rows \[1\]"):
        ws.check()
    with pytest.raises(ValueError, match=r"block_tables\[1, "):  # validated: refused on the host
        ops.decode_attention(case.qkv, kp, vp, case.lengths, block_tables=tables, num_heads=8, num_kv_heads=2)


@pytest.mark.parametrize(
    "shape",
    [
        # 512 items on a grid of fewer blocks: blocks take several appending splits in turn
        dict(lengths=[300 + 25 * r for r in range(16)], s_max=768, heads=(16, 8), bad={3: 1, 7: 0, 12: 5}),
        # one row of 512 entries: the earlier splits' blocks span several batches of loads
        dict(lengths=[8000, 777], s_max=8192, heads=(8, 2), bad={0: 300}),
    ],
    ids=["many_items", "long_row"],
)
def test_bad_block_before_the_appending_split(shape):
    """The appending split reads none of the row's earlier blocks, yet a bad one among them
    refuses the row: NaN output, flagged, nothing appended; every other row as without it."""
    lengths, (hq, hkv) = shape["lengths"], shape["heads"]
    b = len(lengths)
    case = make_case(b, hq, hkv, 128, lengths, shape["s_max"], torch.float16, seed=5)
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 16, seed=5)
    good_out = ops.decode_attention(
        case.qkv, kp.clone(), vp.clone(), case.lengths, block_tables=tables, num_splits=4, stages=2,
        **case.kwargs(),
    )  # fmt: skip
    for row, entry in shape["bad"].items():
        assert (entry + 1) * 16 <= lengths[row] * 3 // 4 - 64  # before the appending (last) split's keys
        tables[row, entry] = paging.NO_BLOCK
    before = bits(kp).clone()
    ws = ops.Workspace.allocate("cuda", b, hq, 128, 4)
    out = ops.decode_attention(
        case.qkv, kp, vp, case.lengths, block_tables=tables, num_splits=4, stages=2, workspace=ws,
        validate_lengths=False, **case.kwargs(),
    )  # fmt: skip
    torch.cuda.synchronize()
    bad = sorted(shape["bad"])
    others = [r for r in range(b) if r not in shape["bad"]]
    assert out[bad].isnan().all()
    assert torch.equal(bits(out[others]), bits(good_out[others]))
    changed = set((bits(kp) != before).nonzero()[:, 0].unique().tolist())
    assert changed == {int(tables[r, lengths[r] // 16]) for r in others}
    with pytest.raises(ops.PageError, match=rf"rows \[{', '.join(map(str, bad))}\]"):
        ws.check()


def test_rows_that_take_no_part():
    lengths = [10, 200, 64]
    case = make_case(3, 8, 2, 128, lengths, 256, torch.float16, seed=2)
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 16, seed=2)
    tables[1] = paging.NO_BLOCK  # a released row owns no blocks
    active = torch.tensor([1, 0, 1], dtype=torch.int32, device="cuda")
    before = (bits(kp).clone(), bits(vp).clone())
    for splits in (1, 3):
        out, lse = ops.decode_attention(
            case.qkv, kp, vp, case.lengths, block_tables=tables, row_active=active, num_splits=splits,
            return_lse=True, **case.kwargs(),
        )  # fmt: skip
        assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
        assert out[[0, 2]].isfinite().all()
    changed = (bits(kp) != before[0]).nonzero()[:, 0].unique().tolist()
    assert set(changed) <= {int(tables[0, 0]), int(tables[2, 4])}


def test_arguments_checked():
    case = make_case(2, 8, 2, 128, [5, 9], 256, torch.float16)
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 64, seed=0)
    kw = dict(num_heads=8, num_kv_heads=2)
    with pytest.raises(RuntimeError, match="block_tables must have dtype Int"):
        ops.decode_attention(case.qkv, kp, vp, case.lengths, block_tables=tables.long(), **kw)
    with pytest.raises((RuntimeError, ValueError), match="row_active must have shape"):
        ops.decode_attention(
            case.qkv, kp, vp, case.lengths, block_tables=tables, row_active=tables[0], **kw
        )  # fmt: skip
    kp48 = torch.zeros(kp.shape[0], 2, 16, 48, 8, dtype=kp.dtype, device="cuda")
    vp48 = torch.zeros(kp.shape[0], 2, 48, 128, dtype=kp.dtype, device="cuda")
    with pytest.raises(RuntimeError, match="block size of 16, 32, 64 or 128"):
        ops.decode_attention(case.qkv, kp48, vp48, case.lengths, block_tables=tables, **kw)


# ------------------------------------------------------------------ KVCache
def cache_pair(kv_dtype=None, block_size=16, max_batch=4, s_max=300, num_blocks=None, **kw):
    args = (2, max_batch, s_max, 8, 2, 64, torch.float16, "cuda")
    opts = dict(rotary_dim=64, kv_dtype=kv_dtype, **kw)
    paged = KVCache(*args, paged=True, block_size=block_size, num_blocks=num_blocks, **opts)
    flat = KVCache(*args, **opts)
    return paged, flat


def width():
    return (8 + 2 * 2) * 64


@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("block_size", [16, 128])
def test_kvcache_steps_fork_and_continuous_batching(kv_dtype, block_size):
    """Steps, fork (shared prefix blocks), release and admit while other rows decode: the paged
    cache's outputs and tokens equal a contiguous cache's that mirrors every operation."""
    paged, flat = cache_pair(kv_dtype, block_size)
    g = torch.Generator().manual_seed(block_size)
    k = torch.randn(4, 90, 2, 64, generator=g).half().cuda()
    v = torch.randn(4, 90, 2, 64, generator=g).half().cuda()
    for c in (paged, flat):
        c.release(range(4))
        for layer in range(2):
            c.prefill(layer, k[:2], v[:2], [90, 37], rows=[0, 1])
    paged.fork(0, [2])
    flat.admit([2])
    for layer in range(2):
        flat.k_caches[layer][2] = flat.k_caches[layer][0]
        flat.v_caches[layer][2] = flat.v_caches[layer][0]
    flat.rows.set_lengths([2], [90])
    for step in range(40):
        qkv = torch.randn(4, width(), generator=g).half().cuda()
        for layer in range(2):
            a, b = paged.step(layer, qkv), flat.step(layer, qkv)
            live = paged.active_rows
            assert torch.equal(bits(a[live]), bits(b[live]))
            assert (a[paged.free_rows] == 0).all()
        paged.advance()
        flat.advance()
        if step == 15:  # row 1 leaves, row 3 arrives: continuous batching
            for c in (paged, flat):
                c.release([1])
                c.admit([3])
                for layer in range(2):
                    c.prefill(layer, k[3:4], v[3:4], [61], rows=[3], scales="keep")
        paged.check()
    paged.pool.check()
    rows_equal(paged, flat, paged.active_rows)


def test_kvcache_graph_replays_across_block_allocations():
    """A captured paged step reads the tables in place: replays that cross block boundaries (new
    blocks allocated between replays) equal eager steps on a twin cache."""
    paged, twin = cache_pair(block_size=16, dispatch_on="capacity")
    g = torch.Generator().manual_seed(5)
    k = torch.randn(4, 30, 2, 64, generator=g).half().cuda()
    for c in (paged, twin):
        for layer in range(2):
            c.prefill(layer, k, k, [30, 1, 15, 16])
    paged.reserve_workspace([4])
    static = torch.zeros(4, width(), dtype=torch.float16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        paged.step(0, static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [paged.step(layer, static) for layer in range(2)]
        paged.advance()
    for _ in range(40):
        qkv = torch.randn(4, width(), generator=g).half().cuda()
        static.copy_(qkv)
        graph.replay()
        paged.account_replay()
        ref = [twin.step(layer, qkv) for layer in range(2)]
        twin.advance()
        for a, b in zip(outs, ref, strict=True):
            assert torch.equal(bits(a), bits(b))
    paged.check()
    paged.pool.check()
    rows_equal(paged, twin, range(4))


def test_generate_paged_equals_contiguous():
    from mmha.models.generate import Request, generate
    from mmha.models.llama import PRESETS, TinyLlama

    model = TinyLlama(PRESETS["tiny"], seed=0).to("cuda", torch.float32).eval()
    prompts = [[1 + (i * 7 + j) % 50 for j in range(n)] for i, n in enumerate([5, 40, 17, 23, 9, 31])]
    outs = []
    for paged in (False, True):
        reqs = [Request(list(p), 12 + 5 * (i % 3)) for i, p in enumerate(prompts)]
        generate(model, reqs, 3, 96, paged=paged, block_size=16)  # 6 requests through 3 rows
        outs.append([r.output for r in reqs])
    assert outs[0] == outs[1]


# ------------------------------------------------------------------ tree steps
def tree_both(case, qkv, parents, counts, scales, block_size, splits, source, seed=0):
    """A tree step on the contiguous caches (cp.async tiles) and on their pages (`source`)."""
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, block_size, seed)
    common = dict(
        node_counts=torch.tensor(counts, dtype=torch.int32, device="cuda"), num_splits=splits, stages=2,
        return_lse=True, **case.kwargs(), **scales,
    )  # fmt: skip
    kc, vc = case.clone_caches()
    flat = ops.decode_tree(qkv, kc, vc, case.lengths, parents, tile_source="cp_async", **common)
    paged = ops.decode_tree(
        qkv, kp, vp, case.lengths, parents, block_tables=tables, tile_source=source, **common
    )
    torch.cuda.synchronize()
    gk, gv = gathered(kp, vp, tables)
    assert torch.equal(bits(flat[0]), bits(paged[0])) and torch.equal(flat[1], paged[1])
    for row, n in enumerate(case.lengths.tolist()):  # the cache and every node's slot
        last = n + counts[row]
        assert torch.equal(bits(kc[row, :, :, :last]), bits(gk[row, :, :, :last]))
        assert torch.equal(bits(vc[row, :, :last]), bits(gv[row, :, :last]))
    return kp, vp, tables


@pytest.mark.parametrize("block_size", paging.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, FP8], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_tree_pages_equal_contiguous_bit_for_bit(block_size, dtype, splits, source):
    from test_tree_gpu import tree_case

    if dtype == torch.float32 and source == "tma":
        pytest.skip("fp32 caches run the CUDA-core loop")
    kv = dtype if dtype == FP8 else None
    act = torch.float16 if dtype == FP8 else dtype
    lengths = [0, block_size - 3, 3 * block_size + 5, 383, 440]
    nodes = 9
    counts = [9, 4, 9, 1, 7]
    case, qkv, parents, counts, scales = tree_case(
        len(lengths), 8, 2, 128, lengths, 512, act, nodes, "random", seed=block_size + splits, counts=counts,
        kv_dtype=kv,
    )  # fmt: skip
    tree_both(case, qkv, parents, counts, scales, block_size, splits, source, seed=splits)


@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_tree_pages_head_dims(head_dim):
    from test_tree_gpu import tree_case

    lengths = [7, 100, 250]
    case, qkv, parents, counts, scales = tree_case(
        3, 8, 2, head_dim, lengths, 320, torch.bfloat16, 5, "random", seed=head_dim, bias=True
    )  # fmt: skip
    tree_both(case, qkv, parents, counts, scales, 16, 2, "auto", seed=head_dim)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("where", ["node_slot", "cached_block"])
def test_tree_bad_block_refuses_the_row_and_writes_nothing(splits, where):
    from test_tree_gpu import tree_case

    lengths = [100, 300, 33]
    case, qkv, parents, counts, scales = tree_case(
        3, 8, 2, 128, lengths, 512, torch.float16, 6, "random", seed=4
    )
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 32, seed=4)
    bad_row = 1
    entry = (lengths[1] + 5) // 32 if where == "node_slot" else 2  # a node's slot's block, or an early one
    tables[bad_row, entry] = paging.NO_BLOCK
    before = (bits(kp).clone(), bits(vp).clone())
    ws = ops.Workspace.allocate("cuda", 3, 8, 128, splits, 6)
    out = ops.decode_tree(
        qkv, kp, vp, case.lengths, parents, block_tables=tables, num_splits=splits, workspace=ws, validate=False,
        **case.kwargs(),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert out[bad_row].isnan().all() and out[[0, 2]].isfinite().all()
    changed = (bits(kp) != before[0]).nonzero()[:, 0].unique().tolist()
    good = {int(tables[r, s // 32]) for r in (0, 2) for s in range(lengths[r], lengths[r] + 6)}
    assert set(changed) <= good
    with pytest.raises(ops.PageError, match=r"rows \[1\]"):
        ws.check()
    with pytest.raises(ValueError, match=r"block_tables\[1, "):  # validated: refused on the host
        ops.decode_tree(qkv, kp, vp, case.lengths, parents, block_tables=tables, **case.kwargs())


@pytest.mark.parametrize("bad", ["first_split", "second_split"])
def test_tree_nodes_across_splits_bad_block_writes_nothing(bad):
    """A small tree (one launch) whose nodes lie in two splits' keys (slots 60 .. 65: tiles 0 and
    1, one split each): a bad block under either split's nodes refuses the row in both, and
    neither appends its nodes."""
    from test_tree_gpu import tree_case

    lengths = [60, 60]
    case, qkv, parents, counts, scales = tree_case(
        2, 8, 2, 128, lengths, 256, torch.float16, 6, "chain", seed=9
    )
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 16, seed=9)
    bad_row = 1
    tables[bad_row, 3 if bad == "first_split" else 4] = paging.NO_BLOCK  # slots 48 .. 63, or 64 .. 79
    before = (bits(kp).clone(), bits(vp).clone())
    ws = ops.Workspace.allocate("cuda", 2, 8, 128, 2, 6)
    out = ops.decode_tree(
        qkv, kp, vp, case.lengths, parents, block_tables=tables, num_splits=2, workspace=ws, validate=False,
        **case.kwargs(),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert out[bad_row].isnan().all() and out[0].isfinite().all()
    good = {int(tables[0, s // 16]) for s in range(60, 66)}
    for pool, old in ((kp, before[0]), (vp, before[1])):
        changed = (bits(pool) != old).nonzero()[:, 0].unique().tolist()
        assert set(changed) <= good
    assert ws.status.tolist() == [0, ops.STATUS_PAGES]


def test_tree_rows_that_take_no_part():
    from test_tree_gpu import tree_case

    case, qkv, parents, counts, scales = tree_case(3, 8, 2, 128, [10, 90, 64], 256, torch.float16, 4, "chain")
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 16, seed=2)
    tables[1] = paging.NO_BLOCK
    active = torch.tensor([1, 0, 1], dtype=torch.int32, device="cuda")
    ws = ops.Workspace.allocate("cuda", 3, 8, 128, 2, 4)
    out = ops.decode_tree(
        qkv, kp, vp, case.lengths, parents, block_tables=tables, row_active=active, num_splits=2, workspace=ws,
        **case.kwargs(),
    )  # fmt: skip
    assert (out[1] == 0).all() and out[[0, 2]].isfinite().all()
    ws.check()


@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("block_size", [16, 64])
def test_kvcache_tree_steps_and_accept_over_pages(kv_dtype, block_size):
    """The GPU twin of test_paging's scenario: tree steps over pages, accept through the tables
    (host and tensor paths), a forked row and a released one, against a contiguous cache."""
    paged, flat = cache_pair(kv_dtype, block_size, s_max=400)
    g = torch.Generator().manual_seed(block_size)
    fork_and_release(paged, flat, torch.randn(3, 120, 2, 64, generator=g).half().cuda(), [120, 15, 64])
    tree_rounds(paged, flat, 5, 12, seed=block_size, tensor_paths=(1, 3))
    paged.check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_speculative_demo_over_pages_is_lossless(dtype):
    from test_generate import random_prompts

    from mmha.models.generate import speculative_demo
    from mmha.models.llama import PRESETS, TinyLlama

    model = TinyLlama(PRESETS["tiny"], seed=1).to("cuda", dtype).eval()
    prompts = random_prompts(3, [3, 9, 6], model.cfg.vocab_size, seed=2)
    for shape in ([2, 2, 1], [4]):
        a = speculative_demo(model, prompts, 12, 1, shape, paged=True, block_size=16)
        if dtype == torch.float32:
            assert a["identical"], (shape, a)
        assert a["mean_accepted"] >= 1
