"""Score modifiers on the GPU (sliding window, logit soft-cap, ALiBi, attention sinks): the kernel
against mmha.reference, alone and combined, on both loops, both tile sources, single pass and
split, fp8 caches, KVCache steps in CUDA graphs, the checks; the HF adapter's model families."""

from __future__ import annotations

import pytest
import torch
from fp8_cases import fp8_case, run_reference_fp8
from helpers import (
    DTYPES,
    FLOOR,
    assert_bits_equal,
    gpu,
    make_case,
)
from test_ops_gpu import check_case

from mmha import ops, spec
from mmha.cache import KVCache
from mmha.spec import AttentionSpec, Rotary

pytestmark = gpu

HQ, HKV = 8, 2


def mods_of(kind: str, hq: int = HQ, seed: int = 0) -> dict:
    """Modifier settings by name; tensors on the GPU."""
    g = torch.Generator().manual_seed(seed)
    slopes = spec.alibi_slopes(hq).cuda()
    custom = (torch.rand(hq, generator=g) * 0.6 - 0.1).cuda()  # some negative
    sinks = (torch.randn(hq, generator=g) * 3).cuda()
    return {
        "window": dict(window=40),
        "softcap": dict(softcap=5.0),
        "alibi": dict(alibi_slopes=slopes),
        "alibi_custom": dict(alibi_slopes=custom),
        "sinks": dict(sinks=sinks),
        "sinks_large": dict(sinks=torch.full((hq,), 1e4, device="cuda")),
        "sinks_very_negative": dict(sinks=torch.full((hq,), -1e4, device="cuda")),
        "all": dict(window=100, softcap=20.0, alibi_slopes=slopes, sinks=sinks),
    }[kind]


KINDS = ["window", "softcap", "alibi", "alibi_custom", "sinks", "sinks_large", "sinks_very_negative", "all"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_each_modifier_matches_reference(kind, dtype, splits):
    # Logits of ~10-30: the soft-cap bends them, ALiBi and sinks compete with them.
    case = make_case(4, HQ, HKV, 128, [0, 37, 300, 511], 512, dtype, seed=splits, value_scale=2.0,
                     bias=True, rotary_dim=64)  # fmt: skip
    case.mods = mods_of(kind, seed=splits)
    check_case(case, splits)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_every_head_dim(head_dim, dtype):
    case = make_case(3, HQ, HKV, head_dim, [5, 130, 255], 256, dtype, seed=head_dim, value_scale=1.5)
    case.mods = mods_of("all", seed=head_dim)
    check_case(case, 2)


@pytest.mark.parametrize("source", ["tma", "cp_async"])
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("window", [1, 2, 44, 45, 46, 63, 64, 65, 237, 301, 302, 512, 10**6])
def test_window_edges(source, splits, window):
    """Windows of 1, shorter than, equal to and longer than the rows; windows whose first slot is
    a tile's first key or one either side of it (row of 300: window 45 starts at 256, 237 at 64),
    and so on split boundaries too."""
    lengths = [0, 1, 63, 64, 127, 128, 300, 511]
    case = make_case(8, HQ, HKV, 128, lengths, 512, torch.float16, seed=window % 97 + splits)
    case.mods = dict(window=window)
    check_case(case, splits, tile_source=source)


@pytest.mark.parametrize("source", ["tma", "cp_async"])
def test_slots_before_the_window_are_never_used(source):
    """NaN and Inf in every slot before a row's window cannot reach its output."""
    lengths, window = [200, 300, 511], 70
    case = make_case(3, HQ, HKV, 128, lengths, 512, torch.float16, seed=3)
    expect_case = make_case(3, HQ, HKV, 128, lengths, 512, torch.float16, seed=3)
    case.mods = expect_case.mods = dict(window=window)
    for r, n in enumerate(lengths):  # slots 0 .. n - window: outside the window of the token at n
        case.k_cache[r, :, :, : n - window + 1] = float("nan")
        case.v_cache[r, :, : n - window + 1] = float("inf")
    out, _ = ops.decode_attention(case.qkv, case.k_cache, case.v_cache, case.lengths, tile_source=source,
                                  return_lse=True, **case.kwargs())  # fmt: skip
    expect = check_case(expect_case, tile_source=source)
    assert torch.equal(out, expect)


@pytest.mark.parametrize("softcap", [0.5, 50.0])
def test_softcap_with_large_logits(softcap):
    case = make_case(3, HQ, HKV, 128, [10, 200, 1000], 1024, torch.float16, seed=7, value_scale=6.0)
    case.mods = dict(softcap=softcap)
    check_case(case)


def test_fp8_cache_with_every_modifier():
    case, ks, vs = fp8_case(3, HQ, HKV, 128, [0, 130, 400], 512, torch.float16, seed=4)
    case.mods = mods_of("all", seed=4)
    for splits in (1, 3):
        c = fp8_case(3, HQ, HKV, 128, [0, 130, 400], 512, torch.float16, seed=4)[0]
        c.mods = case.mods
        ref, ref_lse, ref_k, ref_v = run_reference_fp8(c, ks, vs)
        out, lse = ops.decode_attention(c.qkv, c.k_cache, c.v_cache, c.lengths, num_splits=splits,
                                        return_lse=True, k_scale=ks, v_scale=vs, **c.kwargs())  # fmt: skip
        torch.cuda.synchronize()
        err = (out.double() - ref.double()).abs().max().item()
        assert err <= FLOOR[torch.float16] * max(1.0, ref.double().abs().max().item()), err
        lse_err = (lse.double() - ref_lse.double()).abs().max().item()
        assert lse_err <= 1e-3 * max(1.0, ref_lse.abs().max().item()), lse_err
        assert_bits_equal(c.v_cache, ref_v, "v_cache")


def test_without_modifiers_nothing_changes():
    """Modifiers at their off values (window past every row, no tensors) give the plain step's
    bits."""
    a = make_case(3, HQ, HKV, 128, [3, 100, 700], 1024, torch.float16, seed=9)
    b = make_case(3, HQ, HKV, 128, [3, 100, 700], 1024, torch.float16, seed=9)
    b.mods = dict(window=10**6)
    plain = ops.decode_attention(a.qkv, a.k_cache, a.v_cache, a.lengths, num_splits=2, **a.kwargs())
    wide = ops.decode_attention(b.qkv, b.k_cache, b.v_cache, b.lengths, num_splits=2, **b.kwargs())
    assert torch.equal(plain, wide)


# Built inside the test (collection must not touch CUDA on a machine without a GPU).
BAD = {
    "window 0": (lambda: dict(window=0), "window must be an int >= 1"),
    "softcap inf": (lambda: dict(softcap=float("inf")), "softcap must be a finite number > 0"),
    "slopes shape": (
        lambda: dict(alibi_slopes=torch.ones(3, device="cuda")),
        r"attention\.alibi_slopes must have shape \[8\]",
    ),
    "sinks on cpu": (lambda: dict(sinks=torch.ones(8)), "sinks must be on cuda"),
    "sinks nan": (lambda: dict(sinks=torch.full((8,), float("nan"), device="cuda")), "sinks must be finite"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_modifiers_are_named_and_nothing_is_written(bad):
    make, match = BAD[bad]
    case = make_case(2, HQ, HKV, 128, [3, 50], 128, torch.float16, seed=1)
    k0, v0 = case.clone_caches()
    case.mods = make()
    with pytest.raises(ValueError, match=match):  # refused where the spec is built, or by the op
        ops.decode_attention(case.qkv, case.k_cache, case.v_cache, case.lengths, **case.kwargs())
    assert_bits_equal(case.k_cache, k0, "k_cache")
    assert_bits_equal(case.v_cache, v0, "v_cache")


def test_raw_op_checks_name_the_argument():
    case = make_case(2, HQ, HKV, 128, [3, 50], 128, torch.float16, seed=1)
    ws = ops.Workspace.allocate("cuda", 2, HQ, 128, 1)
    out = torch.empty(2, HQ * 128, dtype=torch.float16, device="cuda")
    lse = torch.empty(2, HQ, device="cuda")

    def call(**kw):
        torch.ops.mmha.decode_attention(
            case.qkv, case.k_cache, case.v_cache, case.lengths, None, out, lse, ws.partials, ws.counters,
            ws.status, HQ, HKV, 0.1, 0, 1e4, False, 1, **kw,
        )  # fmt: skip

    with pytest.raises(RuntimeError, match="window must be >= 0"):
        call(window=-1)
    with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
        call(softcap=-1.0)
    with pytest.raises(RuntimeError, match="sinks must have dtype Float"):
        call(sinks=torch.ones(HQ, device="cuda", dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"alibi_slopes must have shape \[8\]"):
        call(alibi_slopes=torch.ones(4, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_kvcache_graph_replay_with_window_and_sinks(dtype):
    """A captured step with a window layer and a sinks layer replays as lengths grow past the
    window (capacity dispatch: the same plan, so the same bits as eager steps)."""
    layers, rows, d = 2, 3, 64
    width = (HQ + 2 * HKV) * d
    sinks = torch.randn(HQ, device="cuda")

    specs = [AttentionSpec(rotary=Rotary(d), window=32), AttentionSpec(rotary=Rotary(d), sinks=sinks)]

    def new_cache():
        c = KVCache(layers, rows, 300, HQ, HKV, d, dtype, "cuda", attention=specs, dispatch_on="capacity")
        g = torch.Generator(device="cpu").manual_seed(5)
        k = torch.randn(rows, 40, HKV, d, generator=g).to(dtype).cuda()
        for layer in range(layers):
            c.prefill(layer, k, k, [40, 3, 17])
        return c

    g = torch.Generator(device="cpu").manual_seed(6)
    qkvs = [torch.randn(rows, width, generator=g).to(dtype).cuda() for _ in range(80)]
    eager, graphed = new_cache(), new_cache()
    expect = []
    for qkv in qkvs:
        expect.append((eager.step(0, qkv), eager.step(1, qkv)))
        eager.advance()
    static = qkvs[0].clone()
    graphed.step(0, static)  # eager warm-up: sizes the workspace
    graphed.step(1, static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = (graphed.step(0, static), graphed.step(1, static))
        graphed.advance()
    for qkv, (a, b) in zip(qkvs, expect, strict=True):
        static.copy_(qkv)
        graph.replay()
        graphed.account_replay()
        assert torch.equal(outs[0], a) and torch.equal(outs[1], b)
    graphed.check()


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt-oss"])
def test_hf_families_on_the_gpu(family):
    """The HF adapter's families whose layers need modifiers (Mistral: a sliding window; Gemma 2:
    alternating windows, attention and final soft-caps; gpt-oss: sinks, alternating windows) on
    the kernel: fp32 greedy tokens equal the model's own generate(); fp16 has no decisive
    mismatch."""
    pytest.importorskip("transformers")
    from test_hf import check_matches_generate, check_no_decisive_mismatch

    from mmha.bench.families import build_family, hf_greedy, prompts
    from mmha.hf import HFDecoder

    check_matches_generate(build_family(family, "cuda", torch.float32), 32)  # gpt-oss: sinks spread
    model = build_family(family, "cuda", torch.float16)
    ps = prompts(model.config.vocab_size)
    dec = HFDecoder(model, len(ps), 128)
    got = dec.generate(ps, 32, eos_token_id=[])
    for p, ours in zip(ps, got, strict=True):
        check_no_decisive_mismatch(model, p, ours, hf_greedy(model, p, 32))
    if dec.graphs:  # a second bucket's graph shares the workspace sized for every bucket and window
        (one,) = dec.generate(ps[:1], 16, eos_token_id=[])
        check_no_decisive_mismatch(model, ps[0], one, hf_greedy(model, ps[0], 16))
        assert sorted(dec._graphs) == [1, 4]
