"""Decode-attention latency against sequence length: mmha next to the peers, on one GPU.

``python -m mmha.bench --grid canonical`` runs the grid of ``shared/BENCHMARK.md`` in fp16 and
bf16; ``--quick`` a short subset; ``--batch/--heads/--kv-heads/--head-dim/--seq/--dtype`` a
custom sweep. Every method is checked against an fp32 reference before it is timed. Times are
medians of cold-L2 iterations (``triton.testing.do_bench``: the L2 is flushed before each call),
plus CUDA-graph replay times for mmha and SDPA. The streaming-read ceiling is measured in the
same run, and so is each cache size's read floor: the fastest streaming read of the row's K/V
bytes under the same timing, the best any kernel that reads them once can do here. Output: a
github table, JSON and CSV, and PNG plots when matplotlib is present.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import dispatch, layout, ops

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# (group, B, Hkv, S) of shared/BENCHMARK.md; Hq = 32, D = 128.
CANONICAL = [
    ("MHA latency", 1, 32, 1024), ("MHA latency", 1, 32, 4096), ("MHA latency", 1, 32, 16384),
    ("MHA latency", 1, 32, 65536),
    ("MHA b16", 16, 32, 512), ("MHA b16", 16, 32, 2048), ("MHA b16", 16, 32, 8192),
    ("MHA b16", 16, 32, 32768),
    ("MHA b64", 64, 32, 256), ("MHA b64", 64, 32, 1024), ("MHA b64", 64, 32, 4096),
    ("MHA b64", 64, 32, 16384),
    ("GQA b1", 1, 8, 4096), ("GQA b1", 1, 8, 65536),
    ("GQA b16", 16, 8, 2048), ("GQA b16", 16, 8, 32768),
    ("GQA b64", 64, 8, 1024), ("GQA b64", 64, 8, 8192),
]  # fmt: skip
QUICK = [
    ("MHA latency", 1, 32, 1024), ("MHA latency", 1, 32, 16384), ("MHA b16", 16, 32, 512),
    ("MHA b16", 16, 32, 8192), ("MHA b64", 64, 32, 256), ("GQA b1", 1, 8, 4096),
    ("GQA b16", 16, 8, 2048), ("GQA b64", 64, 8, 1024),
]  # fmt: skip


@dataclass
class Config:
    group: str
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.num_kv_heads * self.seq_len * self.head_dim * self.elem

    @property
    def step_bytes(self) -> int:
        """Bytes one decode step must move (shared/BENCHMARK.md)."""
        b, hq, hkv, d, e = self.batch, self.num_heads, self.num_kv_heads, self.head_dim, self.elem
        return (
            self.kv_bytes  # K and V cache, read once
            + b * (hq + 2 * hkv) * d * e  # qkv in
            + b * hq * d * e  # out
            + 2 * b * hkv * d * e  # new K/V written
        )


@dataclass
class Result:
    config: Config
    times_us: dict = field(default_factory=dict)  # method -> median us (cold L2)
    spread_us: dict = field(default_factory=dict)  # method -> (p20, p80)
    graph_us: dict = field(default_factory=dict)  # method -> us per call in graph replay
    errors: dict = field(default_factory=dict)  # method -> max abs error vs fp32 reference
    skipped: dict = field(default_factory=dict)  # method -> reason
    plan: str = ""
    floor: dict = field(default_factory=dict)  # read_floor() of the K/V bytes


# ----------------------------------------------------------------------------- ceiling
_SUM_KERNEL = None


def _sum_kernel():
    """The streaming-read kernel behind the ceiling (built on first use: Triton is imported lazily)."""
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


def sum_runner(nbytes: int, block: int = 4096, iters: int = 16, num_warps: int = 4):
    """A checked streaming sum of nbytes of fp32 (BLOCK x ITERS floats per program): returns the
    function that launches it."""
    import triton

    kernel = _sum_kernel()
    n = nbytes // 4
    x = torch.rand(n, device="cuda")
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, device="cuda")

    def run():
        kernel[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=num_warps)

    run()
    torch.cuda.synchronize()
    expect = x.sum(dtype=torch.float64).item()
    assert abs(out.sum(dtype=torch.float64).item() - expect) < 1e-3 * abs(expect), "streaming sum is wrong"
    return run


# Program shapes (BLOCK, ITERS, num_warps) the read floor tries; bench/read_floor.py searches wider.
FLOOR_SHAPES = ((1024, 1, 4), (2048, 1, 4), (4096, 1, 4), (4096, 4, 8))


def fastest_sum(nbytes: int, shapes=FLOOR_SHAPES):
    """Cold-L2 median us of the fastest of ``shapes`` reading nbytes, that shape, and its runner."""
    from triton.testing import do_bench

    best = None
    for shape in shapes:
        fn = sum_runner(nbytes, *shape)
        us = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        if best is None or us < best[0]:
            best = (us, shape, fn)
    return best


def read_floor(nbytes: int, graphs: bool = True, shapes=FLOOR_SHAPES) -> dict:
    """The fastest streaming read of nbytes under the benchmark's own timing (best of a few
    program shapes): what any kernel that reads those bytes once pays, launch included. ``us``:
    cold L2 (do_bench, which flushes the L2 by writing a buffer, so the timed call also evicts
    dirty lines); ``graph_us``: CUDA-graph replay of the fastest shape (nan without graphs)."""
    us, (block, iters, warps), fn = fastest_sum(nbytes, shapes)
    return {
        "us": us,
        "graph_us": graph_time_us(fn) if graphs else float("nan"),
        "shape": f"{block}x{iters} floats, {warps} warps per program",
    }


# Program shapes the ceiling tries. Until the ninth session it used only the first; the read
# floors of caches past 4 GB then came out 1-2.5 % above the ceiling (H200), so it takes the best.
CEILING_SHAPES = ((4096, 16, 4), (4096, 2, 8), (8192, 1, 8), (1024, 4, 8))


def read_ceiling_gbs(nbytes: int = 4 << 30) -> tuple[float, str]:
    """Streaming read bandwidth: a Triton kernel that sums a large buffer (reads only), cold L2,
    the fastest of a few program shapes."""
    us = fastest_sum(nbytes, CEILING_SHAPES)[0]
    return nbytes / (us * 1e-6) / 1e9, "Triton streaming sum of 4 GiB, best of 4 program shapes"


def launch_floor_us() -> float:
    """A one-element add under the benchmark's cold-L2 timing: what any launch costs there."""
    from triton.testing import do_bench

    one = torch.zeros(1, device="cuda")
    return do_bench(lambda: one.add_(1), warmup=25, rep=100, return_mode="median") * 1e3


# ----------------------------------------------------------------------------- methods
class Problem:
    """One configuration's tensors: mmha caches and the same K/V in SDPA's [B, H, S, D] layout."""

    def __init__(self, cfg: Config, seed: int = 0):
        self.cfg = cfg
        dt, dev = cfg.torch_dtype, "cuda"
        b, hq, hkv, d, s = cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len
        g = torch.Generator(device=dev).manual_seed(seed)
        self.qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g, device=dev).to(dt)
        k = torch.randn(b, hkv, s, d, generator=g, device=dev).to(dt)
        v = torch.randn(b, hkv, s, d, generator=g, device=dev).to(dt)
        q_new = self.qkv[:, : hq * d].view(b, hq, d)
        k_new = self.qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d)
        v_new = self.qkv[:, (hq + hkv) * d :].view(b, hkv, d)
        k[:, :, s - 1] = k_new  # the peers read the new token from their cache
        v[:, :, s - 1] = v_new
        self.q = q_new.unsqueeze(2).contiguous()  # [B, Hq, 1, D]
        self.k, self.v = k, v
        self.k_cache = layout.pack_k(k, layout="bhsd")
        self.v_cache = layout.pack_v(v, layout="bhsd")
        self.lengths = torch.full((b,), s - 1, dtype=torch.int32, device=dev)
        self.scale = 1.0 / math.sqrt(d)

    def reference(self, rows: list[int]) -> torch.Tensor:
        """fp32 attention for the given rows: ``[len(rows), Hq * D]``."""
        cfg = self.cfg
        group = cfg.num_heads // cfg.num_kv_heads
        outs = []
        for r in rows:
            q = self.q[r, :, 0].float()
            k = self.k[r].float().repeat_interleave(group, 0)
            v = self.v[r].float().repeat_interleave(group, 0)
            p = torch.softmax(torch.einsum("hd,hsd->hs", q, k) * self.scale, -1)
            outs.append(torch.einsum("hs,hsd->hd", p, v).reshape(-1))
        return torch.stack(outs)


# Largest max-abs error against the fp32 reference a method may have and still be timed.
TOLERANCE = {"fp16": 2e-2, "bf16": 6e-2, "fp32": 2e-4}


def plan_str(plan) -> str:
    """``variant/splits``, with ``xW`` where blocks have W warps rather than ``dispatch.WARPS``."""
    s = f"{plan.variant}/{plan.num_splits}"
    return s if plan.warps == dispatch.WARPS else f"{s}x{plan.warps}"


def mmha_fn(prob: Problem, num_splits: int, warps: int = dispatch.WARPS):
    """The operator on preallocated outputs and workspace, as ``KVCache.step`` calls it."""
    cfg = prob.cfg
    ws = ops.Workspace.allocate("cuda", cfg.batch, cfg.num_heads, cfg.head_dim, num_splits)
    out = torch.empty(cfg.batch, cfg.num_heads * cfg.head_dim, dtype=cfg.torch_dtype, device="cuda")
    lse = torch.empty(cfg.batch, cfg.num_heads, dtype=torch.float32, device="cuda")
    op = torch.ops.mmha.decode_attention.default
    args = (
        prob.qkv, prob.k_cache, prob.v_cache, prob.lengths, None, out, lse, ws.partials,
        ws.counters, cfg.num_heads, cfg.num_kv_heads, prob.scale, 0, 10000.0, False, num_splits, False,
        warps,
    )  # fmt: skip

    def fn():
        op(*args)
        return out

    return fn


def sdpa_fn(prob: Problem):
    """SDPA with q of length 1; the backend is chosen by the caller, outside the timed call."""
    gqa = prob.cfg.num_heads != prob.cfg.num_kv_heads
    b = prob.cfg.batch
    kw = {"enable_gqa": True} if gqa else {}

    def fn():
        return F.scaled_dot_product_attention(prob.q, prob.k, prob.v, **kw).reshape(b, -1)

    return fn


def eager_fn(prob: Problem):
    cfg = prob.cfg
    group = cfg.num_heads // cfg.num_kv_heads

    def fn():
        b, hkv, s, d = prob.k.shape
        q = prob.q.view(b, hkv, group, d)  # query heads of one kv head side by side
        scores = torch.matmul(q, prob.k.transpose(-1, -2)) * prob.scale  # [B, Hkv, G, S]
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(p, prob.v).reshape(b, -1)

    return fn


def flashinfer_fn(prob: Problem):
    import flashinfer  # noqa: F401  (skipped with a note where it is not installed)

    cfg = prob.cfg
    if cfg.batch != 1:
        raise RuntimeError("only the single-request API is wired up here")
    k = prob.k[0].transpose(0, 1).contiguous()  # [S, Hkv, D] (NHD)
    v = prob.v[0].transpose(0, 1).contiguous()
    q = prob.q[0, :, 0]

    def fn():
        return flashinfer.single_decode_with_kv_cache(q, k, v).reshape(1, -1)

    return fn


def graph_time_us(fn, calls: int = 20, replays: int = 20) -> float:
    """Median per-call time of ``calls`` back-to-back calls captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend

    return {
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa_default": None,
    }


PEERS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_default", "flashinfer", "eager")
MMHA = ("mmha", "mmha_single", "mmha_split")


def backend_context(name: str):
    """Context that selects the SDPA backend for ``name`` (entered once around all its calls)."""
    from torch.nn.attention import sdpa_kernel

    backend = sdpa_backends().get(name)
    return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()


def run_config(cfg: Config, graphs: bool = True, floors: dict | None = None) -> Result:
    """Times every method on one configuration, and the read floor of its K/V bytes (kept in
    ``floors`` by size, so rows of one cache size share one measurement)."""
    from triton.testing import do_bench

    res = Result(cfg)
    floors = {} if floors is None else floors
    if cfg.kv_bytes not in floors:
        floors[cfg.kv_bytes] = read_floor(cfg.kv_bytes, graphs)
    res.floor = floors[cfg.kv_bytes]
    prob = Problem(cfg)
    shape = ("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len,
             cfg.torch_dtype)  # fmt: skip
    plan = ops.plan_for(*shape)
    forced_split = ops.plan_for(*shape, "split")
    res.plan = plan_str(plan)
    fns = {
        "mmha": mmha_fn(prob, plan.num_splits, plan.warps),
        "mmha_single": mmha_fn(prob, 1, ops.plan_for(*shape, "single_pass").warps),
        "mmha_split": mmha_fn(prob, forced_split.num_splits, forced_split.warps),
    }
    for name in sdpa_backends():
        fns[name] = sdpa_fn(prob)
    fns["eager"] = eager_fn(prob)
    rows = sorted({0, cfg.batch - 1})
    ref = prob.reference(rows)
    tol = TOLERANCE[cfg.dtype]
    try:
        fns["flashinfer"] = flashinfer_fn(prob)
    except Exception as exc:  # ImportError or an unsupported shape
        res.skipped["flashinfer"] = f"{type(exc).__name__}: {exc}"[:120]
    for name, fn in fns.items():
        with backend_context(name):
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a peer backend that does not support this shape
                res.skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:120]
                continue
            err = (out[rows].float() - ref).abs().max().item()
            res.errors[name] = err
            if not math.isfinite(err) or err > tol:
                res.skipped[name] = f"wrong result: max error {err:.3g} > {tol}"
                continue
            q20, q50, q80 = do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
            res.times_us[name] = q50 * 1e3
            res.spread_us[name] = (q20 * 1e3, q80 * 1e3)
    if graphs:
        best_sdpa = min((n for n in res.times_us if n.startswith("sdpa")), key=res.times_us.get, default=None)
        for name in ("mmha", best_sdpa):
            if name is not None:
                with backend_context(name), contextlib.suppress(Exception):
                    res.graph_us[name] = graph_time_us(fns[name])
    del prob, fns
    torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------- report
def best_peer(res: Result) -> tuple[str | None, float]:
    peers = {k: v for k, v in res.times_us.items() if k in PEERS}
    if not peers:
        return None, float("nan")
    name = min(peers, key=peers.get)
    return name, peers[name]


def summarize(res: Result, ceiling: float) -> dict:
    cfg = res.config
    t = res.times_us.get("mmha", float("nan"))
    peer, peer_t = best_peer(res)
    gbs = cfg.step_bytes / (t * 1e-6) / 1e9
    g = res.graph_us.get("mmha", float("nan"))
    g_peer = min((v for k, v in res.graph_us.items() if k != "mmha"), default=float("nan"))
    floor_us, floor_graph_us = res.floor.get("us", NAN), res.floor.get("graph_us", NAN)
    return {
        **asdict(cfg),
        "kv_mb": cfg.kv_bytes / 1e6,
        "plan": res.plan,
        **{f"{m}_us": res.times_us.get(m, float("nan")) for m in MMHA + PEERS},
        "mmha_p20_us": res.spread_us.get("mmha", (float("nan"),) * 2)[0],
        "mmha_p80_us": res.spread_us.get("mmha", (float("nan"),) * 2)[1],
        "mmha_graph_us": g,
        "peer_graph_us": g_peer,
        "gbs": gbs,
        "pct_ceiling": 100 * gbs / ceiling,
        "pct_ceiling_graph": 100 * cfg.step_bytes / (g * 1e-6) / 1e9 / ceiling,
        # A pure streaming read of the K/V bytes, timed the same ways (read_floor()).
        "read_floor_us": floor_us,
        "read_floor_graph_us": floor_graph_us,
        "pct_ceiling_floor": 100 * cfg.kv_bytes / (floor_us * 1e-6) / 1e9 / ceiling,
        "pct_ceiling_floor_graph": 100 * cfg.kv_bytes / (floor_graph_us * 1e-6) / 1e9 / ceiling,
        "best_peer": peer,
        "best_peer_us": peer_t,
        "speedup": peer_t / t,
        "graph_speedup": g_peer / g,
        "errors": res.errors,
        "skipped": res.skipped,
    }


NAN = float("nan")


def fmt(x: float, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def table(rows: list[dict], header: dict) -> str:
    from tabulate import tabulate

    head = (
        f"GPU: {header['gpu']} | torch {header['torch']} | CUDA {header['cuda']} | "
        f"read ceiling {header['ceiling_gbs']:.0f} GB/s ({header['ceiling_how']})"
    )
    cols = ["dtype", "B", "Hq", "Hkv", "D", "S", "KV MB", "plan", "mmha us", "single", "split",
            "cudnn", "flash", "effic.", "default", "flashinfer", "eager", "mmha graph",
            "peer graph", "GB/s", "% ceil", "% ceil graph", "read floor", "floor graph",
            "best peer", "speedup"]  # fmt: skip
    body = []
    for r in rows:
        body.append([
            r["dtype"], r["batch"], r["num_heads"], r["num_kv_heads"], r["head_dim"],
            r["seq_len"], fmt(r["kv_mb"]), r["plan"], fmt(r["mmha_us"]),
            fmt(r["mmha_single_us"]), fmt(r["mmha_split_us"]), fmt(r["sdpa_cudnn_us"]),
            fmt(r["sdpa_flash_us"]), fmt(r["sdpa_efficient_us"]), fmt(r["sdpa_default_us"]),
            fmt(r["flashinfer_us"]), fmt(r["eager_us"]), fmt(r["mmha_graph_us"]),
            fmt(r["peer_graph_us"]), fmt(r["gbs"], 0), fmt(r["pct_ceiling"]),
            fmt(r["pct_ceiling_graph"]), fmt(r.get("read_floor_us", NAN)),
            fmt(r.get("read_floor_graph_us", NAN)), r["best_peer"] or "-", fmt(r["speedup"], 2) + "x",
        ])  # fmt: skip
    return head + "\n\n" + tabulate(body, headers=cols, tablefmt="github")


def plot(rows: list[dict], header: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    groups = sorted({(r["dtype"], r["group"], r["head_dim"]) for r in rows})
    fig, axes = plt.subplots(
        math.ceil(len(groups) / 3), min(3, len(groups)), figsize=(15, 4 * math.ceil(len(groups) / 3)),
        squeeze=False,
    )  # fmt: skip
    for ax, (dt, grp, d) in zip(axes.flat, groups, strict=False):
        sel = sorted((r for r in rows if (r["dtype"], r["group"], r["head_dim"]) == (dt, grp, d)),
                     key=lambda r: r["seq_len"])  # fmt: skip
        xs = [r["seq_len"] for r in sel]
        for m in ("mmha", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flashinfer", "eager"):
            ys = [r[f"{m}_us"] for r in sel]
            if any(not math.isnan(y) for y in ys):
                ax.plot(xs, ys, marker="o", label=m, linewidth=2.5 if m == "mmha" else 1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{grp} {dt} D={d}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("latency (us, cold L2)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{header['gpu']}: decode attention latency")
    fig.tight_layout()
    p = out_dir / "latency.png"
    fig.savefig(p, dpi=90)
    paths.append(p)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['dtype']} B{r['batch']} Hkv{r['num_kv_heads']} D{r['head_dim']} S{r['seq_len']}"
              for r in rows]  # fmt: skip
    ax.bar(range(len(rows)), [r["pct_ceiling"] for r in rows], label="cold L2")
    ax.plot(range(len(rows)), [r["pct_ceiling_graph"] for r in rows], "r.", label="graph replay")
    ax.plot(range(len(rows)), [r.get("pct_ceiling_floor", NAN) for r in rows], "k_", markersize=9,
            label="read floor (pure read of the K/V, cold)")  # fmt: skip
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("% of read ceiling")
    ax.axhline(100, color="k", linewidth=0.5)
    ax.legend()
    fig.tight_layout()
    p = out_dir / "pct_ceiling.png"
    fig.savefig(p, dpi=90)
    paths.append(p)
    plt.close(fig)
    return paths


def build_configs(args) -> list[Config]:
    dtypes = args.dtype or (["fp16", "bf16"] if args.grid == "canonical" else ["fp16"])
    cfgs = []
    if args.grid in ("canonical", "quick"):
        grid = CANONICAL if args.grid == "canonical" else QUICK
        for dt in dtypes:
            cfgs += [Config(g, b, 32, hkv, 128, s, dt) for g, b, hkv, s in grid]
        if args.grid == "canonical" and not args.no_extras:
            for d in (64, 256):
                for g, b, hkv, s in (("MHA latency", 1, 32, 4096), ("MHA b16", 16, 32, 2048),
                                     ("GQA b16", 16, 8, 2048)):  # fmt: skip
                    cfgs.append(Config(g, b, 32, hkv, d, s, "fp16"))
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                cfgs.append(Config("small-head B*S=16K", 16384 // s, 16, 16, 64, s, "fp16"))
    else:
        for dt in dtypes:
            for b in args.batch:
                for s in args.seq:
                    cfgs.append(Config("custom", b, args.heads, args.kv_heads, args.head_dim, s, dt))
    return cfgs


def progress(items, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmha.bench", description=__doc__.split("\n")[0])
    p.add_argument("--grid", choices=["canonical", "quick", "custom"], default="custom")
    p.add_argument("--quick", action="store_true", help="the 2-minute subset (same as --grid quick)")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--dtype", choices=list(DTYPES), nargs="+")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replay timing")
    p.add_argument("--no-extras", action="store_true", help="canonical grid without extra rows")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    args = p.parse_args(argv)
    if args.quick:
        args.grid = "quick"
    if not torch.cuda.is_available():
        print("mmha.bench: no CUDA GPU here; nothing to time (the reference path runs on CPU).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("mmha.bench needs triton (do_bench and the read-ceiling kernel)")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.cuda.current_device()
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceiling, how = read_ceiling_gbs()
    header = {
        "gpu": torch.cuda.get_device_name(dev),
        "sms": num_sms,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "ceiling_gbs": ceiling,
        "ceiling_how": how,
        "grid": args.grid,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    rows = []
    floors: dict = {}
    for cfg in progress(build_configs(args), "mmha.bench"):
        rows.append(summarize(run_config(cfg, graphs=not args.no_graph, floors=floors), ceiling))
    text = table(rows, header)
    print(text)
    (args.out / "bench.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    with open(args.out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k not in ("errors", "skipped")],
                           extrasaction="ignore")  # fmt: skip
        w.writeheader()
        w.writerows(rows)
    (args.out / "bench.md").write_text(text + "\n")
    for path in plot(rows, header, args.out):
        print(f"wrote {path}")
    skipped = {f"{r['dtype']} B{r['batch']} S{r['seq_len']}": r["skipped"] for r in rows if r["skipped"]}
    if skipped:
        print("skipped methods:", json.dumps(skipped, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
