"""Property-based fuzzing (hypothesis; derandomized, so every run draws the same examples).

- GPU: random valid configurations (batch, heads, kv heads, head dim, dtype, ragged lengths, rotary
  settings, bias, qkv row stride, unused-slot fill, variant and split count) through the raw
  operator with poisoned outputs, against ``mmha.reference`` (tolerance rule, cache bytes).
- GPU: random invalid raw-operator calls: a clean error naming the argument, nothing written.
- CPU and GPU: random invalid ``KVCache`` calls (the Python-side validation): a clean error
  naming the argument, caches, lengths and the host mirror unchanged.

``MMHA_FUZZ_EXAMPLES`` scales the example counts (default 1: about two minutes on a GPU);
``MMHA_FUZZ_SEED=N`` draws other examples, from seed N (still the same ones on every run with N).
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from helpers import (
    HAS_GPU,
    assert_bits_equal,
    check_against_reference,
    check_cache_writes,
    gpu,
    make_case,
    raw_args,
    run_reference,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mmha import KVCache, dispatch, ops  # noqa: E402

SCALE = float(os.environ.get("MMHA_FUZZ_EXAMPLES", "1"))
SEED = os.environ.get("MMHA_FUZZ_SEED")


def fuzz_settings(examples: int):
    chosen = settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=SEED is None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    if SEED is None:
        return chosen
    return lambda test: hypothesis.seed(int(SEED))(chosen(test))


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


# --------------------------------------------------------------------------- valid configurations
@st.composite
def configs(draw):
    hkv = draw(st.integers(1, 4))
    group = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    batch = draw(st.integers(1, 5))
    s_max = draw(st.one_of(st.integers(1, 64), st.integers(65, 1200)))
    # Lengths at the edges (a step appends at slot length, so length <= S_max - 1; with S_max = 1
    # the only valid length is 0: the special 1 is clamped, seed 1 drew it as length 1).
    special = st.sampled_from([0, min(1, s_max - 1), s_max - 1, s_max // 2])
    lengths = draw(st.lists(st.one_of(st.integers(0, s_max - 1), special), min_size=batch, max_size=batch))
    head_dim = draw(st.sampled_from(dispatch.SUPPORTED_HEAD_DIMS))
    rotary = draw(st.sampled_from(["none", "full", "partial"]))
    rotary_dim = {"none": 0, "full": head_dim}.get(rotary) or 2 * draw(st.integers(1, head_dim // 2))
    return dict(
        batch=batch,
        num_heads=hkv * group,
        num_kv_heads=hkv,
        head_dim=head_dim,
        lengths=lengths,
        max_seq_len=s_max,
        dtype=draw(st.sampled_from(DTYPES)),
        bias=draw(st.booleans()),
        rotary_dim=rotary_dim,
        rotary_interleaved=draw(st.booleans()),
        rotary_theta=draw(st.sampled_from([100.0, 1e4, 5e5])),
        unused_fill=draw(st.sampled_from([math.nan, math.inf, 1e4])),
        value_scale=draw(st.sampled_from([1.0, 0.01, 8.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
        row_pad=draw(st.sampled_from([0, 8, 24])),
        variant=draw(st.sampled_from(["auto", "single_pass", "split", "count"])),
        splits=draw(st.integers(1, dispatch.MAX_SPLITS)),
        stages=draw(st.sampled_from([None, 2, 3, 4])),  # None: the plan's
        source=draw(st.sampled_from(["auto", "cp_async", "tma"])),
    )


def build(cfg: dict, device="cuda"):
    keys = ("bias", "rotary_dim", "rotary_interleaved", "rotary_theta", "unused_fill", "value_scale", "seed")
    case = make_case(
        cfg["batch"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["lengths"],
        cfg["max_seq_len"], cfg["dtype"], device=device, **{k: cfg[k] for k in keys},
    )  # fmt: skip
    if cfg["row_pad"]:  # qkv as a strided view into a wider buffer
        wide = torch.full((cfg["batch"], case.qkv.shape[1] + cfg["row_pad"]), float("nan"),
                          dtype=case.qkv.dtype, device=device)  # fmt: skip
        wide[:, : case.qkv.shape[1]] = case.qkv
        case.qkv = wide[:, : case.qkv.shape[1]]
    return case


def num_splits_for(cfg: dict) -> int:
    if cfg["variant"] == "count":
        return cfg["splits"]
    return ops.plan_for(
        "cuda", cfg["batch"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"],
        max(cfg["lengths"]) + 1, cfg["dtype"], cfg["variant"],
    ).num_splits  # fmt: skip


def stages_for(cfg: dict) -> int:
    """The drawn stage count, within what one block of this head dim may hold."""
    if cfg.get("stages") is not None:
        if cfg["dtype"] == torch.float32:  # the CUDA-core loop takes any valid count and ignores it
            return cfg["stages"]
        dev = ops.device_spec(torch.cuda.current_device())
        return min(cfg["stages"], dispatch.max_stages(cfg["head_dim"], cfg["dtype"].itemsize, dev))
    return ops.plan_for(
        "cuda", cfg["batch"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"],
        max(cfg["lengths"]) + 1, cfg["dtype"],
    ).stages  # fmt: skip


def source_for(cfg: dict) -> int:
    """The drawn tile source where it applies (bulk tensor copies need 16-bit caches, head_dim a
    multiple of 64 and S_max a multiple of 32)."""
    tma_ok = cfg["dtype"] != torch.float32 and cfg["head_dim"] % 64 == 0 and cfg["max_seq_len"] % 32 == 0
    source = cfg.get("source", "auto")
    return ops.TILE_SOURCES[source if source != "tma" or tma_ok else "auto"]


@gpu
@fuzz_settings(150)
@given(cfg=configs())
def test_fuzz_kernel_matches_reference(cfg):
    case = build(cfg)
    _, _, ref_k, ref_v = run_reference(case)
    a = raw_args(case, num_splits_for(cfg), stages_for(cfg), source_for(cfg))
    torch.ops.mmha.decode_attention(**a)
    torch.cuda.synchronize()
    check_against_reference(case, a["out"], a["lse"])
    check_cache_writes(case, ref_k, ref_v)
    assert not a["status"].any(), "a valid length raised its row's status flag"


# --------------------------------------------------------------------------- invalid raw-op calls
def nc(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, not contiguous. Where no such layout exists (torch calls a tensor
    contiguous whatever the strides of its size-1 dims: lengths of one row, or caches with
    S_max = 1 whose last two dims are swapped), the mutation does not apply: the call it would
    make is valid, and the operator rightly runs it."""
    out = t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 1 else t.repeat(2)[::2]
    assume(not out.is_contiguous())
    return out


def zeros_like_shape(t, *shape, dtype=None):
    return torch.zeros(*shape, dtype=dtype or t.dtype, device=t.device)


# name -> (mutation of the raw op's arguments given the case and a row, expected message)
RAW_MUTATIONS = {
    "qkv on cpu": (lambda c, r: dict(qkv=c.qkv.cpu()), r"qkv must be a CUDA tensor, got a tensor on cpu"),
    "v_cache on cpu": (lambda c, r: dict(v_cache=c.v_cache.cpu()), r"v_cache must be a CUDA tensor"),
    "lengths on cpu": (lambda c, r: dict(lengths=c.lengths.cpu()), r"lengths must be a CUDA tensor"),
    "lengths int64": (lambda c, r: dict(lengths=c.lengths.long()), r"lengths must have dtype Int, got Long"),
    "lengths non-contiguous": (lambda c, r: dict(lengths=nc(c.lengths)), r"lengths must be contiguous"),
    "lengths short": (
        lambda c, r: dict(lengths=c.lengths[:-1]) if c.lengths.numel() > 1 else dict(lengths=c.lengths[:0]),
        r"lengths must have shape \[\d+\], got shape",
    ),
    "length negative": (
        lambda c, r: dict(lengths=c.lengths.index_fill(0, torch.tensor([r], device="cuda"), -1 - r)),
        r"lengths\[\d+\] must be in \[0, \d+\] \(the cache capacity is \d+",
    ),
    "length at capacity": (
        lambda c, r: dict(
            lengths=c.lengths.index_fill(0, torch.tensor([r], device="cuda"), c.v_cache.shape[2])
        ),
        r"lengths\[\d+\] must be in \[0, \d+\] \(the cache capacity is \d+",
    ),
    "k_cache dtype": (
        lambda c, r: dict(
            k_cache=c.k_cache.to(torch.float16 if c.k_cache.dtype != torch.float16 else torch.bfloat16)
        ),
        r"k_cache must have dtype \w+, got \w+",
    ),
    "qkv int": (lambda c, r: dict(qkv=c.qkv.int()), r"qkv must have dtype float16, bfloat16 or float32"),
    "qkv width": (
        lambda c, r: dict(qkv=zeros_like_shape(c.qkv, c.qkv.shape[0], c.qkv.shape[1] + 8)),
        r"qkv must have width \(num_heads \+ 2 \* num_kv_heads\) \* head_dim",
    ),
    "qkv batch": (
        lambda c, r: dict(qkv=zeros_like_shape(c.qkv, c.qkv.shape[0] + 1, c.qkv.shape[1])),
        r"qkv must have batch \d+ \(the caches' batch\)",
    ),
    "head dim": (
        lambda c, r: dict(v_cache=zeros_like_shape(c.v_cache, *c.v_cache.shape[:3], 72)),
        r"Unsupported head_dim: 72 \(supported: 32, 64, 80, 96, 128, 256\)",
    ),
    "wrong x": (
        lambda c, r: dict(k_cache=c.k_cache.reshape(*c.k_cache.shape[:2], -1, c.k_cache.shape[3], 2)),
        r"k_cache must have x = 16 / element_size = \d+",
    ),
    "k/v capacity": (
        lambda c, r: dict(
            k_cache=zeros_like_shape(
                c.k_cache, *c.k_cache.shape[:3], c.k_cache.shape[3] + 1, c.k_cache.shape[4]
            )
        ),  # fmt: skip
        r"k_cache must have shape \[.*\] to match v_cache",
    ),
    "k_cache non-contiguous": (lambda c, r: dict(k_cache=nc(c.k_cache)), r"k_cache must be contiguous"),
    "v_cache non-contiguous": (lambda c, r: dict(v_cache=nc(c.v_cache)), r"v_cache must be contiguous"),
    "kv heads": (
        lambda c, r: dict(num_heads=c.num_kv_heads + 1, num_kv_heads=c.num_kv_heads + 1),
        r"v_cache must have num_kv_heads \(\d+\) heads in dim 1",
    ),
    "heads not divisible": (
        lambda c, r: dict(num_heads=2 * c.num_kv_heads + 1, num_kv_heads=2 * c.num_kv_heads),
        r"num_heads \(\d+\) must be divisible by num_kv_heads \(\d+\)",
    ),
    "rotary odd": (lambda c, r: dict(rotary_dim=3), r"rotary_dim must be even and in \[0, head_dim = \d+\]"),
    "splits": (lambda c, r: dict(num_splits=65), r"num_splits must be in \[1, 64\], got 65"),
    "bias shape": (
        lambda c, r: dict(qkv_bias=zeros_like_shape(c.qkv, 5)),
        r"qkv_bias must have shape \[\d+\], got shape \[5\]",
    ),
    "out dtype": (
        lambda c, r: dict(out=torch.empty(1, device="cuda", dtype=torch.int8)),
        r"out must have dtype",
    ),
    "stages": (lambda c, r: dict(stages=1 + 8 * (r % 2)), r"stages must be in \[2, \d+\] for head_dim \d+"),
    "tile source": (
        lambda c, r: dict(tile_source=-1),
        r"tile_source must be 0 \(auto\), 1 \(cp.async\) or 2",
    ),
    "status short": (
        lambda c, r: dict(status=torch.zeros(c.lengths.numel() - 1, dtype=torch.int32, device="cuda")),
        r"status must hold at least B = \d+ int32",
    ),
}


@gpu
@fuzz_settings(150)
@given(cfg=configs(), mutation=st.sampled_from(sorted(RAW_MUTATIONS)), row=st.integers(0, 4))
def test_fuzz_raw_op_rejects_invalid(cfg, mutation, row):
    case = build(cfg)
    row = row % cfg["batch"]
    mutate, match = RAW_MUTATIONS[mutation]
    k0, v0, l0 = case.k_cache.clone(), case.v_cache.clone(), case.lengths.clone()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mmha.decode_attention(**raw_args(case, num_splits_for(cfg), **mutate(case, row)))
    torch.cuda.synchronize()
    assert_bits_equal(case.k_cache, k0, "k_cache")
    assert_bits_equal(case.v_cache, v0, "v_cache")
    assert torch.equal(case.lengths, l0)


@gpu
@fuzz_settings(60)
@given(cfg=configs(), bad=st.lists(st.sampled_from(["capacity", "past", "negative", "int32 min"]), min_size=1,
                                   max_size=5))  # fmt: skip
def test_fuzz_out_of_range_lengths_write_nothing(cfg, bad):
    """The kernel's own guard (host check off): rows with a length outside [0, S_max - 1] read and
    write nothing in the caches, get NaN, and raise their status flag; other rows are computed."""
    case = build(cfg)
    s_max = cfg["max_seq_len"]
    value = {"capacity": s_max, "past": s_max + 12345, "negative": -1, "int32 min": -(2**31)}
    rows = sorted({i % cfg["batch"] for i in range(len(bad))})
    lengths = list(cfg["lengths"])
    for i, r in enumerate(rows):
        lengths[r] = value[bad[i]]
    case.lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
    k0, v0 = case.k_cache.clone(), case.v_cache.clone()
    a = raw_args(case, num_splits_for(cfg), stages_for(cfg), source_for(cfg), check_lengths=False)
    torch.ops.mmha.decode_attention(**a)
    torch.cuda.synchronize()
    flagged = [int(x) for x in a["status"].tolist()]
    assert flagged == [int(r in rows) for r in range(cfg["batch"])]
    assert torch.isnan(a["out"][rows]).all() and torch.isnan(a["lse"][rows]).all()
    good = [r for r in range(cfg["batch"]) if r not in rows]
    for r in good:  # the valid rows wrote their new token's slot; nothing else changed
        k0[r, :, :, lengths[r]] = case.k_cache[r, :, :, lengths[r]]
        v0[r, :, lengths[r]] = case.v_cache[r, :, lengths[r]]
    if good:
        assert not torch.isnan(a["out"][good]).any()
    assert_bits_equal(case.k_cache, k0, "k_cache")
    assert_bits_equal(case.v_cache, v0, "v_cache")


# --------------------------------------------------------------------------- invalid KVCache calls
def cache_state(c: KVCache):
    return [t.clone() for t in c.k_caches + c.v_caches] + [c.lengths.clone()], c.host_lengths


def assert_unchanged(c: KVCache, before) -> None:
    tensors, host = before
    for i, (a, b) in enumerate(zip(c.k_caches + c.v_caches + [c.lengths], tensors, strict=True)):
        assert_bits_equal(a, b, f"cache tensor {i}")
    assert c.host_lengths == host


@st.composite
def cache_setups(draw):
    hkv = draw(st.integers(1, 3))
    return dict(
        layers=draw(st.integers(1, 3)),
        max_batch=draw(st.integers(1, 4)),
        max_seq_len=draw(st.integers(2, 40)),
        num_heads=hkv * draw(st.sampled_from([1, 2, 4])),
        num_kv_heads=hkv,
        head_dim=draw(st.sampled_from([32, 64])),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_cache(s: dict, device: str) -> KVCache:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # CPU: the reference path
        c = KVCache(s["layers"], s["max_batch"], s["max_seq_len"], s["num_heads"], s["num_kv_heads"],
                    s["head_dim"], s["dtype"], device, rotary_dim=s["head_dim"])  # fmt: skip
    g = torch.Generator().manual_seed(s["seed"])
    lens = torch.randint(0, s["max_seq_len"], (s["max_batch"],), generator=g).tolist()
    for layer in range(s["layers"]):
        k = torch.randn(s["max_batch"], s["max_seq_len"], s["num_kv_heads"], s["head_dim"], generator=g)
        c.prefill(layer, k.to(s["dtype"]).to(device), (2 * k).to(s["dtype"]).to(device), lens)
    return c


def width(c: KVCache) -> int:
    return (c.num_heads + 2 * c.num_kv_heads) * c.head_dim


def qkv_for(c: KVCache, rows=None, extra=0, dtype=None, device=None):
    return torch.zeros(
        rows or c.max_batch, width(c) + extra, dtype=dtype or c.dtype, device=device or c.device
    )


def other_dtype(c: KVCache):
    return torch.float32 if c.dtype != torch.float32 else torch.float16


def fill_row(c: KVCache, row: int):
    """Row ``row`` at full capacity (every layer), the others as they were."""
    k = torch.zeros(1, c.max_seq_len, c.num_kv_heads, c.head_dim, dtype=c.dtype, device=c.device)
    c.release([row])
    for layer in range(c.num_layers):
        c.prefill(layer, k, k, [c.max_seq_len], rows=[row])


# name -> (call that must fail on the cache given a row, expected message)
CACHE_MUTATIONS = {
    "qkv width": (lambda c, r: c.step(0, qkv_for(c, extra=1)), r"qkv must have shape \[B, .*\], got"),
    "qkv rows": (lambda c, r: c.step(0, qkv_for(c, rows=c.max_batch + 1)), r"qkv must have 1..\d+ rows"),
    "qkv dtype": (lambda c, r: c.step(0, qkv_for(c, dtype=other_dtype(c))), r"qkv must have dtype"),
    "layer": (lambda c, r: c.step(c.num_layers, qkv_for(c)), r"layer must be in \[0, \d+\], got \d+"),
    "bias shape": (
        lambda c, r: c.step(0, qkv_for(c), qkv_bias=torch.zeros(3, dtype=c.dtype, device=c.device)),
        r"qkv_bias must have shape \[\d+\]",
    ),
    "row at capacity": (
        lambda c, r: c.step(0, qkv_for(c)),
        r"rows \[\d+\] are full: length \d+ == max_seq_len",
    ),
    "advance past capacity": (lambda c, r: c.advance(), r"rows \[\d+\] would exceed max_seq_len"),
    "prefill heads": (
        lambda c, r: c.prefill(
            0, *[torch.zeros(1, 2, c.num_kv_heads + 1, c.head_dim, dtype=c.dtype, device=c.device)] * 2
        ),  # fmt: skip
        r"k must have shape \[n, S, \d+, \d+\]",
    ),
    "prefill over capacity": (
        lambda c, r: c.prefill(
            0,
            *[torch.zeros(1, c.max_seq_len + 1, c.num_kv_heads, c.head_dim, dtype=c.dtype, device=c.device)]
            * 2,
            rows=[r],
        ),  # fmt: skip
        r"lengths\[0\] \(\d+\) exceeds the cache capacity max_seq_len",
    ),
    "prefill row": (
        lambda c, r: c.prefill(
            0,
            *[torch.zeros(1, 1, c.num_kv_heads, c.head_dim, dtype=c.dtype, device=c.device)] * 2,
            rows=[c.max_batch],
        ),  # fmt: skip
        r"rows must be in \[0, \d+\], got \d+",
    ),
    "admit busy": (lambda c, r: c.admit([r]), r"rows must be free \(released\) to be admitted"),
}
# Mutations whose protected state has row ``r`` filled to capacity first.
NEEDS_FULL_ROW = ("row at capacity", "advance past capacity")


def _check_cache_rejects(setup, mutation, row, device):
    c = make_cache(setup, device)
    row = row % c.max_batch
    if mutation in NEEDS_FULL_ROW:
        fill_row(c, row)
    call, match = CACHE_MUTATIONS[mutation]
    before = cache_state(c)
    with pytest.raises(ValueError, match=match):
        call(c, row)
    assert_unchanged(c, before)


@fuzz_settings(200)
@given(setup=cache_setups(), mutation=st.sampled_from(sorted(CACHE_MUTATIONS)), row=st.integers(0, 3))
def test_fuzz_kvcache_rejects_invalid_cpu(setup, mutation, row):
    _check_cache_rejects(setup, mutation, row, "cpu")


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@fuzz_settings(100)
@given(setup=cache_setups(), mutation=st.sampled_from(sorted(CACHE_MUTATIONS)), row=st.integers(0, 3))
def test_fuzz_kvcache_rejects_invalid_gpu(setup, mutation, row):
    _check_cache_rejects(setup, mutation, row, "cuda")
