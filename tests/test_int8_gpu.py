"""int8 caches on the GPU (codes with a scale per token and kv head, ``mmha.quant``): the kernel
against ``mmha.reference``'s int8 path (outputs within fp32-accumulation tolerance; the appended
codes and scales as the reference stores them, every other slot untouched), both tile sources,
every head dim, GQA, rotary and bias, pages, V scales over many orders of magnitude, unused slots
poisoned (NaN scales, stray codes), a non-finite new token flagged, the checks on scales, and
``KVCache`` with a CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from helpers import FLOOR, assert_bits_equal, gpu, launched_kernels, lean_kernel_name
from int8_cases import int8_case, to_pages

from mmha import layout, ops, paging, reference
from mmha._constants import ROW_STEP
from mmha.cache import KVCache

pytestmark = gpu

HEAD_DIMS = (32, 64, 80, 96, 128, 256)


def run_reference_int8(case, k_scale, v_scale):
    kc, vc = case.clone_caches()
    ks, vs = k_scale.clone(), v_scale.clone()
    out, lse = reference.decode_step(
        case.qkv, kc, vc, case.lengths, return_lse=True, compute_dtype=torch.float64, k_scale=ks, v_scale=vs,
        **case.kwargs(),
    )  # fmt: skip
    return out, lse, (kc, vc, ks, vs)


def run_kernel(case, k_scale, v_scale, **kw):
    kc, vc = case.clone_caches()
    ks, vs = k_scale.clone(), v_scale.clone()
    out, lse = ops.decode_attention(
        case.qkv, kc, vc, case.lengths, return_lse=True, k_scale=ks, v_scale=vs, **case.kwargs(), **kw
    )
    torch.cuda.synchronize()
    return out, lse, (kc, vc, ks, vs)


def assert_outputs_close(out, lse, ref, ref_lse, dtype):
    assert torch.isfinite(out).all(), "kernel output has non-finite values"
    err = (out.double() - ref.double()).abs().max().item()
    tol = FLOOR[dtype] * max(1.0, ref.double().abs().max().item())
    assert err <= tol, f"max error {err:.3e} > {tol:.3e}"
    lse_err = (lse.double() - ref_lse.double()).abs().max().item()
    assert lse_err <= 1e-3 * max(1.0, ref_lse.abs().max().item()), f"lse error {lse_err:.3e}"


def assert_caches_as_reference(got, want, rotary):
    """The append as the reference stores it: V's codes and scales bit for bit; K's too without
    rotary. Rotated k may sit one code away and its scale a little off: the kernel's angles are
    fp32 (position x frequency, within 2^-24 of the float64 reference's relative, so up to S_max x
    2^-24 radians off), which moves the largest |k| of a token by about as much relative (2.2e-5 at
    positions 300-540, where a fixed 1e-5 failed). Every other slot, stray codes and NaN scales
    included, bit for bit."""
    kc, vc, ks, vs = got
    rk, rv, rks, rvs = want
    assert_bits_equal(vc, rv, "v_cache")
    assert_bits_equal(vs, rvs, "v_scale")
    if not rotary:
        assert_bits_equal(kc, rk, "k_cache")
        assert_bits_equal(ks, rks, "k_scale")
        return
    assert (kc.int() - rk.int()).abs().max().item() <= 1, "rotated k more than one code from the reference"
    rtol = 1e-5 + 2 * ks.shape[-1] * 2.0**-24  # the largest position's fp32 angle error, twice
    assert torch.allclose(ks, rks, rtol=rtol, atol=0, equal_nan=True), "rotated k's scale"


def check_int8(case, ks, vs, rotary=False, **kw):
    ref, ref_lse, want = run_reference_int8(case, ks, vs)
    out, lse, got = run_kernel(case, ks, vs, **kw)
    assert_outputs_close(out, lse, ref, ref_lse, case.qkv.dtype)
    assert_caches_as_reference(got, want, rotary)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_matches_int8_reference(dtype, head_dim, splits):
    case, ks, vs = int8_case(3, 8, 2, head_dim, [0, 63, 200], 256, dtype, seed=head_dim + splits)
    check_int8(case, ks, vs, num_splits=splits)


@pytest.mark.parametrize("source", ["cp_async", "tma"])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (8, 1), (6, 2)])
def test_gqa_groups_and_sources(source, heads):
    hq, hkv = heads
    case, ks, vs = int8_case(2, hq, hkv, 128, [5, 500], 512, torch.float16, seed=hq * 7 + hkv)
    check_int8(case, ks, vs, tile_source=source)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_and_bias(interleaved, dtype):
    case, ks, vs = int8_case(
        4, 8, 4, 64, [1, 17, 64, 129], 192, dtype, seed=11, bias=True, rotary_dim=64,
        rotary_interleaved=interleaved,
    )  # fmt: skip
    check_int8(case, ks, vs, rotary=True)


@pytest.mark.parametrize("splits", [1, 5])
def test_lengths_around_tiles(splits):
    """Rows ending around the 64-key tiles and the 16-key slices (RELIABILITY rows 1-2)."""
    lengths = [1, 2, 5, 15, 16, 17, 63, 64, 65, 97, 127, 239]
    case, ks, vs = int8_case(len(lengths), 8, 2, 128, lengths, 256, torch.bfloat16, seed=splits, bias=True)
    check_int8(case, ks, vs, num_splits=splits)


@pytest.mark.parametrize("max_seq_len", [130, 131, 132])
@pytest.mark.parametrize("splits", [1, 3])
def test_both_scale_copies(max_seq_len, splits):
    """The tiles' scales come in 16-byte chunks where the row's scale planes are 16-byte aligned
    (S_max a multiple of 4: 132), else a scale at a time (130, 131: rows misaligned, and a last
    chunk that would run past the row); rows ending inside a chunk, unused slots NaN."""
    lengths = [0, 1, 2, 3, 61, 127, max_seq_len - 1]
    case, ks, vs = int8_case(len(lengths), 8, 2, 128, lengths, max_seq_len, torch.float16, seed=max_seq_len)
    check_int8(case, ks, vs, num_splits=splits)


@pytest.mark.parametrize("value_scale", [1e-3, 1e3])
def test_activations_far_from_one(value_scale):
    """q, k and v far from 1 in bf16 (RELIABILITY row 18): the scales follow the values, q is
    brought to range by a power of two."""
    case, ks, vs = int8_case(2, 4, 2, 128, [40, 300], 320, torch.bfloat16, seed=5, value_scale=value_scale)
    case.qkv[:, : 4 * 128] *= 1e3  # q only
    check_int8(case, ks, vs)


@pytest.mark.parametrize("spread", [3.0, 6.0])
@pytest.mark.parametrize("splits", [1, 4])
def test_v_scales_over_orders_of_magnitude(spread, splits):
    """Tokens whose V scales differ by up to 10^12: the probabilities go to the V mma in units of
    the largest V scale so far (rescaled as it grows), in fp16's range whatever the scales."""
    case, ks, vs = int8_case(
        2, 8, 2, 128, [700, 1500], 1536, torch.float16, seed=int(spread), v_spread=spread
    )
    check_int8(case, ks, vs, num_splits=splits)


# TMA reads int8 caches only at head dims that are multiples of 128 (the op says so for 64).
LEAN_SOURCES = [("cp_async", 64), ("cp_async", 128), ("cp_async", 256), ("tma", 128), ("tma", 256)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(8, 8), (16, 4), (32, 4)], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source,head_dim", LEAN_SOURCES)
def test_lean_kernels_agree_with_the_others_bit_for_bit(dtype, head_dim, heads, splits, source):
    """A one-token int8 step with none of the features lean kernels leave out runs a lean unit's
    kernel (csrc/kernels/lean_kernels.h); the same step with every row's mode given (ROW_STEP, the
    same step) runs the kernel that has them all. Same output, lse, codes and scales, bit for bit,
    and the lean one matches the reference. Rows whose new token sits at a tile's first, last and a
    middle key, one empty, one filling the cache."""
    hq, hkv = heads
    lengths = [0, 63, 64, 100, 1000, 4095]
    case, ks, vs = int8_case(
        len(lengths), hq, hkv, head_dim, lengths, 4096, dtype, seed=head_dim + hq + splits
    )
    modes = torch.full((len(lengths),), ROW_STEP, dtype=torch.int32, device="cuda")
    kw = dict(num_splits=splits, tile_source=source)
    runs = []
    for row_active in (None, modes):
        names = launched_kernels(lambda r=row_active: run_kernel(case, ks, vs, row_active=r, **kw))
        kernels = [n for n in names if "decode_attention_kernel" in n]
        assert len(kernels) == 1 and lean_kernel_name(kernels[0]) == (row_active is None), names
        out, lse, got = run_kernel(case, ks, vs, row_active=row_active, **kw)
        runs.append((out, lse, *got))
    ref, ref_lse, want = run_reference_int8(case, ks, vs)
    assert_outputs_close(runs[0][0], runs[0][1], ref, ref_lse, dtype)
    assert_caches_as_reference(runs[0][2:], want, rotary=False)
    for what, a, b in zip(("out", "lse", "k cache", "v cache", "k scale", "v scale"), *runs, strict=True):
        assert_bits_equal(a, b, what)


def test_determinism_and_split_agreement():
    case, ks, vs = int8_case(2, 16, 4, 128, [1000, 2047], 2048, torch.bfloat16, seed=3)
    outs = [run_kernel(case, ks, vs, num_splits=s)[0] for s in (1, 4, 4, 16)]
    assert torch.equal(outs[1], outs[2]), "same split count not bit-identical"
    for o in outs[1:]:
        assert (o.float() - outs[0].float()).abs().max().item() <= 2e-2


@pytest.mark.parametrize("block_size", paging.BLOCK_SIZES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_pages_equal_contiguous_bit_for_bit(block_size, splits, source):
    """Rows whose new token sits at a block's first and last slot, one empty, one full: the paged
    step's output, lse, codes and scales equal the contiguous step's."""
    lengths = [0, block_size - 1, block_size, 3 * block_size + 5, 383, 511]
    case, ks, vs = int8_case(len(lengths), 8, 2, 128, lengths, 512, torch.float16, seed=block_size + splits)
    kp, vp, ksp, vsp, tables = to_pages(case, ks, vs, block_size, splits)
    common = dict(num_splits=splits, stages=2, return_lse=True, **case.kwargs())
    flat_out, flat_lse, (kc, vc, kcs, vcs) = run_kernel(case, ks, vs, tile_source="cp_async", num_splits=splits,
                                                        stages=2)  # fmt: skip
    out, lse = ops.decode_attention(
        case.qkv, kp, vp, case.lengths, k_scale=ksp, v_scale=vsp, block_tables=tables, tile_source=source, **common
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(out, flat_out) and torch.equal(lse, flat_lse)
    for row, n in enumerate(lengths):  # slots 0..n: the cache and the new token
        blocks = tables[row].tolist()
        gk, gv = layout.gather_k(kp, blocks), layout.gather_v(vp, blocks)
        gks = ksp[tables[row].long()].permute(1, 0, 2).reshape(ks.shape[1], -1)
        gvs = vsp[tables[row].long()].permute(1, 0, 2).reshape(vs.shape[1], -1)
        assert_bits_equal(gk[0, :, :, : n + 1], kc[row, :, :, : n + 1], "k pages")
        assert_bits_equal(gv[0, :, : n + 1], vc[row, :, : n + 1], "v pages")
        assert_bits_equal(gks[:, : n + 1], kcs[row, :, : n + 1], "k scale pages")
        assert_bits_equal(gvs[:, : n + 1], vcs[row, :, : n + 1], "v scale pages")


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_new_token_is_flagged(which, bad):
    """A row whose new k (or v) is not finite: its scale is stored non-finite (every later read of
    the token says so), its output is NaN, the workspace's check raises; other rows are unaffected."""
    case, ks, vs = int8_case(2, 8, 2, 128, [10, 100], 128, torch.float16)
    hq, hkv, d = 8, 2, 128
    col = (hq + (hkv if which == "v" else 0)) * d + 5
    case.qkv[1, col] = bad
    ws = ops.Workspace.allocate("cuda", 2, 8, 128, ops.dispatch.MAX_SPLITS)
    ref, _, want = run_reference_int8(case, ks, vs)
    out, _, got = run_kernel(case, ks, vs, workspace=ws)
    # The heads of the token's kv head are not finite, as the reference's; the rest is close.
    bad = ~torch.isfinite(ref)
    assert bad[1, : 4 * d].all() and not bad[0].any() and not bad[1, 4 * d :].any()
    assert torch.equal(~torch.isfinite(out), bad)
    err = (out.double() - ref.double())[~bad].abs().max().item()
    assert err <= FLOOR[torch.float16] * max(1.0, ref.double()[~bad].abs().max().item())
    stored = (got[2] if which == "k" else got[3])[1, 0, 100]
    assert not torch.isfinite(stored), "the token's scale says it is not finite"
    assert_bits_equal(
        got[3] if which == "k" else got[2], want[3] if which == "k" else want[2], "the other scales"
    )
    with pytest.raises(ops.ScaleError, match=r"rows \[1\]"):
        ws.check()
    ws.check()  # cleared


@pytest.mark.parametrize("q_scale", [0.02, 1.0])
def test_one_chain_over_a_long_row(q_scale):
    """32K keys in one item (no split), so the V sums run in one mma chain over the whole row; with a
    small q the weights are nearly flat and the output small (|out| ~ 0.02), so a bias in those sums
    shows against it rather than hiding under the FLOOR tolerance. The codes reach the V mma as
    1152 + code: the bias is taken off within the item (attend_tiles.cuh, flush_v_bias), else the
    chain's one-sided rounding at 1152 x the row's P sum leaves acc an error that grows with the
    row. The bound is int4's (test_int4_gpu.py)."""
    s, hq, d = 32768, 8, 128
    case, ks, vs = int8_case(1, hq, 2, d, [s], s + 64, torch.float16, seed=s)
    case.qkv[:, : hq * d].mul_(q_scale)
    ref, _, _ = run_reference_int8(case, ks, vs)
    out, _, _ = run_kernel(case, ks, vs, num_splits=1)
    err = (out.double() - ref.double()).abs().max().item()
    tol = 1e-4 + 1e-2 * ref.double().abs().max().item()
    assert err <= tol, f"max error {err:.3e} > {tol:.3e} over one chain of {s} keys"


@pytest.mark.parametrize("q_scale", [1e-30, 1e-3, 1e3, 1e25])
def test_q_at_every_magnitude(q_scale):
    """K's codes meet q in two int8 parts whose unit is the head's largest |q| / 127
    (attend_tiles.cuh, init_q8): outputs match the reference whatever q's size (bf16 activations),
    with one head's q 10^4 times smaller than its group's (a unit per head). At 1e-30 q reads as
    zero (its largest value under 2^-100), which leaves the softmax uniform, as the reference's."""
    hq, d = 8, 128
    case, ks, vs = int8_case(2, hq, 2, d, [40, 300], 384, torch.bfloat16, seed=3)
    q = case.qkv[:, : hq * d].view(2, hq, d)
    q.mul_(q_scale)
    q[:, 1].mul_(1e-4)
    check_int8(case, ks, vs)


def test_a_non_finite_q_value_makes_its_head_nan():
    """A NaN in one head's q: that head's output is NaN (as the reference's), every other head's
    and row's close."""
    hq, d = 8, 128
    case, ks, vs = int8_case(2, hq, 2, d, [10, 100], 128, torch.float16, seed=4)
    case.qkv[1, 3 * d + 7] = float("nan")
    ref, _, _ = run_reference_int8(case, ks, vs)
    out, _, _ = run_kernel(case, ks, vs)
    bad = ~torch.isfinite(ref)
    assert bad[1, 3 * d : 4 * d].all() and int(bad.sum()) == d
    assert torch.equal(~torch.isfinite(out), bad)
    err = (out.double() - ref.double())[~bad].abs().max().item()
    assert err <= FLOOR[torch.float16] * max(1.0, ref.double()[~bad].abs().max().item())


def test_argument_checks_name_the_argument():
    case, ks, vs = int8_case(1, 4, 2, 64, [3], 64, torch.float16)
    k0, v0 = case.clone_caches()
    kw = case.kwargs()

    def call(**over):
        args = dict(k_scale=ks, v_scale=vs)
        args.update(over)
        qkv = args.pop("qkv", case.qkv)
        return ops.decode_attention(qkv, case.k_cache, case.v_cache, case.lengths, **args, **kw)

    with pytest.raises(RuntimeError, match="k_scale must be given for an int8 cache"):
        call(k_scale=None)
    with pytest.raises(RuntimeError, match=r"v_scale must have shape \[1, 2, 64\]"):
        call(v_scale=vs[:, :1].clone())
    with pytest.raises(RuntimeError, match="k_scale must have dtype Float"):
        call(k_scale=ks.double())
    with pytest.raises(RuntimeError, match="v_scale must be a CUDA tensor"):
        call(v_scale=vs.cpu())
    with pytest.raises(ValueError, match="qkv must have dtype float16 or bfloat16 with a torch.int8"):
        call(qkv=case.qkv.float())
    with pytest.raises(RuntimeError, match=r"k_scale must have shape \[1, 2, 64\]"):
        parents = torch.tensor([[-1, 0]], dtype=torch.int32, device="cuda")
        qkv = torch.stack([case.qkv, case.qkv], 1)
        ops.decode_tree(
            qkv,
            case.k_cache,
            case.v_cache,
            case.lengths,
            parents,
            k_scale=ks[:, :1].clone(),
            v_scale=vs,
            **kw,
        )
    assert_bits_equal(case.k_cache, k0, "k_cache")
    assert_bits_equal(case.v_cache, v0, "v_cache")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kvcache_int8_steps_match_reference_and_graph_replay(dtype):
    """KVCache(kv_dtype=torch.int8) on the GPU against the same cache on the CPU (the reference
    path): prompts quantised per token, steps, then a CUDA-graph replay of a step."""
    torch.manual_seed(0)
    hq, hkv, d, layers = 8, 2, 128, 2
    kw = dict(kv_dtype=torch.int8, rotary_dim=d)
    cache = KVCache(layers, 3, 100, hq, hkv, d, dtype, "cuda", dispatch_on="capacity", **kw)
    ref = KVCache(layers, 3, 100, hq, hkv, d, dtype, "cpu", **kw)
    k = torch.randn(3, 20, hkv, d, dtype=dtype) * 3
    v = torch.randn(3, 20, hkv, d, dtype=dtype)
    for layer in range(layers):
        cache.prefill(layer, k.cuda(), v.cuda(), [20, 7, 1])
        ref.prefill(layer, k, v, [20, 7, 1])
    width = (hq + 2 * hkv) * d
    for _ in range(3):
        qkvs = [torch.randn(3, width, dtype=dtype) for _ in range(layers)]
        outs = [cache.step(i, q.cuda()) for i, q in enumerate(qkvs)]
        want = [ref.step(i, q) for i, q in enumerate(qkvs)]
        cache.advance()
        ref.advance()
        for o, w in zip(outs, want, strict=True):
            assert (o.cpu().double() - w.double()).abs().max().item() <= FLOOR[dtype] * max(
                1.0, w.abs().max().item()
            )
    cache.check()
    # A captured step replays to the eager step's result.
    qkv = torch.randn(3, width, dtype=dtype, device="cuda")
    eager = cache.step(0, qkv).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cache.step(0, qkv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
