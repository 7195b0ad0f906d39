"""The output epilogue's definition (mmha.epilogue) and its use by mmha.reference and KVCache on the
CPU path: rounding modes and bounds on ties, NaN and infinities, e4m3 saturation, shift / smooth
alone, every bad argument named, a rejected step leaving the cache as it was."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import make_case

from mmha import reference
from mmha.cache import KVCache
from mmha.epilogue import FP8, OutEpilogue
from mmha.spec import AttentionSpec

NAN, INF = float("nan"), float("inf")
X = torch.tensor(
    [0.5, -0.5, 1.5, 2.5, -2.5, 0.49999997, -1.4999999, 126.5, 127.5, -127.5, -128.5, 1e9, NAN, INF, -INF]
)


@pytest.mark.parametrize(
    ("rounding", "min_bound", "want"),
    [
        ("half_even", -127, [0, 0, 2, 2, -2, 0, -1, 126, 127, -127, -127, 127, 0, 127, -127]),
        ("half_away", -127, [1, -1, 2, 3, -3, 0, -1, 127, 127, -127, -127, 127, 0, 127, -127]),
        ("half_even", -128, [0, 0, 2, 2, -2, 0, -1, 126, 127, -128, -128, 127, 0, 127, -128]),
        ("half_away", -128, [1, -1, 2, 3, -3, 0, -1, 127, 127, -128, -128, 127, 0, 127, -128]),
    ],
)
def test_int8_rounding_and_bounds(rounding, min_bound, want):
    e = OutEpilogue(scale=1.0, rounding=rounding, min_bound=min_bound)
    got = e.apply(X, torch.float16)
    assert got.dtype == torch.int8
    assert got.tolist() == want


def test_e4m3_saturates_and_keeps_nan():
    e = OutEpilogue(scale=2.0, dtype=FP8)
    got = e.apply(torch.tensor([1.0, -300.0, 1e9, -INF, NAN, 0.0703125]), torch.bfloat16)
    assert got.dtype == FP8
    f = got.float()
    assert f[:4].tolist() == [2.0, -448.0, 448.0, -448.0]
    assert torch.isnan(f[4]) and f[5].item() == 0.140625


def test_order_of_operations_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(64, dtype=torch.float64) * 3
    shift, smooth, scales = torch.randn(64), torch.rand(64) + 0.5, torch.rand(64) * 40 + 1
    e = OutEpilogue(shift, smooth, scales)
    y = ((x.float() + shift) * smooth) * scales  # one fp32 rounding per step
    assert torch.equal(e.apply(x, torch.float16), y.round().clamp(-127, 127).to(torch.int8))
    plain = OutEpilogue(shift=shift)  # no scale: the activations' dtype
    assert plain.apply(x, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(plain.apply(x, torch.bfloat16), (x.float() + shift).to(torch.bfloat16))
    assert OutEpilogue(smooth=smooth).out_dtype(torch.float16) == torch.float16
    assert OutEpilogue(scale=3.0, dtype=FP8).out_dtype(torch.float16) == FP8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "at least one of shift, smooth and scale"),
        (dict(scale=0.0), "scale must be finite and positive"),
        (dict(scale=-1.0), "scale must be finite and positive"),
        (dict(scale=INF), "scale must be finite and positive"),
        (dict(scale=1e-50), "scale must be finite and positive in fp32"),
        (dict(scale=True), "scale must be a float"),
        (dict(scale=torch.tensor([1.0, 0.0])), "scale must be positive"),
        (dict(scale=torch.tensor([1.0, NAN])), "scale must be finite"),
        (dict(shift=torch.tensor([1.0, INF])), "shift must be finite"),
        (dict(shift=torch.ones(4, dtype=torch.float16)), "shift must be a 1-D float32 tensor"),
        (dict(smooth=torch.ones(2, 2)), "smooth must be a 1-D float32 tensor"),
        (dict(shift=torch.ones(4), smooth=torch.ones(5)), "smooth must have the other tensors' shape"),
        (dict(smooth=torch.ones(8)[::2]), "smooth must be contiguous"),
        (dict(scale=1.0, dtype=torch.float16), "dtype must be torch.int8 or torch.float8_e4m3fn"),
        (dict(scale=1.0, rounding="up"), "rounding must be one of"),
        (dict(scale=1.0, min_bound=-126), "min_bound must be -127 or -128"),
        (dict(scale=1.0, dtype=FP8, rounding="half_away"), "rounding and min_bound must keep their defaults"),
        (dict(scale=1.0, dtype=FP8, min_bound=-128), "rounding and min_bound must keep their defaults"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OutEpilogue(**kwargs)


def test_check_for_names_the_layer_shape():
    e = OutEpilogue(shift=torch.zeros(256))
    e.check_for(4, 64, "cpu")
    with pytest.raises(ValueError, match=r"shape \[num_heads \* head_dim = 512\], got \[256\]"):
        e.check_for(8, 64, "cpu")


def _quiet_cache(**kw) -> KVCache:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KVCache(device="cpu", **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_step_is_the_epilogue_of_the_plain_step(dtype):
    case = make_case(3, 4, 2, 64, [0, 5, 17], 24, dtype, device="cpu", seed=3)
    g = torch.Generator().manual_seed(4)
    e = OutEpilogue(
        torch.randn(256, generator=g), torch.rand(256, generator=g) + 0.5, 25.0, rounding="half_away"
    )
    runs = []
    for epilogue in (None, e):
        kc, vc = case.clone_caches()
        runs.append(
            reference.decode_step(
                case.qkv, kc, vc, case.lengths, return_lse=True, **case.kwargs(epilogue=epilogue)
            )
        )
    (plain, lse), (quant, lse_q) = runs
    assert quant.dtype == torch.int8 and torch.equal(lse, lse_q)
    if dtype == torch.float32:  # the plain output is the epilogue's input exactly
        assert torch.equal(quant, e.apply(plain, dtype))
    else:  # the plain output is x rounded to fp16: at most one step apart
        assert (quant.int() - e.apply(plain, dtype).int()).abs().max().item() <= 1


def test_reference_tree_applies_to_every_node():
    case = make_case(2, 2, 1, 32, [4, 9], 32, torch.float32, device="cpu", seed=5)
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]], dtype=torch.int32)
    qkv = torch.randn(2, 4, case.qkv.shape[1], generator=torch.Generator().manual_seed(6))
    e = OutEpilogue(shift=torch.full((64,), 0.25), scale=torch.full((64,), 30.0))
    outs = []
    for epilogue in (None, e):
        kc, vc = case.clone_caches()
        outs.append(
            reference.decode_tree(
                qkv, kc, vc, case.lengths, parents, num_heads=2, num_kv_heads=1, node_counts=[4, 2],
                attention=AttentionSpec(epilogue=epilogue),
            )
        )  # fmt: skip
    assert torch.equal(outs[1], e.apply(outs[0], torch.float32))
    assert (outs[1][1, 2:] == round(0.25 * 30)).all()  # nodes the row does not use: epilogue(0)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_step_with_epilogue_and_rejected_step(paged):
    kw = dict(num_layers=2, max_batch=2, max_seq_len=64, num_heads=4, num_kv_heads=2, head_dim=32)
    if paged:
        kw.update(paged=True, block_size=16)
    g = torch.Generator().manual_seed(7)
    e = [
        OutEpilogue(torch.randn(128, generator=g), scale=20.0),
        OutEpilogue(smooth=torch.rand(128, generator=g)),
    ]
    specs = [AttentionSpec(epilogue=x) for x in e]
    cache, twin = (
        _quiet_cache(dtype=torch.float32, attention=specs, **kw),
        _quiet_cache(dtype=torch.float32, **kw),
    )
    for _ in range(3):
        qkv = torch.randn(2, 256, generator=g)
        for layer in range(2):
            out = cache.step(layer, qkv)
            plain = twin.step(layer, qkv)
            assert torch.equal(out, e[layer].apply(plain, torch.float32))
        cache.advance()
        twin.advance()
    before = [t.clone() for t in (*cache.k_caches, *cache.v_caches, cache.lengths)]
    with pytest.raises(ValueError, match=r"qkv must have shape \[B, \(num_heads \+ 2 \* num_kv_heads\)"):
        cache.step(1, torch.randn(2, 255))
    after = [*cache.k_caches, *cache.v_caches, cache.lengths]
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after, strict=True)
    )
    bad = AttentionSpec(epilogue=OutEpilogue(shift=torch.zeros(64)))
    with pytest.raises(
        ValueError,
        match=r"attention\[1\]\.epilogue tensors must have shape \[num_heads \* head_dim = 128\], got \[64\]",
    ):
        _quiet_cache(dtype=torch.float32, attention=[specs[0], bad], **kw)
    with pytest.raises(ValueError, match="epilogue must be a mmha.epilogue.OutEpilogue or None, got float"):
        AttentionSpec(epilogue=20.0)
