"""What the benchmark times: configurations, the tensors of one call of each method, and the
fp32 reference every method is checked against before it is timed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Cache dtypes other than the activations': fp8 e4m3, int8 and int4 (its codes' dtype, uint8; mmha
# only; the peers run the same shape with caches of the activations' dtype).
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}
# Scale of the benchmark's fp8 caches: N(0, 1) values up to ~5.5 within e4m3's +-448.
FP8_BENCH_SCALE = 5.5 / 448
# The benchmark's int8 caches: uniform codes in [-127, 127], every token's scale this (values up
# to ~4.5).
INT8_BENCH_SCALE = 4.5 / 127
# The benchmark's int4 caches: uniform codes, every scale this and every zero point -4.5 (values
# in [-4.5, 4.5]); the rows' lengths S - 2, so a step reads S - 1 keys and does not complete a K
# group (a step that does, one in 64, also quantises it).
INT4_BENCH_SCALE = 9.0 / 15

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
    ("MHA latency", 1, 32, 1024), ("MHA latency", 1, 32, 65536), ("MHA b16", 16, 32, 512),
    ("MHA b64", 64, 32, 256), ("GQA b1", 1, 8, 4096), ("GQA b16", 16, 8, 2048),
    ("GQA b64", 64, 8, 1024),
]  # fmt: skip
# Off the fp16 D=128 grid: head dims 64 and 256 on a few rows, and the small-head configuration
# (D = 64, Hq = 16, B * S = 16384 tokens).
EXTRA_ROWS = (("MHA latency", 1, 32, 4096), ("MHA b16", 16, 32, 2048), ("GQA b16", 16, 8, 2048))
SMALL_HEAD_SEQS = (512, 1024, 2048, 4096, 8192, 16384)

# Largest max-abs error against the fp32 reference a method may have and still be timed.
TOLERANCE = {"fp16": 2e-2, "bf16": 6e-2, "fp32": 2e-4}

# Decode timing: as many distinct caches per timed graph as make >= 1 GiB, 2 to 32 of them.
# (Each call has its own cache, qkv and output; mmha's calls share one lengths tensor, as the
# layers of a decode step share KVCache.lengths.)
LAYER_BYTES = 1 << 30
MIN_LAYERS, MAX_LAYERS = 2, 32


@dataclass(frozen=True)
class Config:
    group: str
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    dtype: str
    kv: str = ""  # "" (the caches hold dtype), "fp8", "int8" or "int4"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv] if self.kv else self.torch_dtype

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def kv_elem(self) -> int:
        return torch.empty((), dtype=self.kv_torch_dtype).element_size()

    @property
    def kv_bytes(self) -> int:
        """mmha's cache bytes (fp8 rows: e4m3; int8 rows: the codes and their fp32 token scales; int4
        rows: the codes, K's fp16 scales and zero points per 64 tokens, V's per token)."""
        if self.kv == "int4":
            d = self.head_dim
            return self.batch * self.num_kv_heads * self.seq_len * (d + d // 16 + 4)
        per_token = self.head_dim * self.kv_elem + (4 if self.kv == "int8" else 0)
        return 2 * self.batch * self.num_kv_heads * self.seq_len * per_token

    def same_shape(self, kv: str = "") -> Config:
        """This row with caches of another dtype."""
        return Config(self.group, self.batch, self.num_heads, self.num_kv_heads, self.head_dim, self.seq_len,
                      self.dtype, kv)  # fmt: skip

    @property
    def step_bytes(self) -> int:
        """Bytes one decode step must move (shared/BENCHMARK.md)."""
        b, hq, hkv, d, e = self.batch, self.num_heads, self.num_kv_heads, self.head_dim, self.elem
        return (
            self.kv_bytes  # K and V cache, read once
            + b * (hq + 2 * hkv) * d * e  # qkv in
            + b * hq * d * e  # out
            + 2 * b * hkv * d * self.kv_elem  # new K/V written
        )

    @property
    def layers(self) -> int:
        """Calls per timed graph in the decode timing, each on its own cache:
        max(2, min(32, ceil(1 GiB / cache bytes)))."""
        return max(MIN_LAYERS, min(MAX_LAYERS, math.ceil(LAYER_BYTES / self.kv_bytes)))

    @property
    def label(self) -> str:
        heads = f"Hq={self.num_heads} Hkv={self.num_kv_heads}"
        kv = f" kv={self.kv}" if self.kv else ""
        return f"{self.dtype}{kv} B={self.batch} {heads} D={self.head_dim} S={self.seq_len}"


class Problem:
    """One call's tensors, random (never zeros). ``kind`` "mmha": qkv and the packed caches, the
    new token appended at slot S - 1 (so the call reads S keys; fp8 rows: N(0, 1) values quantised
    with one scale ``FP8_BENCH_SCALE`` per kv head, ``k_scale`` / ``v_scale``); "sdpa": q and the same-sized
    K/V in ``[B, H, S, D]`` with the new token already at slot S - 1. ``lengths``: an int32
    tensor of S - 1 per row to share (the layers of a decode step share ``KVCache.lengths``)."""

    def __init__(self, cfg: Config, kind: str, seed: int = 0, lengths: torch.Tensor | None = None):
        from .. import layout

        self.cfg, self.kind = cfg, kind
        dt, dev = cfg.torch_dtype, "cuda"
        b, hq, hkv, d, s = cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len
        g = torch.Generator(device=dev).manual_seed(seed)
        self.scale = 1.0 / math.sqrt(d)
        self.qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g, device=dev).to(dt)
        self.k_scale = self.v_scale = None
        if kind == "mmha" and cfg.kv == "int8":
            self._int8_caches(cfg, g, lengths)
        elif kind == "mmha" and cfg.kv == "int4":
            self._int4_caches(cfg, g, lengths)
        elif kind == "mmha" and cfg.kv:
            kv_dt = cfg.kv_torch_dtype
            self.k_scale = torch.full((hkv,), FP8_BENCH_SCALE, device=dev)
            self.v_scale = torch.full((hkv,), FP8_BENCH_SCALE, device=dev)
            self.k_cache = torch.empty(layout.k_cache_shape(b, hkv, s, d, kv_dt), device=dev, dtype=kv_dt)
            self.v_cache = torch.empty(layout.v_cache_shape(b, hkv, s, d), device=dev, dtype=kv_dt)
            for c in (self.k_cache, self.v_cache):  # a row at a time: no fp32 copy of a whole cache
                for r in range(b):
                    x = torch.randn(c[r].shape, generator=g, device=dev) / FP8_BENCH_SCALE
                    c[r] = x.clamp(-448, 448).to(kv_dt)
            self.lengths = (
                lengths if lengths is not None else torch.full((b,), s - 1, dtype=torch.int32, device=dev)
            )
        elif kind == "mmha":
            self.k_cache = torch.randn(
                layout.k_cache_shape(b, hkv, s, d, dt), generator=g, device=dev, dtype=dt
            )
            self.v_cache = torch.randn(layout.v_cache_shape(b, hkv, s, d), generator=g, device=dev, dtype=dt)
            self.lengths = (
                lengths if lengths is not None else torch.full((b,), s - 1, dtype=torch.int32, device=dev)
            )
        elif kind == "sdpa":
            self.q = self.qkv[:, : hq * d].reshape(b, hq, 1, d).contiguous()
            self.k = torch.randn(b, hkv, s, d, generator=g, device=dev, dtype=dt)
            self.v = torch.randn(b, hkv, s, d, generator=g, device=dev, dtype=dt)
            self.k[:, :, s - 1] = self.qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d)
            self.v[:, :, s - 1] = self.qkv[:, (hq + hkv) * d :].view(b, hkv, d)
            self.k8 = self.v8 = None
            if cfg.kv == "fp8":  # fp8 peers (FlashInfer): e4m3 copies, and K/V as they dequantise
                kv_dt, sc = cfg.kv_torch_dtype, FP8_BENCH_SCALE
                self.k8 = (self.k.float() / sc).clamp(-448, 448).to(kv_dt)
                self.v8 = (self.v.float() / sc).clamp(-448, 448).to(kv_dt)
                self.k = (self.k8.float() * sc).to(dt)
                self.v = (self.v8.float() * sc).to(dt)
        else:
            raise ValueError(f"kind must be 'mmha' or 'sdpa', got {kind!r}")

    def _int8_caches(self, cfg: Config, g: torch.Generator, lengths: torch.Tensor | None) -> None:
        """An int8 row's caches: uniform codes, every token's scale INT8_BENCH_SCALE (the planes
        ``k_scale`` / ``v_scale`` ``[B, Hkv, S]``)."""
        from .. import layout

        b, hkv, d, s, dev = cfg.batch, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len, "cuda"
        shape = layout.k_cache_shape(b, hkv, s, d, torch.int8)
        self.k_cache = torch.randint(-127, 128, shape, generator=g, device=dev, dtype=torch.int8)
        self.v_cache = torch.randint(-127, 128, layout.v_cache_shape(b, hkv, s, d), generator=g, device=dev,
                                     dtype=torch.int8)  # fmt: skip
        self.k_scale = torch.full((b, hkv, s), INT8_BENCH_SCALE, device=dev)
        self.v_scale = torch.full((b, hkv, s), INT8_BENCH_SCALE, device=dev)
        self.lengths = (
            lengths if lengths is not None else torch.full((b,), s - 1, dtype=torch.int32, device=dev)
        )

    def _int4_caches(self, cfg: Config, g: torch.Generator, lengths: torch.Tensor | None) -> None:
        """An int4 row's cache (``self.int4``, an ``mmha.int4.Int4Cache``): uniform codes, every scale
        INT4_BENCH_SCALE and zero point -4.5, an N(0, 1) K residual; lengths S - 2."""
        from .. import int4

        b, hkv, d, s, dev = cfg.batch, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len, "cuda"
        c = int4.Int4Cache.empty(b, hkv, -(-s // int4.GROUP) * int4.GROUP, d, cfg.torch_dtype, dev)
        for t in (c.k_codes, c.v_codes):
            t.copy_(torch.randint(0, 256, t.shape, generator=g, device=dev, dtype=torch.uint8))
        for t in (c.k_scale, c.v_scale):
            t.fill_(INT4_BENCH_SCALE)
        for t in (c.k_zero, c.v_zero):
            t.fill_(-4.5)
        c.k_residual.copy_(torch.randn(c.k_residual.shape, generator=g, device=dev).to(cfg.torch_dtype))
        self.int4 = c
        self.k_cache, self.v_cache = c.k_codes, c.v_codes
        self.lengths = (
            lengths if lengths is not None else torch.full((b,), s - 2, dtype=torch.int32, device=dev)
        )

    def kv_rows(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[n, Hq, D]``, k and v ``[n, Hkv, S, D]`` of the given rows, as the call sees them
        (the new token at slot S - 1)."""
        from .. import layout
        from ..spec import quantize_fp8

        cfg = self.cfg
        hq, hkv, d, s = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len
        q = self.qkv[rows, : hq * d].reshape(len(rows), hq, d)
        if self.kind == "sdpa":
            return q, self.k[rows], self.v[rows]
        if cfg.kv == "int4":  # the S - 1 keys as the format reads them, after the call's append
            kv = [self.int4.read(r, s - 1) for r in rows]
            return q, torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])
        k = layout.unpack_k(self.k_cache[rows], layout="bhsd").float()
        v = layout.unpack_v(self.v_cache[rows], layout="bhsd").float()
        k_new = self.qkv[rows, hq * d : (hq + hkv) * d].view(len(rows), hkv, d).float()
        v_new = self.qkv[rows, (hq + hkv) * d :].view(len(rows), hkv, d).float()
        if self.cfg.kv == "int8":  # dequantised, the new token as the step stores it (per token)
            from .. import quant

            k = k * self.k_scale[rows][..., None]
            v = v * self.v_scale[rows][..., None]
            k_new = quant.dequantize(*quant.quantize(k_new, 8))
            v_new = quant.dequantize(*quant.quantize(v_new, 8))
        elif self.k_scale is not None:  # fp8: dequantised, the new token as the cache stores it
            ks, vs = self.k_scale.view(1, hkv, 1, 1), self.v_scale.view(1, hkv, 1, 1)
            k, v = k * ks, v * vs
            k_new = quantize_fp8(k_new, self.k_scale).float() * ks[..., 0]
            v_new = quantize_fp8(v_new, self.v_scale).float() * vs[..., 0]
        k[:, :, s - 1] = k_new
        v[:, :, s - 1] = v_new
        return q, k, v

    def error(self, out: torch.Tensor) -> float:
        """Max abs difference of a method's output from the fp32 reference on the first and last
        rows."""
        rows = sorted({0, self.cfg.batch - 1})
        return (out[rows].float() - self.reference(rows)).abs().max().item()

    def reference(self, rows: list[int]) -> torch.Tensor:
        """fp32 attention for the given rows: ``[len(rows), Hq * D]``."""
        q, k, v = (t.float() for t in self.kv_rows(rows))
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("nhd,nhsd->nhs", q, k) * self.scale, -1)
        return torch.einsum("nhs,nhsd->nhd", p, v).reshape(len(rows), -1)


def layer_problems(cfg: Config, kind: str) -> list[Problem]:
    """The decode timing's ``cfg.layers`` problems: distinct caches and qkv, one shared lengths
    tensor (the layers of a decode step share ``KVCache.lengths``; int4 rows: S - 2, see
    INT4_BENCH_SCALE)."""
    new_slot = cfg.seq_len - (2 if cfg.kv == "int4" else 1)
    lengths = torch.full((cfg.batch,), new_slot, dtype=torch.int32, device="cuda")
    return [Problem(cfg, kind, seed=i, lengths=lengths) for i in range(cfg.layers)]


def build_configs(
    grid: str, dtypes: list[str] | None = None, extras: bool = True, custom=None, fp8: bool = False,
    int8: bool = False, int4: bool = False,
) -> list[Config]:  # fmt: skip
    """The rows of a grid: "canonical" (fp16 and bf16, plus the extra rows in fp16), "quick", or
    "custom" (``custom``: batch list, seq list, heads, kv heads (an int or a list), head dim).
    ``fp8`` / ``int8`` / ``int4``: each fp16 / bf16 row of head dim 128 (custom: every 16-bit row)
    also with such a cache, after it."""
    cfgs = _grid_configs(grid, dtypes, extras, custom)
    kinds = [k for k, on in (("fp8", fp8), ("int8", int8), ("int4", int4)) if on]
    if not kinds:
        return cfgs
    out = []
    for c in cfgs:
        out.append(c)
        if c.dtype != "fp32" and (grid == "custom" or c.head_dim == 128):
            out += [c.same_shape(k) for k in kinds]
    return out


def _grid_configs(grid: str, dtypes: list[str] | None, extras: bool, custom) -> list[Config]:
    if grid in ("canonical", "quick"):
        dtypes = dtypes or (["fp16", "bf16"] if grid == "canonical" else ["fp16"])
        rows = CANONICAL if grid == "canonical" else QUICK
        cfgs = [Config(g, b, 32, hkv, 128, s, dt) for dt in dtypes for g, b, hkv, s in rows]
        if grid == "canonical" and extras:
            for d in (64, 256):
                cfgs += [Config(g, b, 32, hkv, d, s, "fp16") for g, b, hkv, s in EXTRA_ROWS]
            cfgs += [Config("small-head B*S=16K", 16384 // s, 16, 16, 64, s, "fp16") for s in SMALL_HEAD_SEQS]
        return cfgs
    batches, seqs, heads, kv_heads, head_dim = custom
    kv_list = [kv_heads] if isinstance(kv_heads, int) else list(kv_heads)
    return [
        Config("custom", b, heads, hkv, head_dim, s, dt)
        for dt in (dtypes or ["fp16"])
        for hkv in kv_list
        for b in batches
        for s in seqs
    ]
