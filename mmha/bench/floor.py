"""The read ceiling and the read floor: how fast this GPU streams bytes it reads once.

The floor of a row is the fastest streaming read of its K/V bytes timed like the row itself (the
decode timing: ``layers`` reads of distinct buffers in one graph): what any kernel that reads
those bytes once pays here, launch included. The ceiling is the bandwidth of a streaming read of
4 GiB. Both use one Triton sum kernel, the fastest of a few program shapes.
"""

from __future__ import annotations

import torch

from . import timing

_SUM_KERNEL = None


def _sum_kernel():
    """The streaming-read kernel (built on first use: Triton is imported lazily)."""
    global _SUM_KERNEL
    if _SUM_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
            pid = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements on large caches
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            base = pid * BLOCK * ITERS
            for i in range(ITERS):
                offs = base + i * BLOCK + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
            tl.store(out_ptr + pid, tl.sum(acc))

        _SUM_KERNEL = kernel
    return _SUM_KERNEL


# Program shapes (floats per block, iterations, warps) the floor and the ceiling try.
FLOOR_SHAPES = ((1024, 1, 4), (2048, 1, 4), (4096, 1, 4), (4096, 4, 8))
CEILING_SHAPES = ((4096, 16, 4), (4096, 2, 8), (8192, 1, 8), (1024, 4, 8))


def sum_call(x: torch.Tensor, shape: tuple[int, int, int]):
    """A function that sums the fp32 buffer x with one launch of the given shape."""
    import triton

    block, iters, warps = shape
    kernel = _sum_kernel()
    n = x.numel()
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, device=x.device)

    def run():
        kernel[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps)
        return out

    return run


def _checked(x: torch.Tensor, shape) -> None:
    out = sum_call(x, shape)()
    expect = x.sum(dtype=torch.float64).item()
    got = out.sum(dtype=torch.float64).item()
    assert abs(got - expect) <= 1e-3 * abs(expect), f"streaming sum is wrong: {got} != {expect}"


def read_floor_decode(nbytes: int, layers: int, shapes=FLOOR_SHAPES) -> dict:
    """Decode timing of ``layers`` streaming reads of distinct nbytes buffers: the fastest shape."""
    bufs = [torch.rand(nbytes // 4, device="cuda") for _ in range(layers)]
    best = None
    for shape in shapes:
        _checked(bufs[0], shape)
        t = timing.decode_us([sum_call(x, shape) for x in bufs])
        if best is None or t["us"] < best["us"]:
            best = {**t, "shape": "{}x{} floats, {} warps".format(*shape)}
    del bufs
    torch.cuda.empty_cache()
    return best


def read_floor_cold(nbytes: int, shapes=FLOOR_SHAPES) -> float:
    """Cold-L2 single-call us (``do_bench``) of the fastest shape reading nbytes."""
    x = torch.rand(nbytes // 4, device="cuda")
    best = min(timing.cold_us(sum_call(x, s)) for s in shapes)
    del x
    torch.cuda.empty_cache()
    return best


def read_ceiling_gbs(nbytes: int = 4 << 30) -> tuple[float, str]:
    """Streaming read bandwidth of 4 GiB (cold L2, fastest of a few shapes)."""
    x = torch.rand(nbytes // 4, device="cuda")
    _checked(x, CEILING_SHAPES[0])
    us = min(timing.cold_us(sum_call(x, s)) for s in CEILING_SHAPES)
    del x
    torch.cuda.empty_cache()
    return nbytes / (us * 1e-6) / 1e9, "Triton streaming sum of 4 GiB, best of 4 program shapes"


def read_gemm_tflops(n: int = 8192, dtype: torch.dtype = torch.float16) -> tuple[float, str]:
    """Dense matrix-product throughput: one ``n`` x ``n`` x ``n`` product of random ``dtype``
    matrices through torch (cuBLAS), median of timed calls. What a compute-bound attention step
    (a tree step's Q.K and P.V) can at best approach on this GPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ab = [torch.randn(n, n, device="cuda", dtype=dtype, generator=g) for _ in range(2)]
    us = timing.cold_us(lambda: ab[0] @ ab[1])
    ab.clear()
    torch.cuda.empty_cache()
    return 2 * n**3 / (us * 1e-6) / 1e12, f"torch.matmul, {n}^3, {str(dtype).replace('torch.', '')}"


def read_attention_tflops(
    seq: int = 8192, heads: int = 32, head_dim: int = 128, dtype: torch.dtype = torch.float16
) -> tuple[float, str]:
    """Dense attention throughput: one non-causal ``scaled_dot_product_attention`` of ``heads``
    heads over ``seq`` queries and keys of random ``dtype``, per SDPA backend this torch has (cuDNN,
    flash, memory-efficient), the fastest; flops 4 x heads x seq^2 x head_dim. What the best
    attention kernel on this GPU reaches where compute is all there is: a tree step's target that
    needs more TFLOP/s than this is beyond today's attention kernels, not only mmha's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(1, heads, seq, head_dim, device="cuda", dtype=dtype, generator=g) for _ in range(3)]
    flops = 4 * heads * seq * seq * head_dim
    best, how = 0.0, ""
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(*qkv)
                us = timing.cold_us(lambda: torch.nn.functional.scaled_dot_product_attention(*qkv))
        except RuntimeError:  # a backend this GPU or build does not offer
            continue
        if flops / (us * 1e-6) / 1e12 > best:
            best, how = flops / (us * 1e-6) / 1e12, name
    qkv.clear()
    torch.cuda.empty_cache()
    dt = str(dtype).replace("torch.", "")
    return best, f"{how}, {heads} heads x {seq} queries x {seq} keys, head dim {head_dim}, {dt}"
