"""KVCache on a GPU: multi-step decoding vs the reference, CUDA graphs, torch.compile
(RELIABILITY.md rows 22, 24, 26)."""

from __future__ import annotations

import pytest
import torch
from helpers import check_against_reference, gpu, make_case

from mmha import KVCache, ops, reference

pytestmark = gpu

LAYERS, HQ, HKV, D = 2, 8, 2, 128
WIDTH = (HQ + 2 * HKV) * D


def new_cache(max_batch=4, max_seq_len=2048, dtype=torch.float16, **kw):
    return KVCache(LAYERS, max_batch, max_seq_len, HQ, HKV, D, dtype, "cuda", rotary_dim=D, **kw)


def prefill_random(cache, lengths, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = max(lengths)
    for layer in range(cache.num_layers):
        k = torch.randn(len(lengths), s, HKV, D, generator=g, device="cuda").to(cache.dtype)
        v = torch.randn(len(lengths), s, HKV, D, generator=g, device="cuda").to(cache.dtype)
        cache.prefill(layer, k, v, lengths)


def mirror(cache):
    return [c.clone() for c in cache.k_caches], [c.clone() for c in cache.v_caches]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_steps_match_reference(dtype):
    cache = new_cache(dtype=dtype)
    lengths = [3, 100, 0, 700]
    prefill_random(cache, lengths)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _step in range(40):
        ks, vs = mirror(cache)
        lens = cache.lengths.clone()
        for layer in range(LAYERS):
            qkv = torch.randn(4, WIDTH, generator=g, device="cuda").to(dtype)
            out = cache.step(layer, qkv)
            ref = reference.decode_step(
                qkv,
                ks[layer],
                vs[layer],
                lens,
                num_heads=HQ,
                num_kv_heads=HKV,
                attention=cache.attention[layer],
            )
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
        cache.advance()
    assert cache.host_lengths == [n + 40 for n in lengths]
    assert cache.lengths.tolist() == cache.host_lengths


def test_capacity_rounded_up_for_bulk_copies_and_device_guard_checked():
    # GPU caches hold max_seq_len rounded up to 64 slots; a device length pushed out of range
    # behind the cache's back writes nothing, gives NaN, and check() names the row once.
    cache = new_cache(max_seq_len=1000)
    assert cache.capacity == 1024 and cache.k_caches[0].shape[3] == 1024
    prefill_random(cache, [5, 10, 20, 30])
    cache.lengths[1] = cache.capacity  # past every slot the kernel may touch
    ks, vs = mirror(cache)
    qkv = torch.randn(4, WIDTH, device="cuda", dtype=torch.float16)
    out = cache.step(0, qkv)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3]]).all()
    for row, pos in ((0, 5), (2, 20), (3, 30)):
        ks[0][row, :, :, pos] = cache.k_caches[0][row, :, :, pos]
        vs[0][row, :, pos] = cache.v_caches[0][row, :, pos]
    assert torch.equal(cache.k_caches[0].view(torch.uint8), ks[0].view(torch.uint8))
    assert torch.equal(cache.v_caches[0].view(torch.uint8), vs[0].view(torch.uint8))
    with pytest.raises(ops.LengthError, match=r"lengths of rows \[1\] were outside"):
        cache.check()
    cache.check()  # the flag is cleared


def test_no_host_sync_in_step_and_advance():
    cache = new_cache()
    prefill_random(cache, [10, 20, 30, 40])
    qkv = torch.randn(4, WIDTH, device="cuda", dtype=torch.float16)
    cache.step(0, qkv)  # first step allocates the workspace
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(LAYERS):
            cache.step(layer, qkv)
        cache.advance()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _capture_step(cache, static_qkv):
    outs = []
    for layer in range(LAYERS):
        outs.append(cache.step(layer, static_qkv[layer]))
    cache.advance()
    return outs


@pytest.mark.parametrize("dispatch_on", ["capacity", "length"])
def test_cuda_graph_replay_matches_eager_across_threshold(dispatch_on):
    # Rows start short (single pass under "length" dispatch at capture: 401 keys, under two
    # 256-key tensor-core splits) and grow past the split threshold during replay (700 keys);
    # the captured kernel must stay right for every length.
    lengths = [1, 5, 260, 400]
    cache = new_cache(max_seq_len=1024, dispatch_on=dispatch_on)
    eager = new_cache(max_seq_len=1024, dispatch_on=dispatch_on)
    prefill_random(cache, lengths, seed=3)
    prefill_random(eager, lengths, seed=3)
    static_qkv = torch.zeros(LAYERS, 4, WIDTH, device="cuda", dtype=torch.float16)
    # Warm up on a side stream (allocates the workspace). Without advance() the warm-up only
    # wrote the slots that the first replay writes again.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for layer in range(LAYERS):
            cache.step(layer, static_qkv[layer])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outs = _capture_step(cache, static_qkv)
    assert cache.host_lengths == lengths  # capture recorded the step but did not run it
    g = torch.Generator(device="cuda").manual_seed(5)
    for _step in range(300):
        qkv = torch.randn(LAYERS, 4, WIDTH, generator=g, device="cuda").to(torch.float16)
        static_qkv.copy_(qkv)
        graph.replay()
        cache.account_replay()
        expect = _capture_step(eager, qkv)
        for layer in range(LAYERS):
            if dispatch_on == "capacity":
                assert torch.equal(graph_outs[layer], expect[layer])
            else:
                torch.testing.assert_close(graph_outs[layer], expect[layer], atol=2e-3, rtol=0)
    assert cache.lengths.tolist() == eager.lengths.tolist() == cache.host_lengths
    assert eager.plan(4).variant == "split" or dispatch_on == "capacity"


def test_torch_compile_fullgraph_no_cache_copies():
    from torch._inductor.utils import run_and_get_code

    case = make_case(4, HQ, HKV, D, [5, 300, 1000, 17], 1024, torch.float16, seed=8)
    ws = ops.Workspace.allocate("cuda", 4, HQ, D, 3)

    def step(qkv, k_cache, v_cache, lengths):
        out = ops.decode_attention(
            qkv, k_cache, v_cache, lengths, num_heads=HQ, num_kv_heads=HKV, num_splits=3,
            workspace=ws, validate_lengths=False,
        )  # fmt: skip
        lengths.add_(1)
        return out

    eager_k, eager_v = case.k_cache.clone(), case.v_cache.clone()
    eager_len = case.lengths.clone()
    expect = step(case.qkv, eager_k, eager_v, eager_len)
    compiled = torch.compile(step, fullgraph=True)
    out, codes = run_and_get_code(compiled, case.qkv, case.k_cache, case.v_cache, case.lengths)
    assert torch.equal(out, expect)
    assert torch.equal(case.k_cache.view(torch.uint8), eager_k.view(torch.uint8))
    assert torch.equal(case.lengths, eager_len)
    code = "\n".join(codes)
    assert "mmha.decode_attention" in code
    # The caches are mutated in place: no clone / copy of them appears in the generated code.
    assert "clone" not in code and "copy_(" not in code.replace("lengths", ""), code[:3000]
    check_against_reference(make_case(4, HQ, HKV, D, [5, 300, 1000, 17], 1024, torch.float16,
                                      seed=8), out)  # fmt: skip


def test_no_memory_growth_over_1000_steps():
    # Capacity dispatch: one plan for every step, so the workspace is sized by the first step.
    cache = new_cache(max_seq_len=1100, dispatch_on="capacity")
    prefill_random(cache, [1, 2, 3, 4])
    qkv = torch.randn(4, WIDTH, device="cuda", dtype=torch.float16)
    for _ in range(20):
        for layer in range(LAYERS):
            cache.step(layer, qkv)
        cache.advance()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        for layer in range(LAYERS):
            cache.step(layer, qkv)
        cache.advance()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before


def test_two_caches_on_two_streams():
    def run(cache, qkvs):
        outs = []
        for qkv in qkvs:
            outs.append(cache.step(0, qkv))
            cache.advance()
        return outs

    g = torch.Generator(device="cuda").manual_seed(9)
    qkvs = [torch.randn(4, WIDTH, generator=g, device="cuda").to(torch.float16) for _ in range(20)]
    a, b = new_cache(), new_cache()
    prefill_random(a, [500, 600, 700, 800], seed=1)
    prefill_random(b, [900, 10, 20, 1000], seed=2)
    a_ref, b_ref = new_cache(), new_cache()
    prefill_random(a_ref, [500, 600, 700, 800], seed=1)
    prefill_random(b_ref, [900, 10, 20, 1000], seed=2)
    expect_a, expect_b = run(a_ref, qkvs), run(b_ref, qkvs)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s1):
        got_a = run(a, qkvs)
    with torch.cuda.stream(s2):
        got_b = run(b, qkvs)
    torch.cuda.synchronize()
    for x, y in zip(got_a + got_b, expect_a + expect_b, strict=True):
        assert torch.equal(x, y)
