"""Tree-masked multi-token decode on the CPU (mmha.tree, mmha.reference.decode_tree,
KVCache.step_tree / accept): each node equals one-token decoding of its root path, accepted
paths leave the cache as one-token steps would, and bad trees and paths are refused."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import bits

from mmha import tree
from mmha.cache import KVCache
from mmha.spec import AttentionSpec, Rotary

FP8 = torch.float8_e4m3fn


pytestmark = pytest.mark.usefixtures("no_reference_warning")


def random_tree(rng: random.Random, n: int, kind: str) -> list[int]:
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "roots":
        return [-1] * n
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


@pytest.mark.parametrize("kind", ["chain", "star", "roots", "random"])
@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_each_node_equals_one_token_decoding_of_its_path(kind, kv_dtype):
    rng = random.Random(hash(kind) % 1000)
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, s_max, t = 8, 2, 32, 64, 9
    dtype = torch.bfloat16 if kv_dtype else torch.float32
    lengths = [0, 5, 20]
    make = lambda: KVCache(1, 3, s_max, hq, hkv, d, dtype, "cpu", rotary_dim=d, kv_dtype=kv_dtype)  # noqa: E731
    c = make()
    k = torch.randn(3, 20, hkv, d, generator=g).to(dtype)
    c.prefill(0, k, k, lengths)
    parents = [random_tree(rng, t, kind) for _ in range(3)]
    counts = [t, t - 3, t]
    qkv = torch.randn(3, t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    out = c.step_tree(0, qkv, torch.tensor(parents, dtype=torch.int32), node_counts=counts)
    assert out[1, counts[1] :].abs().max() == 0  # nodes past a row's count
    for row in range(3):
        for node, path in enumerate(tree.ancestors(parents[row][: counts[row]])):
            solo = make()
            if kv_dtype:
                solo.set_scales(0, c.k_scales[0], c.v_scales[0])
            solo.prefill(0, k, k, lengths, scales="keep")
            for n in path:  # one-token steps over the node's path, the node last
                want = solo.step(0, qkv[:, n])
                solo.advance()
            assert torch.allclose(out[row, node].float(), want[row].float(), atol=2e-2 if kv_dtype else 1e-5)


def test_accept_moves_the_path_and_equals_one_token_steps():
    g = torch.Generator().manual_seed(4)
    hq, hkv, d = 4, 2, 32
    c = KVCache(2, 2, 64, hq, hkv, d, torch.float32, "cpu", rotary_dim=d)
    seq = KVCache(2, 2, 64, hq, hkv, d, torch.float32, "cpu", rotary_dim=d)
    k = torch.randn(2, 10, hkv, d, generator=g)
    for cache in (c, seq):
        for layer in range(2):
            cache.prefill(layer, k, k, [10, 3])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 4], [-1, 0, 1, 1, -1, 4]], dtype=torch.int32)
    qkv = torch.randn(2, 6, (hq + 2 * hkv) * d, generator=g)
    for layer in range(2):
        c.step_tree(layer, qkv, parents)
    paths = [[0, 2, 4, 5], [4, 5]]
    c.accept([0, 1], paths)
    assert c.host_lengths == [14, 5]
    for i in range(4):  # the same tokens one at a time (row 1 stops after its two)
        step_qkv = torch.stack([qkv[0, paths[0][i]], qkv[1, paths[1][min(i, 1)]]])
        for layer in range(2):
            seq.step(layer, step_qkv)
        if i < 2:
            seq.advance()
        else:
            seq.rows.set_lengths([0], [seq.host_lengths[0] + 1])
    assert seq.host_lengths == [14, 5]
    for layer in range(2):
        assert torch.equal(c.k_caches[layer][0, :, :, :14], seq.k_caches[layer][0, :, :, :14])
        assert torch.equal(c.v_caches[layer][1, :, :5], seq.v_caches[layer][1, :, :5])
    nxt = torch.randn(2, (hq + 2 * hkv) * d, generator=g)
    assert torch.equal(c.step(0, nxt), seq.step(0, nxt))


def _tree_cache(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(4)
    hq, hkv, d = 4, 2, 32
    c = KVCache(2, 3, 64, hq, hkv, d, dtype, device, rotary_dim=d)
    k = torch.randn(3, 10, hkv, d, generator=g).to(device, dtype)
    for layer in range(2):
        c.prefill(layer, k, k, [10, 3, 7])
    parents = torch.tensor(
        [[-1, 0, 0, 1, 2, 4], [-1, 0, 1, 1, -1, 4], [-1, 0, 1, 2, 3, 4]], dtype=torch.int32
    )
    qkv = torch.randn(3, 6, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    for layer in range(2):
        c.step_tree(layer, qkv, parents.to(device))
    return c


def test_accept_with_tensor_paths_equals_list_paths():
    paths = [[0, 2, 4, 5], [4, 5], []]
    a, b = _tree_cache(), _tree_cache()
    a.accept([0, 1, 2], paths)
    t = torch.tensor([p + [-1] * (5 - len(p)) for p in paths], dtype=torch.int32)
    b.accept([0, 1, 2], t)
    assert a.host_lengths == b.host_lengths == [14, 5, 7]
    assert torch.equal(a.lengths, b.lengths)
    for layer in range(2):
        for row, used in enumerate((10 + 6, 3 + 6, 7 + 6)):  # the prompts and the trees' slots
            assert torch.equal(a.k_caches[layer][row, :, :, :used], b.k_caches[layer][row, :, :, :used])
            assert torch.equal(a.v_caches[layer][row, :, :used], b.v_caches[layer][row, :, :used])
    c = _tree_cache()  # non-consecutive rows, a path already in place
    c.accept([2, 0], torch.tensor([[0, 1, 2], [0, 1, -1]]))
    assert c.host_lengths == [12, 3, 10]


def test_accept_refuses_bad_tensor_paths_and_changes_nothing():
    c = _tree_cache()
    before = [x.clone() for x in c.k_caches + c.v_caches] + [c.lengths.clone()]
    for bad, match in (
        (torch.tensor([[0, -1, 2]]), r"paths\[0\] must be its path, then -1s"),
        (torch.tensor([[0, 3]]), r"paths\[0\] must be a path from a root"),
        (torch.tensor([[0, 1]], dtype=torch.float32), "paths must be an int32 / int64 tensor"),
        (torch.tensor([[0], [0]]), r"paths must be an int32 / int64 tensor \[1, P\]"),
        (torch.tensor([[0, -2]]), r"paths\[0\] must be its path, then -1s"),
    ):
        with pytest.raises(ValueError, match=match):
            c.accept([0], bad)
    after = [x for x in c.k_caches + c.v_caches] + [c.lengths]
    assert all(torch.equal(x.nan_to_num(0), y.nan_to_num(0)) for x, y in zip(before, after, strict=True))
    assert c.host_lengths == [10, 3, 7]


def test_bad_trees_and_paths_are_refused_and_change_nothing():
    c = KVCache(1, 2, 16, 4, 2, 32, torch.float32, "cpu")
    c.prefill(0, torch.randn(2, 10, 2, 32), torch.randn(2, 10, 2, 32), [10, 2])
    qkv = torch.randn(2, 4, 8 * 32)
    k0 = c.k_caches[0].clone()
    cases = [
        (
            torch.tensor([[-1, 0, 2, 1], [-1, 0, 0, 0]]),
            r"parents\[0, 2\] must be -1 \(a root\) or an earlier node",
        ),
        (torch.tensor([[-1, 0, 0, -2], [-1, 0, 0, 0]]), r"parents\[0, 3\]"),
        (torch.zeros(2, 65, dtype=torch.int32), r"1..64 nodes"),
        (torch.tensor([[-1.0, 0, 0, 0], [-1, 0, 0, 0]]), "dtype int32 or int64"),
    ]
    for parents, match in cases:
        with pytest.raises(ValueError, match=match):
            c.step_tree(0, qkv if parents.shape[1] == 4 else torch.randn(2, 65, 8 * 32), parents)
    with pytest.raises(ValueError, match=r"rows \[0\] would overflow the capacity"):
        c.step_tree(0, torch.randn(2, 7, 8 * 32), torch.tensor([[-1] * 7, [-1] * 7]))
    assert torch.equal(bits(c.k_caches[0]), bits(k0))  # unused slots are uninitialised (NaN bits compare)
    with pytest.raises(ValueError, match="accept needs a step_tree first"):
        c.accept([0], [[0]])
    c.step_tree(0, qkv, torch.tensor([[-1, 0, 0, 1], [-1, -1, 1, 2]]))
    k1 = c.k_caches[0].clone()
    for paths, match in (([[1]], r"node 1 at index 0 is not a root"), ([[0, 2, 3]], "is not a child of node 2"),
                         ([[0, 9]], r"must be a node in \[0, 3\]")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            c.accept([0], paths)
    assert torch.equal(bits(c.k_caches[0]), bits(k1)) and c.host_lengths == [10, 2]
    c.accept([0, 1], [[0, 1, 3], []])
    assert c.host_lengths == [13, 2]


@pytest.mark.parametrize("kind", ["chain", "random"])
def test_reference_tree_lse_equals_one_token_lse_of_each_path(kind):
    # The tree step's lse per node is the lse of one-token decoding over the node's root path (the
    # last step's), -inf past a row's count; the paged reference returns the same.
    from mmha import layout, reference

    rng = random.Random(len(kind))
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d, s_max, t, bs = 2, 4, 2, 16, 32, 7, 4
    lengths = [3, 11]
    k = torch.randn(b, s_max, hkv, d, generator=g)
    v = torch.randn(b, s_max, hkv, d, generator=g)
    kc, vc = layout.pack_k(k), layout.pack_v(v)
    parents = torch.tensor([random_tree(rng, t, kind) for _ in range(b)], dtype=torch.int32)
    counts = [t, t - 2]
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=g)
    lens = torch.tensor(lengths, dtype=torch.int32)
    kw = dict(num_heads=hq, num_kv_heads=hkv, attention=AttentionSpec(rotary=Rotary(d)), compute_dtype=torch.float64,
              return_lse=True)  # fmt: skip
    _, lse = reference.decode_tree(qkv, kc.clone(), vc.clone(), lens, parents, node_counts=counts, **kw)
    assert lse.shape == (b, t, hq) and lse.dtype == torch.float32
    assert torch.isneginf(lse[1, counts[1] :]).all()
    assert torch.isfinite(lse[0]).all() and torch.isfinite(lse[1, : counts[1]]).all()
    for row in range(b):
        for node, path in enumerate(tree.ancestors(parents[row, : counts[row]].tolist())):
            kr, vr = kc[row : row + 1].clone(), vc[row : row + 1].clone()
            pos = lens[row : row + 1].clone()
            for n in path:  # one-token steps over the node's path, the node last
                _, want = reference.decode_step(qkv[row : row + 1, n], kr, vr, pos, **kw)
                pos += 1
            torch.testing.assert_close(lse[row, node], want[0], rtol=1e-6, atol=1e-6)
    max_blocks = s_max // bs
    tables = torch.randperm(b * max_blocks, generator=g).reshape(b, max_blocks).to(torch.int32)
    kp = torch.zeros(layout.k_pages_shape(b * max_blocks, hkv, bs, d, torch.float32))
    vp = torch.zeros(layout.v_pages_shape(b * max_blocks, hkv, bs, d))
    for row in range(b):
        layout.write_pages(kp, vp, tables[row].tolist(), k[row], v[row])
    _, lse_paged = reference.decode_tree_paged(qkv, kp, vp, tables, lens, parents, node_counts=counts, **kw)
    assert bits(lse_paged).equal(bits(lse))
