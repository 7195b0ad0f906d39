"""The output epilogue in the kernel (csrc/kernels/output_epilogue.cuh) against its definition
(mmha.epilogue): bit for bit where the epilogue's fp32 input is observable (fp32 activations: the
plain step's output is that input), and against mmha.reference otherwise, where a quantised value
may be one step off only where the reference value lies within the attention tolerance of a
rounding boundary (such elements are counted). Every rounding mode and bound, int8 and e4m3,
shift / smooth alone, per-channel scales, single pass and split, every head dim, fp8 caches, both
tile sources, tree steps, paged caches and rows that take no part, refused rows, bad arguments
(named, nothing written), CUDA graphs and torch.compile."""

from __future__ import annotations

import pytest
import torch
from fp8_cases import fp8_case
from helpers import FLOOR, assert_bits_equal, gpu, make_case

from mmha import ops, reference
from mmha.cache import KVCache
from mmha.epilogue import FP8, OutEpilogue
from mmha.spec import AttentionSpec

pytestmark = gpu

HQ, HKV = 8, 2


def epilogues(channels: int, seed: int = 0) -> dict[str, OutEpilogue]:
    """One epilogue of each kind for ``channels`` output channels."""
    g = torch.Generator().manual_seed(seed)
    shift = (torch.randn(channels, generator=g) * 0.3).cuda()
    smooth = (torch.rand(channels, generator=g) + 0.5).cuda()
    scales = (torch.rand(channels, generator=g) * 60 + 20).cuda()
    return {
        "int8_even_127": OutEpilogue(shift, smooth, 40.0),
        "int8_away_128": OutEpilogue(shift, smooth, 40.0, rounding="half_away", min_bound=-128),
        "int8_scales_only": OutEpilogue(scale=scales, rounding="half_away"),
        "int8_saturating": OutEpilogue(smooth=smooth, scale=400.0, min_bound=-128),
        "e4m3": OutEpilogue(shift, smooth, 40.0, dtype=FP8),
        "shift_smooth": OutEpilogue(shift, smooth),
        "shift_only": OutEpilogue(shift=shift),
    }


KINDS = [
    "int8_even_127",
    "int8_away_128",
    "int8_scales_only",
    "int8_saturating",
    "e4m3",
    "shift_smooth",
    "shift_only",
]


def step(case, epilogue=None, **kw):
    """One kernel step on fresh copies of the case's caches: out, lse, caches."""
    kc, vc = case.clone_caches()
    out, lse = ops.decode_attention(
        case.qkv, kc, vc, case.lengths, return_lse=True, **case.kwargs(epilogue=epilogue), **kw
    )
    torch.cuda.synchronize()
    return out, lse, kc, vc


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp32_bit_for_bit_with_the_definition(kind, splits, head_dim):
    case = make_case(3, HQ, HKV, head_dim, [0, 77, 300], 320, torch.float32, seed=splits, rotary_dim=32)
    e = epilogues(HQ * head_dim, seed=head_dim)[kind]
    plain, lse, kc, vc = step(case, num_splits=splits)
    got, got_lse, gk, gv = step(case, e, num_splits=splits)
    assert got.dtype == e.out_dtype(torch.float32)
    assert_bits_equal(got, e.apply(plain, torch.float32), f"{kind} output")
    assert torch.equal(lse, got_lse)
    assert_bits_equal(gk, kc, "k_cache")
    assert_bits_equal(gv, vc, "v_cache")


def reference_x(case, scales=None) -> torch.Tensor:
    """The attention output of the case in float64, rounded to fp32 (the epilogue's input): the
    case's 16-bit inputs widened exactly (no bias or rotary, so the new token is the same)."""
    kc, vc = case.clone_caches()
    if kc.dtype != FP8:
        kc, vc = kc.float(), vc.float()
    extra = dict(k_scale=scales[0], v_scale=scales[1]) if scales else {}
    return reference.decode_step(
        case.qkv.float(), kc, vc, case.lengths, compute_dtype=torch.float64, **case.kwargs(), **extra
    )


def tolerance(case, x_ref: torch.Tensor, **kw) -> float:
    """The attention tolerance of the case's dtype (helpers.check_against_reference's rule)."""
    low = reference.decode_step(case.qkv, *case.clone_caches(), case.lengths, **case.kwargs(), **kw)
    base = (low.double() - x_ref.double()).abs().max().item()
    return 2 * base + FLOOR[case.qkv.dtype] * max(1.0, x_ref.abs().max().item())


def check_quantised(got: torch.Tensor, x_ref: torch.Tensor, e: OutEpilogue, dtype, tol: float) -> int:
    """``got`` against ``e`` of the reference: equal, or one step apart where the reference's
    pre-rounding value lies within ``tol`` (in x) of a rounding boundary. Returns the count of
    elements one step apart."""
    want = e.apply(x_ref, dtype)
    assert got.dtype == want.dtype
    if not e.quantised:
        per = tol * (e.smooth.abs() if e.smooth is not None else 1.0)
        err = (got.float() - want.float()).abs()
        limit = per + 2 * want.float().abs() * torch.finfo(dtype).eps  # plus one rounding of y
        assert (err <= limit).all(), f"max error {(err - limit).max().item():.3e} past the tolerance"
        return 0
    gain = e.smooth.abs() if e.smooth is not None else torch.ones_like(x_ref)
    gain = gain * (e.scale if isinstance(e.scale, torch.Tensor) else torch.full_like(x_ref, e.scale))
    y = x_ref.float()
    if e.shift is not None:
        y = y + e.shift
    if e.smooth is not None:
        y = y * e.smooth
    y = y * (e.scale if isinstance(e.scale, torch.Tensor) else e.scale)
    slack = tol * gain
    if e.dtype == FP8:
        a, b = got.float(), want.float()
        off = a != b
        # one e4m3 step (3 mantissa bits) where y is within the slack of another value
        assert (((a - b).abs() <= b.abs() / 8 + 2**-9) | ~off).all()
        assert ((y - a).abs() <= (y - b).abs() + slack + 2**-9)[off].all()
        return int(off.sum())
    diff = got.int() - want.int()
    assert diff.abs().max().item() <= 1, f"quantised values {diff.abs().max().item()} steps apart"
    off = diff != 0
    near = ((y - y.floor() - 0.5).abs() <= slack) | (y.abs() >= 126)  # a boundary within reach
    assert near[off].all(), f"{int((off & ~near).sum())} values one step apart far from a rounding boundary"
    return int(off.sum())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("splits", [1, 4])
def test_tiles_against_reference(kind, dtype, head_dim, splits, record_property):
    case = make_case(3, HQ, HKV, head_dim, [1, 150, 400], 416, dtype, seed=head_dim + splits)
    e = epilogues(HQ * head_dim, seed=head_dim)[kind]
    got, _, _, _ = step(case, e, num_splits=splits)
    x_ref = reference_x(case)
    off = check_quantised(got, x_ref, e, dtype, tolerance(case, x_ref))
    record_property("one_step_apart", off)
    assert off <= 0.05 * got.numel()


@pytest.mark.parametrize("kind", ["int8_even_127", "int8_scales_only", "shift_smooth"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_every_column_block(kind, group, splits, source):
    # The epilogue's kernels per group of query heads: 1 column (MHA), 4 (groups 2-4), 8 (5-8; 16
    # takes two items of 8), each item's channels those of its own heads.
    hkv = 2
    case = make_case(3, group * hkv, hkv, 128, [5, 130, 257], 288, torch.float16, seed=group + 10 * splits)
    e = epilogues(group * hkv * 128, seed=group)[kind]
    got, _, _, _ = step(case, e, num_splits=splits, tile_source=source)
    x_ref = reference_x(case)
    off = check_quantised(got, x_ref, e, torch.float16, tolerance(case, x_ref))
    assert off <= 0.05 * got.numel()


@pytest.mark.parametrize("kind", ["int8_even_127", "int8_away_128", "e4m3", "shift_smooth"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_fp8_caches(kind, head_dim, splits, source):
    if source == "tma" and head_dim % 128:
        pytest.skip("bulk tensor copies of fp8 caches need head_dim a multiple of 128")
    case, k_scale, v_scale = fp8_case(2, HQ, HKV, head_dim, [90, 333], 352, torch.float16, seed=head_dim)
    scales = (k_scale, v_scale)
    e = epilogues(HQ * head_dim, seed=1)[kind]
    kc, vc = case.clone_caches()
    got = ops.decode_attention(
        case.qkv, kc, vc, case.lengths, num_splits=splits, tile_source=source,
        k_scale=scales[0], v_scale=scales[1], **case.kwargs(epilogue=e),
    )  # fmt: skip
    plain = ops.decode_attention(
        case.qkv, *case.clone_caches(), case.lengths, num_splits=splits, tile_source=source,
        k_scale=scales[0], v_scale=scales[1], **case.kwargs(),
    )  # fmt: skip
    x_ref = reference_x(case, scales)
    tol = 2 * (plain.double() - x_ref.double()).abs().max().item() + 2e-3 * max(1.0, x_ref.abs().max().item())
    check_quantised(got, x_ref, e, torch.float16, tol)


@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_tile_sources_give_the_same_bits(source):
    case = make_case(4, 32, 8, 128, [0, 63, 64, 1000], 1024, torch.bfloat16, seed=9)
    e = epilogues(32 * 128)["int8_away_128"]
    a = step(case, e, num_splits=2, tile_source="cp_async")[0]
    b = step(case, e, num_splits=2, tile_source=source)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["int8_even_127", "e4m3", "shift_smooth"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("nodes", [4, 16])
def test_tree_steps(kind, dtype, nodes):
    """Every node's output through the epilogue, nodes past a row's count included (epilogue of
    zero); fp32: bit for bit with the plain tree step's output, 16 bits: the plain step rounded."""
    case = make_case(3, HQ, HKV, 64, [0, 40, 200], 256, dtype, seed=nodes)
    g = torch.Generator().manual_seed(nodes)
    trees = [[-1] + [int(torch.randint(-1, t, (1,), generator=g)) for t in range(1, nodes)] for _ in range(3)]
    parents = torch.tensor(trees, dtype=torch.int32, device="cuda")
    counts = torch.tensor([nodes, nodes // 2, 1], dtype=torch.int32, device="cuda")
    qkv = torch.randn(3, nodes, case.qkv.shape[1], generator=g).to(dtype).cuda()
    e = epilogues(HQ * 64, seed=2)[kind]
    outs = []
    for epilogue in (None, e):
        kc, vc = case.clone_caches()
        outs.append(
            ops.decode_tree(
                qkv, kc, vc, case.lengths, parents, num_heads=HQ, num_kv_heads=HKV, node_counts=counts,
                attention=AttentionSpec(epilogue=epilogue),
            )
        )  # fmt: skip
    plain, got = outs
    zero = e.apply(torch.zeros(HQ * 64, device="cuda"), dtype)
    assert torch.equal(got[2, 1:].view(torch.uint8), zero.expand(nodes - 1, -1).view(torch.uint8))
    if dtype == torch.float32:
        assert_bits_equal(got, e.apply(plain, dtype), "tree output")
    elif e.quantised:
        assert (got.float() - e.apply(plain, dtype).float()).abs().max().item() <= (
            1 if e.dtype == torch.int8 else 0.125 * got.float().abs().max().item()
        )


def test_refused_and_idle_rows():
    """A refused row (length out of range, validation off) gives int8 0 (e4m3: NaN) and its flag;
    a row that takes no part gives the epilogue of zero; the other rows as usual."""
    case = make_case(3, HQ, HKV, 64, [5, 10, 20], 32, torch.float16, seed=4)
    bad = case.lengths.clone()
    bad[1] = 32
    for kind, refused in (("int8_away_128", 0.0), ("e4m3", float("nan"))):
        e = epilogues(HQ * 64)[kind]
        ws = ops.Workspace.allocate("cuda", 3, HQ, 64, 1)
        kc, vc = case.clone_caches()
        got = ops.decode_attention(
            case.qkv, kc, vc, bad, workspace=ws, validate_lengths=False, num_splits=1,
            row_active=torch.tensor([1, 1, 0], dtype=torch.int32, device="cuda"), **case.kwargs(epilogue=e),
        )  # fmt: skip
        with pytest.raises(ops.LengthError):
            ws.check()
        f = got[1].float()
        assert (torch.isnan(f) if refused != refused else f == refused).all()
        zero = e.apply(torch.zeros(HQ * 64, device="cuda"), torch.float16)
        assert torch.equal(got[2].view(torch.uint8), zero.view(torch.uint8))
        ok = step(case, e, num_splits=1)[0]  # the same rows, all valid and taking part
        assert torch.equal(got[0].view(torch.uint8), ok[0].view(torch.uint8))


def test_paged_equals_contiguous():
    from test_paging_gpu import to_pages

    case = make_case(3, HQ, HKV, 128, [17, 100, 250], 256, torch.float16, seed=6)
    e = epilogues(HQ * 128)["int8_even_127"]
    kp, vp, tables = to_pages(case.k_cache, case.v_cache, 16, seed=1)
    for splits in (1, 3):
        flat = step(case, e, num_splits=splits, tile_source="cp_async")[0]
        paged = ops.decode_attention(
            case.qkv, kp.clone(), vp.clone(), case.lengths, block_tables=tables, num_splits=splits,
            tile_source="cp_async", **case.kwargs(epilogue=e),
        )  # fmt: skip
        assert torch.equal(flat, paged)


RAW = dict(
    num_heads=HQ, num_kv_heads=HKV, scale=0.125, rotary_dim=0, rotary_theta=1e4, rotary_interleaved=False
)


@pytest.mark.parametrize(
    ("out_dtype", "kwargs", "match"),
    [
        (torch.int8, {}, "out must have dtype Half, or int8 / float8_e4m3fn with out_scale"),
        (torch.int8, dict(out_scale=2.0, out_scales="t"), "out_scale and out_scales must not both be given"),
        (
            torch.float16,
            dict(out_scale=2.0),
            "out_scale and out_scales must be unset unless out has dtype int8",
        ),
        (torch.int8, dict(out_scales="short"), r"out_scales must have shape \[512\]"),
        (torch.int8, dict(out_scale=-1.0), "out_scale must be finite and > 0"),
        (torch.int8, dict(out_scale=float("inf")), "out_scale must be finite and > 0"),
        (torch.int8, dict(out_scale=1e-50), "out_scale must be finite and > 0 in fp32"),
        (torch.int8, dict(out_scale=2.0, out_round=2), "out_round must be 0 .* or 1"),
        (torch.int8, dict(out_scale=2.0, out_min=-100), "out_min must be -127 or -128"),
        (
            FP8,
            dict(out_scale=2.0, out_round=1),
            "out_round and out_min must be 0 and -127 for a float8_e4m3fn",
        ),
        (torch.float16, dict(out_shift="half"), "out_shift must have dtype Float"),
        (torch.float16, dict(out_smooth="cpu"), "out_smooth must be a CUDA tensor"),
        (torch.bfloat16, {}, "out must have dtype Half"),
    ],
)
def test_raw_operator_names_bad_arguments_and_writes_nothing(out_dtype, kwargs, match):
    case = make_case(2, HQ, HKV, 64, [3, 9], 16, torch.float16, seed=1)
    tensors = {
        "t": torch.ones(512, device="cuda"),
        "short": torch.ones(256, device="cuda"),
        "half": torch.ones(512, device="cuda", dtype=torch.float16),
        "cpu": torch.ones(512),
    }
    kwargs = {k: tensors.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    kc, vc = case.clone_caches()
    out = torch.full((2, 512), 7, device="cuda").to(out_dtype)
    lse = torch.full((2, HQ), 7.0, device="cuda")
    ws = ops.Workspace.allocate("cuda", 2, HQ, 64, 1)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mmha.decode_attention(
            case.qkv, kc, vc, case.lengths, None, out, lse, ws.partials, ws.counters, ws.status, **RAW,
            num_splits=1, **kwargs,
        )  # fmt: skip
    torch.cuda.synchronize()
    assert_bits_equal(kc, case.k_cache, "k_cache")
    assert_bits_equal(vc, case.v_cache, "v_cache")
    assert (out.float() == 7).all() and (lse == 7).all()


def test_ops_checks_the_epilogue_fits_the_step():
    case = make_case(2, HQ, HKV, 64, [3, 9], 16, torch.float16, seed=1)
    kc, vc = case.clone_caches()
    with pytest.raises(ValueError, match=r"num_heads \* head_dim = 512\], got \[256\]"):
        ops.decode_attention(
            case.qkv,
            kc,
            vc,
            case.lengths,
            **case.kwargs(epilogue=OutEpilogue(torch.zeros(256, device="cuda"))),
        )
    with pytest.raises(ValueError, match="attention.epilogue tensors must be on cuda"):
        ops.decode_attention(
            case.qkv, kc, vc, case.lengths, **case.kwargs(epilogue=OutEpilogue(torch.zeros(512)))
        )
    assert_bits_equal(kc, case.k_cache, "k_cache")


def test_kvcache_graph_replay():
    """KVCache steps with a per-layer epilogue captured in a CUDA graph (advance included) and
    replayed: equal to eager steps of a twin cache."""
    layers, b, width = 2, 3, (HQ + 2 * HKV) * 64
    kw = dict(num_layers=layers, max_batch=b, max_seq_len=512, num_heads=HQ, num_kv_heads=HKV, head_dim=64)
    e = [epilogues(HQ * 64, seed=5)["int8_away_128"], epilogues(HQ * 64, seed=6)["e4m3"]]
    kw.update(attention=[AttentionSpec(epilogue=x) for x in e], dtype=torch.float16)
    graphed, eager = KVCache(**kw), KVCache(**kw)
    static = torch.zeros(layers, b, width, device="cuda", dtype=torch.float16)

    def run(cache, qkv):
        outs = [cache.step(layer, qkv[layer]) for layer in range(layers)]
        cache.advance()
        return outs

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (workspace); its writes are rewritten by the first replay
        for layer in range(layers):
            graphed.step(layer, static[layer])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(graphed, static)
    g = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(6):
        qkv = torch.randn(layers, b, width, generator=g, device="cuda").to(torch.float16)
        static.copy_(qkv)
        graph.replay()
        graphed.account_replay()
        want = run(eager, qkv)
        for layer in range(layers):
            assert outs[layer].dtype == want[layer].dtype == e[layer].dtype
            assert torch.equal(outs[layer].view(torch.uint8), want[layer].view(torch.uint8))
    assert graphed.host_lengths == eager.host_lengths == [6] * b


def test_torch_compile_fullgraph():
    case = make_case(3, HQ, HKV, 64, [5, 300, 17], 320, torch.float16, seed=8)
    spec = AttentionSpec(epilogue=epilogues(HQ * 64)["int8_even_127"])

    def fn(qkv, k_cache, v_cache, lengths):
        return ops.decode_attention(
            qkv, k_cache, v_cache, lengths, num_heads=HQ, num_kv_heads=HKV, num_splits=2, attention=spec,
            validate_lengths=False,
        )  # fmt: skip

    expect = fn(case.qkv, *case.clone_caches(), case.lengths)
    got = torch.compile(fn, fullgraph=True)(case.qkv, *case.clone_caches(), case.lengths)
    assert got.dtype == torch.int8 and torch.equal(got, expect)
