"""KVCache(kv_dtype="int4") on the reference path: prompts, steps, tree steps with accept, paged
pools and fork against the format's oracle (mmha.int4), and what it refuses."""

import pytest
import torch

from mmha import KVCache, int4, ops
from mmha.spec import AttentionSpec, Rotary

pytestmark = pytest.mark.filterwarnings("ignore:mmha. no CUDA device")

HQ, HKV, D = 8, 2, 64
SPEC = AttentionSpec(rotary=Rotary(dim=D, theta=10000.0))


def _cache(paged=False, rows=3, max_seq=200, **kw):
    return KVCache(2, rows, max_seq, HQ, HKV, D, torch.float16, "cpu", kv_dtype="int4", attention=SPEC,
                   paged=paged, block_size=64 if paged else 16, **kw)  # fmt: skip


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    k = torch.randn(len(lengths), n, HKV, D, generator=g).half()
    k[..., 7] *= 12.0  # an outlier channel
    return k, torch.randn(len(lengths), n, HKV, D, generator=g).half()


def _oracles(k, v, lengths, capacity):
    """Per layer, the oracle's cache holding the same prompts."""
    out = []
    for _ in range(2):
        c = int4.Int4Cache.empty(len(lengths), HKV, capacity, D, torch.float16)
        for row, n in enumerate(lengths):
            c.prefill(row, k[row, :n].transpose(0, 1), v[row, :n].transpose(0, 1))
        out.append(c)
    return out


def _qkv(batch, seed, nodes=None):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, (HQ + 2 * HKV) * D) if nodes is None else (batch, nodes, (HQ + 2 * HKV) * D)
    return torch.randn(*shape, generator=g).half()


def test_steps_equal_the_oracle():
    lengths = [100, 62, 127]
    c = _cache()
    k, v = _prompts(lengths)
    for layer in range(2):
        c.prefill(layer, k, v, lengths=lengths)
    assert c.capacity == 256 and c.k_caches[0].dtype == torch.uint8
    oracles = _oracles(k, v, lengths, c.capacity)
    for step in range(4):  # rows 1 and 2 fill their groups on the way
        n = torch.tensor([x + step for x in lengths])
        for layer in range(2):
            qkv = _qkv(3, 10 * step + layer)
            got = c.step(layer, qkv)
            want = int4.decode_step(qkv, oracles[layer], n, num_heads=HQ, num_kv_heads=HKV, attention=SPEC)
            assert torch.equal(got, want), (step, layer)
        c.advance()
    assert c.host_lengths == [104, 66, 131]
    for layer in range(2):
        assert torch.equal(c.storage.caches[layer].k_scale, oracles[layer].k_scale)


def test_paged_equals_contiguous_and_free_rows_take_no_part():
    lengths = [130, 5]
    flat, pool = _cache(rows=3), _cache(paged=True, rows=3)
    k, v = _prompts(lengths, seed=1)
    for cache in (flat, pool):
        for layer in range(2):
            cache.prefill(layer, k, v, lengths=lengths, rows=[0, 2])
    for cache in (flat, pool):
        cache.release([1])
    assert pool.free_rows == [1]
    for step in range(3):
        for layer in range(2):
            qkv = _qkv(3, 100 + step * 2 + layer)
            got, want = pool.step(layer, qkv), flat.step(layer, qkv)
            assert torch.equal(got[[0, 2]], want[[0, 2]])
            assert torch.equal(got[1], torch.zeros_like(got[1]))
        for cache in (flat, pool):
            cache.advance()


@pytest.mark.parametrize("paged", [False, True])
def test_tree_step_and_accept_equal_the_oracle(paged):
    lengths = [60, 90]
    c = _cache(paged=paged, rows=2)
    k, v = _prompts(lengths, seed=2)
    for layer in range(2):
        c.prefill(layer, k, v, lengths=lengths)
    oracles = _oracles(k, v, lengths, 256)
    parents = torch.tensor([[-1, 0, 0, 1, 3, 4], [-1, 0, 1, 1, 2, 4]])
    for layer in range(2):
        qkv = _qkv(2, 7 + layer, nodes=6)
        got = c.step_tree(layer, qkv, parents)
        want = int4.decode_tree(qkv, oracles[layer], torch.tensor(lengths), parents, num_heads=HQ,
                                num_kv_heads=HKV, attention=SPEC)  # fmt: skip
        assert torch.equal(got, want)
    paths = [[0, 1, 3, 4, 5], [0, 1, 3]]  # row 0 crosses its first group's end
    c.accept([0, 1], paths)
    for layer in range(2):
        for row, path in enumerate(paths):
            oracles[layer].accept(row, lengths[row], path)
    assert c.host_lengths == [65, 93]
    qkv = _qkv(2, 50)
    got = c.step(0, qkv)
    want = int4.decode_step(
        qkv, oracles[0], torch.tensor([65, 93]), num_heads=HQ, num_kv_heads=HKV, attention=SPEC
    )
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="paths: an int4 cache takes paths as lists"):
        c.accept([0], torch.tensor([[0]]))


def test_fork_continues_like_its_source():
    c = _cache(paged=True, rows=3)
    k, v = _prompts([100], seed=3)
    for layer in range(2):
        c.prefill(layer, k, v, lengths=[100], rows=[0])
    c.release([1, 2])
    c.fork(0, [1, 2])
    assert c.host_lengths == [100, 100, 100]
    for step in range(30):  # past the partial group's end: the forked rows commit their own groups
        for layer in range(2):
            one = _qkv(1, 200 + 2 * step + layer)
            out = c.step(layer, one.expand(3, -1).contiguous())
            assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])
        c.advance()


def test_refusals_name_the_argument_and_change_nothing():
    with pytest.raises(ValueError, match='kv_dtype must be a torch dtype, "int8", "fp8" or "int4"'):
        KVCache(1, 1, 64, HQ, HKV, D, torch.float16, "cpu", kv_dtype="int3")
    for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):  # the formats by name
        assert KVCache(1, 1, 64, HQ, HKV, D, torch.float16, "cpu", kv_dtype=name).kv_dtype == dtype
    with pytest.raises(ValueError, match="block_size must be 64 or 128 for an int4 cache"):
        _cache(paged=True).__class__(1, 1, 64, HQ, HKV, D, torch.float16, "cpu", kv_dtype="int4", paged=True)
    c = _cache()
    k, v = _prompts([70])
    c.prefill(0, k, v, lengths=[70], rows=[0])
    before = {name: t.clone() for name, t in vars(c.storage.caches[0]).items()}
    with pytest.raises(ValueError, match="qkv"):
        c.step(0, _qkv(3, 1)[:, :-2])
    for name, t in vars(c.storage.caches[0]).items():
        assert torch.equal(t, before[name]), name


def test_non_finite_new_token_is_flagged_as_on_the_gpu():
    """As an int8 cache's: a row that appends a NaN value reads back NaN and check() raises
    ScaleError naming it, then clears; paged pools too."""
    for paged in (False, True):
        c = _cache(paged=paged)
        k, v = _prompts([30, 63])
        for layer in range(2):
            c.prefill(layer, k, v, lengths=[30, 63])
        qkv = _qkv(2, 5)
        qkv[0, (HQ + HKV) * D + 1] = float("nan")  # row 0's v
        out = c.step(0, qkv)
        assert not torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()
        with pytest.raises(ops.ScaleError, match=r"rows \[0\]"):
            c.check()
        c.check()


def test_a_value_past_the_fp16_scales_is_flagged():
    """A finite value past 65504 (a bf16 model's), as the cache holds it, makes an fp16 scale or
    zero point infinite: read back non-finite and flagged like a non-finite one, never saturated."""
    c = KVCache(1, 2, 128, HQ, HKV, D, torch.bfloat16, "cpu", kv_dtype="int4", attention=SPEC)
    k, v = _prompts([30, 40])
    c.prefill(0, k.bfloat16(), v.bfloat16(), lengths=[30, 40])
    qkv = _qkv(2, 6).bfloat16()
    qkv[1, (HQ + HKV) * D + 3] = 1.0e5  # row 1's v: finite in bf16, past fp16's range
    out = c.step(0, qkv)
    assert torch.isfinite(out[0]).all() and not torch.isfinite(out[1]).all()
    assert not torch.isfinite(c.storage.caches[0].v_scale[1, :, 40].float()).all()
    with pytest.raises(ops.ScaleError, match=r"rows \[1\].*65504"):
        c.check()
    qkv = _qkv(2, 7).bfloat16()
    # row 0's k: rotary moves it into its pair, one of whose two dims keeps >= 1 / sqrt(2) of it,
    # past 65504 in the residual (its group's channel scale will be infinite once quantised)
    qkv[0, HQ * D + 5] = -2.0e5
    c.step(0, qkv)
    with pytest.raises(ops.ScaleError, match=r"rows \[0\]"):
        c.check()
