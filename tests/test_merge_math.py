"""The split-and-merge math, modelled in torch: partial softmax * V per chunk, then rescale and
merge, equals the full softmax for random chunkings, empty chunks and -inf partials."""

import math

import pytest
import torch


def partial(scores: torch.Tensor, values: torch.Tensor):
    """One chunk: (max, sum of exp, unnormalised acc), as a split block writes them."""
    if scores.numel() == 0:
        return -math.inf, 0.0, torch.zeros(values.shape[-1], dtype=values.dtype)
    m = scores.max()
    m_ref = 0.0 if m == -math.inf else m
    p = torch.exp(scores - m_ref)
    return m, p.sum(), p @ values


def merge(parts):
    """The last block's merge: weights exp(m_s - M) / sum_s l_s exp(m_s - M)."""
    m = max(float(p[0]) for p in parts)
    m_ref = 0.0 if m == -math.inf else m
    w = [math.exp(float(p[0]) - m_ref) if p[0] != -math.inf else 0.0 for p in parts]
    total = sum(wi * float(p[1]) for wi, p in zip(w, parts, strict=True))
    acc = sum(wi * p[2] for wi, p in zip(w, parts, strict=True))
    return acc / total, m + math.log(total)


def kernel_chunks(length: int, num_splits: int, grain: int):
    """The kernel's chunking (decode_attention.cuh): the row's ceil(L / grain) grains (tiles of the
    tile loop, warp steps of the CUDA-core loop) go to min(splits, grains) active splits, split s
    taking grains n - n * (active - s) // active .. n - n * (active - s - 1) // active (the larger
    shares first: the last split appends); splits past them idle."""
    n = -(-length // grain)
    active = min(num_splits, n)
    chunks = []
    for s in range(active):
        t0, t1 = n - (active - s) * n // active, n - (active - s - 1) * n // active
        chunks.append((t0 * grain, min(length, t1 * grain)))
    return chunks, active


@pytest.mark.parametrize("seed", range(20))
def test_random_chunkings_equal_full_softmax(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 300, (1,), generator=g))
    scores = torch.randn(n, generator=g, dtype=torch.float64) * 5
    values = torch.randn(n, 16, generator=g, dtype=torch.float64)
    cuts = sorted(torch.randint(0, n + 1, (int(torch.randint(0, 8, (1,), generator=g)),),
                                generator=g).tolist())  # fmt: skip
    bounds = [0, *cuts, n]  # repeated cuts give empty chunks
    parts = [partial(scores[a:b], values[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    out, lse = merge(parts)
    torch.testing.assert_close(out, torch.softmax(scores, 0) @ values)
    torch.testing.assert_close(torch.tensor(lse, dtype=torch.float64), torch.logsumexp(scores, 0))


def test_single_partial_and_minus_inf_partials():
    scores = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    values = torch.eye(3, dtype=torch.float64)
    full = torch.softmax(scores, 0) @ values
    out, _ = merge([partial(scores, values)])
    torch.testing.assert_close(out, full)
    empty = partial(scores[:0], values[:0])
    masked = partial(torch.full((4,), -math.inf, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64))
    out, _ = merge([empty, partial(scores, values), masked, empty])
    torch.testing.assert_close(out, full)
    assert torch.isfinite(out).all()


def test_all_partials_empty_is_not_nan_in_the_weights():
    # Never produced by the kernel (every active split owns >= 1 key), but the weights stay finite.
    parts = [partial(torch.zeros(0, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.float64))] * 3
    m = max(float(p[0]) for p in parts)
    assert m == -math.inf
    m_ref = 0.0 if m == -math.inf else m
    assert all(math.isfinite(math.exp(float(p[0]) - m_ref)) for p in parts)


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 255, 256, 257, 4097, 65536])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16, 64])
@pytest.mark.parametrize("step", [8, 16, 32, 64])
def test_kernel_chunking_covers_every_key_once(length, num_splits, step):
    chunks, active = kernel_chunks(length, num_splits, step)
    assert 1 <= active <= num_splits
    covered = [t for a, b in chunks for t in range(a, b)]
    assert covered == list(range(length))
    assert all(b > a for a, b in chunks)  # active splits are never empty
    # Balanced: active splits differ by at most one grain.
    sizes = [-(-(b - a) // step) for a, b in chunks]
    assert max(sizes) - min(sizes) <= 1
    # The last split (it holds the new slots and appends them) takes the smaller share.
    assert sizes[-1] == min(sizes)
    # Exactly one chunk owns the new token's slot (length - 1).
    assert sum(a <= length - 1 < b for a, b in chunks) == 1
    g = torch.Generator().manual_seed(length)
    scores = torch.randn(length, generator=g, dtype=torch.float64)
    values = torch.randn(length, 4, generator=g, dtype=torch.float64)
    out, _ = merge([partial(scores[a:b], values[a:b]) for a, b in chunks])
    torch.testing.assert_close(out, torch.softmax(scores, 0) @ values)
