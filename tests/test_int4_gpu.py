"""int4 caches on the GPU (``mmha.int4``: V per token, K per channel over 64-token groups, the row's
last group in a 16-bit residual): ``ops.decode_attention_int4`` against ``mmha.int4.decode_step``
in float64. Outputs within the fp16 operands' tolerance; the cache after the step (codes, scales,
zero points, residual; a completed group quantised and committed) bit for bit as the oracle leaves
it, everything the rows do not hold poisoned and untouched; every head dim, GQA groups, splits,
rows ending around the groups, row modes, windows, rotary and bias, a run of steps across group
ends, a non-finite or out-of-range new token flagged, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from helpers import FLOOR, assert_bits_equal, gpu
from int4_cases import PLANES, clone, int4_case

from mmha import int4, ops
from mmha.spec import ROW_ATTEND, ROW_IDLE, ROW_STEP
from mmha.workspace import ScaleError, Workspace

pytestmark = gpu

HEAD_DIMS = (32, 64, 96, 128, 256)


def run_oracle(case, row_active=None):
    cache = clone(case.cache)
    out, lse = int4.decode_step(
        case.qkv, cache, case.lengths, return_lse=True, compute_dtype=torch.float64, row_active=row_active,
        **case.kwargs(),
    )  # fmt: skip
    return out, lse, cache


def run_kernel(case, row_active=None, workspace=None, **kw):
    cache = clone(case.cache)
    out, lse = ops.decode_attention_int4(
        case.qkv, cache, case.lengths, return_lse=True, row_active=row_active, workspace=workspace,
        **case.kwargs(), **kw,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out, lse, cache


def assert_outputs_close(out, lse, ref, ref_lse, dtype):
    assert torch.isfinite(out).all(), "kernel output has non-finite values"
    err = (out.double() - ref.double()).abs().max().item()
    tol = FLOOR[dtype] * max(1.0, ref.double().abs().max().item())
    assert err <= tol, f"max error {err:.3e} > {tol:.3e}"
    live = torch.isfinite(ref_lse)
    assert torch.equal(live, torch.isfinite(lse)), "lse finite where the oracle's is not (or the reverse)"
    lse_err = (lse.double() - ref_lse.double())[live].abs().max().item() if live.any() else 0.0
    assert lse_err <= 2e-3 * max(1.0, ref_lse[live].abs().max().item() if live.any() else 1.0), (
        f"lse {lse_err:.3e}"
    )


def assert_caches_equal(got, want, k_exact=True):
    """Every plane bit for bit (NaN poison included); with rotary (k_exact False) K's planes may
    differ where the kernel's fp32 rotation and the oracle's float64 one round apart."""
    for name in PLANES:
        if k_exact or name in ("v_codes", "v_scale", "v_zero"):
            assert_bits_equal(getattr(got, name), getattr(want, name), name)
    if not k_exact:
        a, b = got.k_residual.double(), want.k_residual.double()
        ok = (a - b).abs() <= 1e-2 * b.abs() + 1e-6
        assert (ok | (a.isnan() & b.isnan())).all(), "k_residual beyond one rounding of the oracle's"


def check(case, row_active=None, k_exact=True, **kw):
    ref, ref_lse, want = run_oracle(case, row_active)
    out, lse, got = run_kernel(case, row_active, **kw)
    assert_outputs_close(out, lse, ref, ref_lse, case.qkv.dtype)
    assert_caches_equal(got, want, k_exact)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_matches_int4_oracle(dtype, head_dim, splits):
    """Rows of 0 (the first group), 63 (the step completes and commits a group) and 200 tokens."""
    case = int4_case(3, 8, 2, head_dim, [0, 63, 200], 256, dtype, seed=head_dim + splits)
    check(case, num_splits=splits)


@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (8, 1), (6, 2), (16, 8)])
def test_gqa_groups(heads):
    hq, hkv = heads
    case = int4_case(3, hq, hkv, 128, [5, 127, 500], 512, torch.float16, seed=hq * 7 + hkv)
    check(case)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_and_bias(interleaved, dtype):
    case = int4_case(4, 8, 4, 64, [1, 63, 64, 129], 192, dtype, seed=11, bias=True, rotary_dim=64,
                     rotary_interleaved=interleaved)  # fmt: skip
    check(case, k_exact=False)


@pytest.mark.parametrize("splits", [1, 5])
def test_lengths_around_groups(splits):
    """Rows ending around the 64-token groups and the 16-key slices."""
    lengths = [1, 2, 15, 16, 17, 62, 63, 64, 65, 126, 127, 128, 191, 239]
    case = int4_case(len(lengths), 8, 2, 128, lengths, 256, torch.bfloat16, seed=splits, bias=True)
    check(case, num_splits=splits)


@pytest.mark.parametrize("splits", [1, 4])
def test_row_modes(splits):
    """Idle rows, attend-only rows (a whole number of groups: no residual tile; a partial group;
    one slot short of a group's end, which an attend-only row must not commit), stepping rows."""
    lengths = [64, 100, 63, 128, 5, 0, 127, 65]
    modes = [ROW_ATTEND, ROW_ATTEND, ROW_STEP, ROW_IDLE, ROW_STEP, ROW_IDLE, ROW_ATTEND, ROW_ATTEND]
    case = int4_case(len(lengths), 8, 2, 128, lengths, 256, torch.float16, seed=5)
    check(case, row_active=torch.tensor(modes, dtype=torch.int32, device="cuda"), num_splits=splits)


@pytest.mark.parametrize("window", [1, 50, 64, 100])
def test_windows(window):
    case = int4_case(4, 8, 2, 64, [10, 63, 130, 255], 320, torch.float16, seed=window, window=window)
    check(case, num_splits=2)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_bulk_copies_and_cp_async_agree_bit_for_bit(head_dim):
    """The two ways a tile comes (``tile_source`` "auto": bulk copies on sm_90; "cp_async": 16-byte
    copies that zero-fill what the step does not read): output, lse and cache bit for bit, and
    both within the oracle's tolerance. The bulk copies read every key of a tile: those before a
    window's start, the poisoned slots past a row's end (0xFF codes, NaN scales) and the new
    token's slot, which the consumers mask, weigh by 0 and patch."""
    case = int4_case(4, 8, 2, head_dim, [0, 63, 130, 200], 256, torch.float16, seed=head_dim, window=70)
    ref, ref_lse, want = run_oracle(case)
    bulk = run_kernel(case, num_splits=2, tile_source="auto")
    copies = run_kernel(case, num_splits=2, tile_source="cp_async")
    assert_outputs_close(bulk[0], bulk[1], ref, ref_lse, torch.float16)
    assert_caches_equal(bulk[2], want)
    assert_bits_equal(bulk[0], copies[0], "out")
    assert_bits_equal(bulk[1], copies[1], "lse")
    assert_caches_equal(bulk[2], copies[2])


def test_values_over_many_magnitudes():
    """V tokens far from 1 (their scales and zero points with them) and K with offsets."""
    for value_scale in (1e-3, 3e2):
        case = int4_case(2, 8, 2, 128, [63, 300], 384, torch.float16, seed=3, value_scale=value_scale)
        check(case)


@pytest.mark.parametrize("q_scale", [0.02, 1.0])
def test_one_chain_over_a_long_row(q_scale):
    """32K keys in one item (no split), so the V sums run in one mma chain over the whole row; with a
    small q the weights are nearly flat and the output is small (|out| ~ 0.02), so a bias in those
    sums shows against it rather than hiding under the FLOOR tolerance. On an H200 the kernel's
    error here was 4.6e-5 (q 0.02) and 8.0e-5 (q 1.0); a form that left an offset of 64 in the odd
    channels' sums (taken off at the item's end) had 1.1e-3 on both (docs/experiments.md)."""
    s = 32768
    case = int4_case(1, 8, 2, 128, [s], s + 64, torch.float16, seed=s)
    case.qkv[:, : 8 * 128] *= q_scale
    ref, _, _ = run_oracle(case)
    out, _, _ = run_kernel(case, num_splits=1)
    err = (out.double() - ref.double()).abs().max().item()
    tol = 1e-4 + 1e-2 * ref.double().abs().max().item()
    assert err <= tol, f"max error {err:.3e} > {tol:.3e} over one chain of {s} keys"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_steps_across_group_ends(dtype):
    """70 steps in a row, each the kernel's against the oracle's from the same cache, the caches
    compared after each: a group committed mid-run is read back as the oracle reads it."""
    case = int4_case(2, 8, 2, 64, [30, 120], 256, dtype, seed=9, bias=True)
    mine, theirs = clone(case.cache), clone(case.cache)
    lengths = case.lengths.clone()
    g = torch.Generator().manual_seed(1)
    for _ in range(70):
        qkv = torch.randn(case.qkv.shape, generator=g).to(dtype).cuda()
        ref, ref_lse = int4.decode_step(qkv, theirs, lengths, return_lse=True, compute_dtype=torch.float64,
                                        **case.kwargs())  # fmt: skip
        out, lse = ops.decode_attention_int4(qkv, mine, lengths, return_lse=True, **case.kwargs())
        torch.cuda.synchronize()
        assert_outputs_close(out, lse, ref, ref_lse, dtype)
        assert_caches_equal(mine, theirs)
        lengths += 1


def test_non_finite_and_out_of_range_tokens_are_flagged():
    """A new V with inf, and a new K past fp16's range (bf16), flag their rows; the other rows pass."""
    case = int4_case(3, 8, 2, 64, [10, 63, 20], 128, torch.bfloat16, seed=2)
    hq, hkv, d = 8, 2, 64
    case.qkv[0, (hq + hkv) * d + 3] = float("inf")  # row 0: a V value
    case.qkv[1, hq * d + 5] = 1e6  # row 1: a K value past 65504
    ws = Workspace.allocate(case.qkv.device, 3, hq, d, 1)
    out, _lse, _cache = run_kernel(case, workspace=ws, num_splits=1)
    status = ws.status[:3].tolist()
    assert status[0] != 0 and status[1] != 0 and status[2] == 0, status
    with pytest.raises(ScaleError):
        ws.check()
    ref, _ref_lse, _ = run_oracle(case)
    assert torch.allclose(out[2].double(), ref[2].double(), atol=FLOOR[torch.bfloat16] * 4)


def raw_call(case, **over):
    c = case.cache
    d = c.head_dim
    ws = Workspace.allocate(case.qkv.device, c.batch, case.num_heads, d, 1)
    args = dict(
        k_scale=c.k_scale, v_scale=c.v_scale, k_zero=c.k_zero, v_zero=c.v_zero, k_residual=c.k_residual,
        tile_source=1,
    )  # fmt: skip
    args.update(over)
    out = torch.empty(c.batch, case.num_heads * d, dtype=case.qkv.dtype, device="cuda")
    lse = torch.empty(c.batch, case.num_heads, device="cuda")
    torch.ops.mmha.decode_attention(
        case.qkv, args.pop("k_cache", c.k_codes), args.pop("v_cache", c.v_codes), case.lengths, None, out, lse,
        ws.partials, ws.counters, ws.status, case.num_heads, case.num_kv_heads, d**-0.5, 0, 10000.0, False, 1,
        stages=2, **args,
    )  # fmt: skip
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    "over, name",
    [
        (lambda c: dict(k_zero=None), "k_zero"),
        (lambda c: dict(v_zero=c.v_zero[:, :, :-64].contiguous()), "v_zero"),
        (lambda c: dict(k_scale=c.k_scale.float()), "k_scale"),
        (lambda c: dict(k_residual=c.k_residual.float()), "k_residual"),
        (lambda c: dict(v_scale=c.v_scale[:, :1].contiguous()), "v_scale"),
        (lambda c: dict(tile_source=2), "tile_source"),
    ],
)
def test_bad_planes_are_refused_and_nothing_changes(over, name):
    case = int4_case(2, 8, 2, 64, [10, 63], 128, torch.float16, seed=4)
    before = clone(case.cache)
    with pytest.raises(RuntimeError, match=name):
        raw_call(case, **over(case.cache))
    assert_caches_equal(case.cache, before)


def test_planes_refused_for_other_caches():
    case = int4_case(1, 8, 2, 64, [3], 64, torch.float16, seed=4)
    k = torch.zeros(1, 2, 8, 64, 8, dtype=torch.float16, device="cuda")
    v = torch.zeros(1, 2, 64, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="k_zero, v_zero and k_residual must be None"):
        raw_call(case, k_cache=k, v_cache=v, k_scale=None, v_scale=None)


def test_wrapper_checks():
    case = int4_case(1, 8, 2, 64, [3], 64, torch.float16, seed=4)
    with pytest.raises(ValueError, match="activation dtype"):
        ops.decode_attention_int4(case.qkv.to(torch.bfloat16), case.cache, case.lengths, **case.kwargs())
    before = clone(case.cache)
    with pytest.raises(ValueError, match="tile_source must be 'auto' or 'cp_async' with an int4 cache"):
        ops.decode_attention_int4(case.qkv, case.cache, case.lengths, tile_source="tma", **case.kwargs())
    assert_caches_equal(case.cache, before)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kvcache_int4_steps_match_reference_and_graph_replay(dtype, paged):
    """KVCache(kv_dtype="int4") on the GPU against the same cache on the CPU (the reference path),
    contiguous and paged: prompts quantised by the format, 70 steps (rows crossing group ends),
    then a CUDA-graph replay of a step."""
    from mmha.cache import KVCache

    torch.manual_seed(0)
    hq, hkv, d, layers = 8, 2, 64, 2
    kw = dict(kv_dtype="int4", rotary_dim=d)
    if paged:
        kw.update(paged=True, block_size=64)
    cache = KVCache(layers, 3, 200, hq, hkv, d, dtype, "cuda", dispatch_on="capacity", **kw)
    ref = KVCache(layers, 3, 200, hq, hkv, d, dtype, "cpu", **kw)
    k = torch.randn(3, 70, hkv, d, dtype=dtype) * 3
    v = torch.randn(3, 70, hkv, d, dtype=dtype)
    for layer in range(layers):
        cache.prefill(layer, k.cuda(), v.cuda(), [60, 7, 64])
        ref.prefill(layer, k, v, [60, 7, 64])
    width = (hq + 2 * hkv) * d
    for _ in range(70):
        qkvs = [torch.randn(3, width, dtype=dtype) for _ in range(layers)]
        outs = [cache.step(i, q.cuda()) for i, q in enumerate(qkvs)]
        want = [ref.step(i, q) for i, q in enumerate(qkvs)]
        cache.advance()
        ref.advance()
        for o, w in zip(outs, want, strict=True):
            err = (o.cpu().double() - w.double()).abs().max().item()
            assert err <= 2 * FLOOR[dtype] * max(1.0, w.abs().max().item()), err
    cache.check()
    qkv = torch.randn(3, width, dtype=dtype, device="cuda")
    eager = cache.step(0, qkv).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cache.step(0, qkv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_kvcache_int4_refusals_on_the_gpu():
    """What a GPU int4 cache does not take yet, refused by name: tree steps, fp32."""
    from mmha.cache import KVCache

    with pytest.raises(ValueError, match="float16 or bfloat16 with an int4 cache"):
        KVCache(1, 2, 128, 8, 2, 64, torch.float32, "cuda", kv_dtype="int4")
    cache = KVCache(1, 2, 128, 8, 2, 64, torch.float16, "cuda", kv_dtype="int4")
    qkv = torch.randn(2, 3, 12 * 64, dtype=torch.float16, device="cuda")
    parents = torch.tensor([[-1, 0, 1]] * 2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="tree steps"):
        cache.step_tree(0, qkv, parents)


def clone_pages(pages):
    from mmha.int4_pages import Int4Pages

    return Int4Pages(**{name: getattr(pages, name).clone() for name in PLANES})


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tile_source", ["auto", "cp_async"])
def test_pages_equal_the_contiguous_cache(block_size, splits, tile_source):
    """The same rows scattered over a pool's blocks: the step's output bit for bit the contiguous
    cache's (by bulk copies on sm_90), whichever way the pool's tiles come, and each row's blocks
    after it (gathered) its contiguous row, bit for bit (a group committed into its block
    included); the spare blocks untouched."""
    from int4_cases import to_pages

    case = int4_case(4, 8, 2, 128, [0, 63, 127, 200], 256, torch.float16, seed=block_size + splits, bias=True)
    pages, tables = to_pages(case.cache, block_size, seed=splits)
    out, lse, want = run_kernel(case, num_splits=splits)
    got = clone_pages(pages)
    pout, plse = ops.decode_attention_int4(
        case.qkv, got, case.lengths, return_lse=True, block_tables=tables, num_splits=splits,
        tile_source=tile_source, **case.kwargs(),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert_bits_equal(pout, out, "out")
    assert_bits_equal(plse, lse, "lse")
    used = set(tables.flatten().tolist())
    for row in range(case.cache.batch):
        blocks = tables[row].tolist()
        gathered = got.gather(row, blocks)
        for name in PLANES:
            assert_bits_equal(getattr(gathered, name)[0], getattr(want, name)[row], f"row {row} {name}")
    spare = [i for i in range(pages.num_blocks) if i not in used]
    for name in PLANES[:-1]:
        assert_bits_equal(getattr(got, name)[spare], getattr(pages, name)[spare], f"spare {name}")


def test_pages_against_the_oracle():
    from int4_cases import to_pages

    from mmha import int4_pages

    case = int4_case(3, 8, 2, 64, [5, 63, 130], 192, torch.bfloat16, seed=21)
    pages, tables = to_pages(case.cache, 64, seed=2)
    ref_pages = clone_pages(pages)
    ref, ref_lse = int4_pages.decode_step_paged(
        case.qkv,
        ref_pages,
        tables,
        case.lengths,
        return_lse=True,
        compute_dtype=torch.float64,
        **case.kwargs(),
    )
    got = clone_pages(pages)
    out, lse = ops.decode_attention_int4(
        case.qkv, got, case.lengths, return_lse=True, block_tables=tables, **case.kwargs()
    )
    torch.cuda.synchronize()
    assert_outputs_close(out, lse, ref, ref_lse, torch.bfloat16)
    for name in PLANES:
        assert_bits_equal(getattr(got, name), getattr(ref_pages, name), name)


def test_a_block_outside_the_pool_writes_nothing():
    """A row whose table names a block outside the pool (validation off) is refused: NaN output,
    PageError, nothing written for it, on a step that would commit a group too; the other rows
    step as usual."""
    from int4_cases import to_pages

    from mmha.workspace import PageError

    case = int4_case(3, 8, 2, 64, [63, 63, 20], 128, torch.float16, seed=8)
    pages, tables = to_pages(case.cache, 64, seed=3)
    row1 = tables[1, 0].item()
    tables[1, 0] = pages.num_blocks + 7  # the block of row 1's slots (its new token's too)
    before = clone_pages(pages)
    ws = Workspace.allocate(case.qkv.device, 3, 8, 64, 1)
    got = clone_pages(pages)
    out = ops.decode_attention_int4(
        case.qkv, got, case.lengths, block_tables=tables, num_splits=1, workspace=ws, validate_lengths=False,
        **case.kwargs(),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()
    with pytest.raises(PageError):
        ws.check()
    for name in PLANES[:-1]:
        assert_bits_equal(getattr(got, name)[row1], getattr(before, name)[row1], f"row 1's block {name}")
    assert_bits_equal(got.k_residual[1], before.k_residual[1], "row 1's residual")
    assert not torch.equal(got.v_codes[tables[0, 0].item()], before.v_codes[tables[0, 0].item()])
