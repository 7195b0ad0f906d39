"""Small decode cases for compute-sanitizer (RELIABILITY.md rows 20 and 27): ragged and empty
rows, a row filled to capacity, NaN in unused slots, single pass and split/merge, both tile sources
and two stage counts of the tile loop (and 4: with fp8 caches a consumer takes two tiles per
update), the CUDA-core loop, and out-of-range lengths (past the capacity, negative) on every
variant; fp8 caches on both sources, split and not, with a bad scale; score modifiers (a window
whose first slot is mid-tile, soft-cap, ALiBi, sinks) on both sources and the CUDA-core loop,
split and not; paged caches (pools with no spare block, tables with entries past the rows' blocks
unset, a window, a released row, block ids outside the pool); the output epilogue (int8 and e4m3
outputs, per-channel tensors, refused rows); rotary tables by length (rows before, within and past
the table, out-of-range lengths); the q/k norm in the kernel (one-token and tree steps); int8
caches (both sources, pages, a non-finite new token, out-of-range lengths); int4 caches (head
dims, groups committed by the step, row modes, a window, a non-finite new token); the row norm (widths
from 1 to 5120, q/k segments in place): nothing may be read or written outside the caches and the
output. ``norms`` as the argument runs the row norm's cases alone (the suite's
second pass, filtered to that kernel), ``qk_norm`` the kernel's q/k norm cases alone, ``int8`` the
int8 caches' cases alone, ``int4`` the int4 caches'."""

import sys

import torch
from fp8_cases import fp8_case
from helpers import make_case

from mmha import ops, spec


def run(case, heads, head_dim, splits, source, stages, validate=True, workspace=None, scales=(None, None)):
    return ops.decode_attention(
        case.qkv, case.k_cache, case.v_cache, case.lengths, num_splits=splits, stages=stages,
        tile_source=source, validate_lengths=validate, workspace=workspace, k_scale=scales[0],
        v_scale=scales[1], **case.kwargs(),
    )  # fmt: skip


def fp8_cases() -> None:
    from fp8_cases import fp8_case

    lengths = [0, 1, 17, 127, 255]
    for dtype, head_dim, heads, sources in (
        (torch.float16, 128, (8, 2), ("tma", "cp_async")),
        (torch.bfloat16, 80, (4, 4), ("auto",)),
    ):
        for splits in (1, 5):
            for source in sources:
                case, ks, vs = fp8_case(5, *heads, head_dim, lengths, 256, dtype, seed=splits, bias=True,
                                        rotary_dim=head_dim // 2)  # fmt: skip
                for stages in (2, 4):  # 4: two tiles per consumer update
                    out = run(case, heads, head_dim, splits, source, stages, scales=(ks, vs))
                    assert torch.isfinite(out).all()
        case, ks, vs = fp8_case(5, *heads, head_dim, lengths, 256, dtype, seed=3)
        ks[0] = float("nan")
        ws = ops.Workspace.allocate("cuda", 5, heads[0], head_dim, 3)
        out = run(case, heads, head_dim, 3, "auto", 2, workspace=ws, scales=(ks, vs))
        torch.cuda.synchronize()
        assert ws.status.tolist() == [2] * 5 and torch.isnan(out).all()


def mods_cases() -> None:

    lengths = [0, 1, 17, 127, 255]
    for dtype, head_dim, sources in (
        (torch.float16, 128, ("tma", "cp_async")),
        (torch.float32, 64, ("auto",)),
    ):
        for splits in (1, 5):
            for source in sources:
                case = make_case(5, 8, 2, head_dim, lengths, 256, dtype, seed=splits, bias=True)
                case.mods = dict(window=70, softcap=10.0, alibi_slopes=spec.alibi_slopes(8).cuda(),
                                 sinks=torch.linspace(-2, 2, 8, device="cuda"))  # fmt: skip
                out = run(case, 8, head_dim, splits, source, 2)
                assert torch.isfinite(out).all()


def epilogue_cases() -> None:
    from mmha.epilogue import OutEpilogue

    lengths = [0, 1, 17, 127, 255]
    c = 8 * 64
    shift, smooth = torch.linspace(-1, 1, c, device="cuda"), torch.linspace(0.5, 2, c, device="cuda")
    for dtype, head_dim in ((torch.float16, 64), (torch.float32, 64)):
        for e in (
            OutEpilogue(shift, smooth, 30.0, rounding="half_away", min_bound=-128),
            OutEpilogue(scale=torch.linspace(1, 50, c, device="cuda"), dtype=torch.float8_e4m3fn),
            OutEpilogue(shift, smooth),
        ):
            for splits in (1, 5):
                case = make_case(5, 8, 2, head_dim, lengths, 256, dtype, seed=splits)
                out = ops.decode_attention(
                    case.qkv, case.k_cache, case.v_cache, case.lengths, num_splits=splits,
                    **case.kwargs(epilogue=e),
                )  # fmt: skip
                assert out.dtype == e.out_dtype(dtype)
        case = make_case(5, 8, 2, head_dim, lengths, 256, dtype, seed=9)
        case.lengths[0] = 256  # refused: int8 0
        ws = ops.Workspace.allocate("cuda", 5, 8, head_dim, 3)
        out = ops.decode_attention(
            case.qkv, case.k_cache, case.v_cache, case.lengths, num_splits=3, workspace=ws,
            validate_lengths=False, **case.kwargs(epilogue=OutEpilogue(scale=9.0)),
        )  # fmt: skip
        torch.cuda.synchronize()
        assert ws.status.tolist() == [1, 0, 0, 0, 0] and (out[0] == 0).all()


def tree_cases() -> None:
    """Tree steps: both tile sources, single pass and split, narrow (9 nodes) and wide (33 nodes:
    132 columns per kv head) items, a refused tree and an overflowing row."""
    for dtype, head_dim, sources, nodes in (
        (torch.float16, 128, ("tma", "cp_async"), 9),
        (torch.float16, 128, ("tma", "cp_async"), 33),
        (torch.float32, 64, ("auto",), 9),
    ):
        lengths = [0, 1, 17, 127, 256 - nodes]
        for splits in (1, 5):
            for source in sources:
                case = make_case(
                    5, 8, 2, head_dim, lengths, 256, dtype, seed=splits, bias=True, rotary_dim=head_dim
                )
                qkv = torch.randn(5, nodes, case.qkv.shape[1], device="cuda").to(dtype)
                parents = torch.tensor(
                    [[-1] + [(t - 1) // 2 for t in range(1, nodes)]] * 5, dtype=torch.int32
                ).cuda()
                counts = torch.tensor([nodes, 3, nodes, 1, nodes], dtype=torch.int32, device="cuda")
                kc, vc = case.clone_caches()
                out = ops.decode_tree(qkv, kc, vc, case.lengths, parents, node_counts=counts, num_splits=splits,
                                      stages=2, tile_source=source, **case.kwargs())  # fmt: skip
                assert torch.isfinite(out).all()
                parents[1, 2] = 5  # a later node: refused on the device
                case.lengths[4] = 250  # 250 + nodes > 256
                ws = ops.Workspace.allocate("cuda", 5, 8, head_dim, splits, nodes)
                out = ops.decode_tree(qkv, kc, vc, case.lengths, parents, num_splits=splits, stages=2,
                                      tile_source=source, workspace=ws, validate=False, **case.kwargs())  # fmt: skip
                torch.cuda.synchronize()
                assert ws.status.tolist() == [0, 4, 0, 0, 1], ws.status.tolist()
                assert torch.isnan(out[[1, 4]]).all() and torch.isfinite(out[[0, 2, 3]]).all()


def paged_cases() -> None:
    """Paged caches: the pool holds exactly the rows' blocks (a read past them leaves it), tables
    end in -1, one row is released (row_active 0, no blocks), one has a block id outside the pool."""
    for dtype, head_dim, kv in (
        (torch.float16, 128, None),
        (torch.float16, 128, "fp8"),
        (torch.float32, 64, None),
    ):
        bs, lengths = 16, [0, 17, 100, 31, 63]
        scales = (None, None)
        if kv == "fp8":
            case, *scales = fp8_case(
                5, 8, 2, head_dim, lengths, 128, dtype, seed=3, bias=True, rotary_dim=head_dim
            )
        else:
            case = make_case(5, 8, 2, head_dim, lengths, 128, dtype, seed=3, bias=True, rotary_dim=head_dim)
        need = [n // bs + 1 for n in lengths]
        ids = torch.randperm(sum(need)).tolist()
        tables = torch.full((5, 8), -1, dtype=torch.int32)
        kp = torch.empty(
            (sum(need), *case.k_cache.shape[1:3], bs, case.k_cache.shape[4]), dtype=case.k_cache.dtype
        )
        vp = torch.empty((sum(need), case.v_cache.shape[1], bs, head_dim), dtype=case.v_cache.dtype)
        kp, vp = kp.cuda(), vp.cuda()
        for r, n in enumerate(need):
            for j in range(n):
                blk = ids.pop()
                tables[r, j] = blk
                kp[blk] = case.k_cache[r, :, :, j * bs : (j + 1) * bs]
                vp[blk] = case.v_cache[r, :, j * bs : (j + 1) * bs]
        tables = tables.cuda()
        active = torch.tensor([1, 1, 1, 0, 1], dtype=torch.int32, device="cuda")
        kw = dict(tile_source="auto", stages=2, k_scale=scales[0], v_scale=scales[1])
        for splits in (1, 5):
            for window in (None, 40):
                out = ops.decode_attention(case.qkv, kp, vp, case.lengths, num_splits=splits, block_tables=tables,
                                           row_active=active, **kw, **case.kwargs(window=window))  # fmt: skip
                assert torch.isfinite(out).all() and (out[3] == 0).all()
            bad = tables.clone()
            bad[2, 3] = sum(need)  # outside the pool
            bad[4, 0] = -1
            ws = ops.Workspace.allocate("cuda", 5, 8, head_dim, splits)
            out = ops.decode_attention(case.qkv, kp, vp, case.lengths, num_splits=splits, block_tables=bad,
                                       row_active=active, workspace=ws, validate_lengths=False, **kw,
                                       **case.kwargs())  # fmt: skip
            torch.cuda.synchronize()
            assert ws.status.tolist() == [0, 0, 8, 0, 8], ws.status.tolist()
            assert torch.isnan(out[[2, 4]]).all() and torch.isfinite(out[[0, 1, 3]]).all()


def rotary_cases() -> None:
    """Tables by length: lengths before the start, within the rows and past the last; with
    validation off, out-of-range lengths (the row index clamps, the guard refuses the row)."""
    for splits in (1, 3):
        case = make_case(5, 8, 2, 128, [0, 30, 31, 33, 255], 256, torch.float16, seed=splits, bias=True,
                         rotary_dim=128)  # fmt: skip
        case.rotary.update(inv_freq=torch.rand(3, 64, device="cuda"), table_start=31)
        assert torch.isfinite(run(case, (8, 2), 128, splits, "auto", 2)).all()
        case.lengths.copy_(torch.tensor([256, -1, 7, 10**6, -(2**31)], dtype=torch.int32))
        ws = ops.Workspace.allocate("cuda", 5, 8, 128, splits)
        out = run(case, (8, 2), 128, splits, "auto", 2, validate=False, workspace=ws)
        torch.cuda.synchronize()
        assert torch.isfinite(out[2]).all()


def qk_norm_cases() -> None:
    """The q/k norm in the kernel's q/k build: the tile loop on both sources, split and not, the
    CUDA-core loop, a head dim the lanes cover unevenly; tree steps with narrow and wide items
    (the norm of each node's q, and of its k in the tree append)."""
    for dtype, head_dim, sources in (
        (torch.float16, 128, ("tma", "cp_async")),
        (torch.float32, 64, ("auto",)),
        (torch.bfloat16, 80, ("auto",)),
    ):
        for splits in (1, 5):
            for source in sources:
                case = make_case(5, 8, 2, head_dim, [0, 1, 17, 127, 255], 256, dtype, seed=splits, bias=True,
                                 rotary_dim=head_dim)  # fmt: skip
                w = torch.rand(head_dim, device="cuda") + 0.5
                case.mods["qk_norm"] = spec.QKNorm(w, w.flip(0), 1e-6)
                assert torch.isfinite(run(case, (8, 2), head_dim, splits, source, 2)).all()
    for nodes in (9, 33):
        case = make_case(3, 8, 2, 128, [0, 17, 200], 256, torch.float16, seed=nodes, rotary_dim=128)
        case.mods["qk_norm"] = spec.QKNorm(torch.rand(128, device="cuda"), torch.rand(128, device="cuda"),
                                           1e-6, 1.0, False)  # fmt: skip
        qkv = torch.randn(3, nodes, case.qkv.shape[1], device="cuda").to(torch.float16)
        parents = torch.tensor([[-1] + [t - 1 for t in range(1, nodes)]] * 3, dtype=torch.int32).cuda()
        kc, vc = case.clone_caches()
        for splits in (1, 4):
            out = ops.decode_tree(qkv, kc.clone(), vc.clone(), case.lengths, parents, num_splits=splits, stages=2,
                                  **case.kwargs())  # fmt: skip
            assert torch.isfinite(out).all()


def int8_cases() -> None:
    """int8 caches (codes, a scale per token and kv head): both tile sources, split and not, a ring
    deep enough for paired tiles, pages of 16 and 64 slots, a non-finite new token (flagged), and
    out-of-range lengths with validation off; tree steps (contiguous and paged, a NaN node
    flagged); unused slots hold stray codes and NaN scales."""
    from int8_cases import int8_case, to_pages

    lengths = [0, 1, 17, 127, 255]
    for dtype, head_dim, plans in (
        (torch.float16, 128, (("tma", 2), ("cp_async", 2), ("auto", 4))),
        (torch.bfloat16, 80, (("auto", 2),)),
    ):
        for splits in (1, 5):
            for source, stages in plans:
                case, ks, vs = int8_case(5, 8, 2, head_dim, lengths, 256, dtype, seed=splits, bias=True,
                                         rotary_dim=head_dim)  # fmt: skip
                assert torch.isfinite(
                    run(case, (8, 2), head_dim, splits, source, stages, scales=(ks, vs))
                ).all()
    for max_seq_len in (129, 131, 132):  # scales a chunk at a time (132) or one by one, rows to the end
        case, ks, vs = int8_case(3, 8, 2, 128, [0, 61, max_seq_len - 1], max_seq_len, torch.float16, seed=1)
        assert torch.isfinite(run(case, (8, 2), 128, 1, "auto", 2, scales=(ks, vs))).all()
    for block_size in (16, 64):
        case, ks, vs = int8_case(5, 8, 2, 128, lengths, 256, torch.float16, seed=block_size)
        kp, vp, ksp, vsp, tables = to_pages(case, ks, vs, block_size, block_size)
        for splits in (1, 5):
            out = ops.decode_attention(case.qkv, kp, vp, case.lengths, k_scale=ksp, v_scale=vsp, block_tables=tables,
                                       num_splits=splits, **case.kwargs())  # fmt: skip
            assert torch.isfinite(out).all()
    case, ks, vs = int8_case(5, 8, 2, 128, lengths, 256, torch.float16, seed=3)
    case.qkv[2, 8 * 128 + 3] = float("nan")  # row 2's new k
    ws = ops.Workspace.allocate("cuda", 5, 8, 128, 5)
    run(case, (8, 2), 128, 5, "auto", 2, workspace=ws, scales=(ks, vs))
    torch.cuda.synchronize()
    assert ws.status.tolist() == [0, 0, 2, 0, 0], ws.status.tolist()
    case.lengths.copy_(torch.tensor([256, -1, 7, 10**6, -(2**31)], dtype=torch.int32))
    ws = ops.Workspace.allocate("cuda", 5, 8, 128, 3)
    out = run(case, (8, 2), 128, 3, "auto", 2, validate=False, workspace=ws, scales=(ks, vs))
    torch.cuda.synchronize()
    assert ws.status.tolist() == [1, 1, 2, 1, 1], ws.status.tolist()
    # Tree steps: ragged rows (one to S_max), 1 and 3 splits, pages, a NaN node (flagged).
    g = torch.Generator().manual_seed(4)
    for nodes, splits in ((5, 1), (33, 3)):
        case, ks, vs = int8_case(3, 8, 2, 128, [0, 61, 256 - nodes], 256, torch.float16, seed=nodes,
                                 rotary_dim=128)  # fmt: skip
        qkv = torch.randn(3, nodes, 12 * 128, generator=g).half().cuda()
        parents = torch.tensor([[t - 1 if t % 3 else -1 for t in range(nodes)]] * 3, dtype=torch.int32).cuda()
        counts = torch.tensor([nodes, 2, nodes], dtype=torch.int32).cuda()
        kc, vc = case.clone_caches()
        out = ops.decode_tree(qkv, kc, vc, case.lengths, parents, node_counts=counts, num_splits=splits,
                              k_scale=ks.clone(), v_scale=vs.clone(), **case.kwargs())  # fmt: skip
        assert torch.isfinite(out).all()
        kp, vp, ksp, vsp, tables = to_pages(case, ks, vs, 16, nodes)
        out = ops.decode_tree(qkv, kp, vp, case.lengths, parents, node_counts=counts, num_splits=splits,
                              k_scale=ksp, v_scale=vsp, block_tables=tables, **case.kwargs())  # fmt: skip
        assert torch.isfinite(out).all()
    qkv[1, 1, 8 * 128 + 3] = float("nan")  # row 1's node 1's k
    ws = ops.Workspace.allocate("cuda", 3, 8, 128, 3, nodes=33)
    ops.decode_tree(qkv, kc, vc, case.lengths, parents, node_counts=counts, num_splits=3, workspace=ws,
                    k_scale=ks.clone(), v_scale=vs.clone(), **case.kwargs())  # fmt: skip
    torch.cuda.synchronize()
    assert ws.status.tolist() == [0, 2, 0], ws.status.tolist()


def int4_cases() -> None:
    """int4 caches (mmha.int4): every head dim's smallest and largest, split and not, rows ending
    before, on and past a group's end (a group committed by the step), attend-only and idle rows,
    a window, pools of 64- and 128-slot blocks (spare blocks poisoned; a block outside the pool
    refused), a non-finite new token (flagged); unused codes 0xFF, unused scales, zero points and
    residual entries NaN."""
    from int4_cases import int4_case

    lengths = [0, 1, 63, 127, 200]
    for dtype, head_dim in ((torch.float16, 128), (torch.bfloat16, 32), (torch.float16, 256)):
        for splits in (1, 5):
            case = int4_case(
                5, 8, 2, head_dim, lengths, 256, dtype, seed=splits, bias=True, rotary_dim=head_dim
            )
            out = ops.decode_attention_int4(
                case.qkv, case.cache, case.lengths, num_splits=splits, **case.kwargs()
            )
            assert torch.isfinite(out).all()
    modes = torch.tensor([spec.ROW_ATTEND, spec.ROW_IDLE, spec.ROW_STEP, spec.ROW_ATTEND, spec.ROW_STEP],
                         dtype=torch.int32, device="cuda")  # fmt: skip
    case = int4_case(5, 8, 2, 128, [64, 5, 63, 100, 200], 256, torch.float16, seed=7, window=70)
    out = ops.decode_attention_int4(case.qkv, case.cache, case.lengths, row_active=modes, num_splits=3,
                                    **case.kwargs())  # fmt: skip
    assert torch.isfinite(out).all()
    from int4_cases import to_pages

    for block_size in (64, 128):  # pages (a row refused for a block outside the pool), split and not
        case = int4_case(4, 8, 2, 128, [0, 63, 127, 200], 256, torch.float16, seed=block_size, bias=True)
        pages, tables = to_pages(case.cache, block_size, seed=1)
        for splits in (1, 3):
            out = ops.decode_attention_int4(
                case.qkv, pages, case.lengths, block_tables=tables, num_splits=splits, **case.kwargs()
            )
            assert torch.isfinite(out).all()
        tables[2, 0] = pages.num_blocks + 3
        ws = ops.Workspace.allocate("cuda", 4, 8, 128, 3)
        ops.decode_attention_int4(case.qkv, pages, case.lengths, block_tables=tables, num_splits=3, workspace=ws,
                                  validate_lengths=False, **case.kwargs())  # fmt: skip
        torch.cuda.synchronize()
        assert ws.status.tolist() == [0, 0, 8, 0], ws.status.tolist()
    case = int4_case(3, 8, 2, 64, [10, 63, 20], 128, torch.float16, seed=2)
    case.qkv[1, 8 * 64 + 5] = float("nan")  # row 1's new k
    ws = ops.Workspace.allocate("cuda", 3, 8, 64, 1)
    ops.decode_attention_int4(case.qkv, case.cache, case.lengths, num_splits=1, workspace=ws, **case.kwargs())
    torch.cuda.synchronize()
    assert ws.status.tolist() == [0, 2, 0], ws.status.tolist()


def norm_cases() -> None:
    """The row norm: one segment over rows of every width class, in and out of place; q/k
    segments of a qkv row in place, weights shared and per head; strided rows."""
    for width in (1, 31, 128, 1000, 5120):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            x = torch.randn(3, width, device="cuda", dtype=dtype)
            w = torch.randn(width, device="cuda", dtype=dtype)
            ops.rms_norm(x, torch.empty_like(x), [w], [0, 1, width], [1e-6])
            ops.rms_norm(x, x, [w], [0, 1, width], [1e-6], 1.0, False)
    qkv = torch.randn(4, (8 + 2 * 2) * 64, device="cuda", dtype=torch.bfloat16)
    wq, wk = torch.randn(8, 64, device="cuda"), torch.randn(64, device="cuda")
    ops.rms_norm(qkv, qkv, [wq, wk], [0, 8, 64, 512, 2, 64], [1e-6, 1e-6])
    big = torch.randn(4, 700, device="cuda")
    ops.rms_norm(big[:, 50:650], big[:, 50:650], [torch.ones(300, device="cuda")], [0, 2, 300], [1e-5])
    torch.cuda.synchronize()


def main() -> None:
    if sys.argv[1:] == ["norms"]:
        norm_cases()
        print("sanitize cases done")
        return
    if sys.argv[1:] == ["qk_norm"]:
        qk_norm_cases()
        print("sanitize cases done")
        return
    if sys.argv[1:] == ["int8"]:
        int8_cases()
        print("sanitize cases done")
        return
    if sys.argv[1:] == ["int4"]:
        int4_cases()
        print("sanitize cases done")
        return
    for dtype, head_dim, heads in (
        (torch.float16, 128, (8, 2)),
        (torch.bfloat16, 64, (4, 4)),
        (torch.float32, 80, (16, 1)),
        (torch.float16, 256, (6, 2)),
        (torch.bfloat16, 96, (8, 8)),
    ):
        lengths = [0, 1, 17, 127, 255]  # 255 + 1 fills S_max = 256
        # Both tile sources and two ring depths on the first configuration, the default elsewhere.
        plans = [("auto", 2)]
        if (dtype, head_dim) == (torch.bfloat16, 64):
            plans = [("auto", 2), ("auto", 4)]  # and a deeper ring
        if (dtype, head_dim) == (torch.float16, 128):
            plans = [("tma", 2), ("tma", 3), ("cp_async", 2), ("cp_async", 3)]
        for splits in (1, 5):
            for source, stages in plans:
                case = make_case(5, *heads, head_dim, lengths, 256, dtype, seed=splits, bias=True,
                                 rotary_dim=head_dim // 2)  # fmt: skip
                out = run(case, heads, head_dim, splits, source, stages)
                assert torch.isfinite(out).all()
        # Out-of-range lengths reach the kernel only with validation off.
        case = make_case(5, *heads, head_dim, lengths, 256, dtype, seed=9)
        case.lengths.copy_(torch.tensor([256, -1, 7, 10**6, -(2**31)], dtype=torch.int32))
        for splits in (1, 3):
            ws = ops.Workspace.allocate("cuda", 5, heads[0], head_dim, splits)
            out = run(case, heads, head_dim, splits, "auto", 2, validate=False, workspace=ws)
            torch.cuda.synchronize()
            assert ws.status.tolist() == [1, 1, 0, 1, 1], ws.status.tolist()
            assert torch.isnan(out[[0, 1, 3, 4]]).all() and torch.isfinite(out[2]).all()
    fp8_cases()
    mods_cases()
    tree_cases()
    paged_cases()
    epilogue_cases()
    rotary_cases()
    qk_norm_cases()
    int8_cases()
    int4_cases()
    norm_cases()
    print("sanitize cases done")


if __name__ == "__main__":
    main()
