"""Shared helpers: random decode cases, the tolerance rule, bitwise cache comparison."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from mmha import layout, ops, reference
from mmha._ext import extension_available
from mmha.spec import AttentionSpec, Rotary

HAS_GPU = torch.cuda.is_available() and extension_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Floor of the tolerance rule, in units of max|ref| (output rounding of each dtype and a bit).
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


@dataclass
class Case:
    qkv: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    lengths: torch.Tensor
    num_heads: int
    num_kv_heads: int
    bias: torch.Tensor | None = None
    rotary: dict = field(default_factory=dict)  # Rotary's fields: dim, theta, interleaved
    mods: dict = field(default_factory=dict)  # AttentionSpec's other fields (window, softcap, scale, ...)

    def spec(self, **changes) -> AttentionSpec:
        """The case's ``AttentionSpec`` (with ``changes``)."""
        return AttentionSpec(rotary=Rotary(**self.rotary), **{**self.mods, **changes})

    def kwargs(self, **changes) -> dict:
        return dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, qkv_bias=self.bias,
            attention=self.spec(**changes),
        )  # fmt: skip

    def clone_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def make_case(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    lengths: list[int],
    max_seq_len: int,
    dtype: torch.dtype = torch.float16,
    *,
    seed: int = 0,
    device: str = "cuda",
    bias: bool = False,
    rotary_dim: int = 0,
    rotary_interleaved: bool = False,
    rotary_theta: float = 10000.0,
    unused_fill: float = float("nan"),
    value_scale: float = 1.0,
) -> Case:
    """Random qkv and caches; slots at or past each row's length hold ``unused_fill``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim

    def randn(*shape):
        return (torch.randn(*shape, generator=g) * value_scale).to(dtype).to(device)

    qkv = randn(batch, width)
    k = randn(batch, max_seq_len, num_kv_heads, head_dim)
    v = randn(batch, max_seq_len, num_kv_heads, head_dim)
    slot = torch.arange(max_seq_len, device=device)[None, :, None, None]
    lens = torch.tensor(lengths, device=device)[:, None, None, None]
    k = torch.where(slot < lens, k, torch.full_like(k, unused_fill))
    v = torch.where(slot < lens, v, torch.full_like(v, unused_fill))
    rotary = {}
    if rotary_dim:
        rotary = dict(dim=rotary_dim, theta=rotary_theta, interleaved=rotary_interleaved)
    return Case(
        qkv=qkv,
        k_cache=layout.pack_k(k),
        v_cache=layout.pack_v(v),
        lengths=torch.tensor(lengths, dtype=torch.int32, device=device),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        bias=randn(width) if bias else None,
        rotary=rotary,
    )


def launched_kernels(fn) -> list[str]:
    """Names of the CUDA kernels ``fn`` launches (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def lean_kernel_name(name: str) -> bool:
    """Whether a decode_attention_kernel's name (mangled, or as the profiler demangles it) is a lean
    unit's (csrc/kernels/lean_kernels.h: its last template argument, LEAN, true)."""
    if name.startswith("_Z"):
        return name.endswith("Lb1EEEvNS_10MmhaParamsE")
    return name.rsplit("(", 1)[0].rstrip().endswith("true>")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view, so NaN slots compare equal to themselves."""
    return t.contiguous().view(torch.uint8)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(bits(a), bits(b)):
        diff = (bits(a) != bits(b)).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}")


def run_reference(case: Case, compute_dtype=torch.float32):
    kc, vc = case.clone_caches()
    out, lse = reference.decode_step(
        case.qkv, kc, vc, case.lengths, return_lse=True, compute_dtype=compute_dtype,
        **case.kwargs(),
    )  # fmt: skip
    return out, lse, kc, vc


# fp32's unit roundoff, and how many of them a logit may carry: its dot product's sums (in any
# order), the rotation of q and k, the scale and log2(e) (bench/probes/fp32_rounding.py).
U32 = 2.0**-24
LOGIT_ROUNDINGS = 4


def logit_spread(case: Case) -> float:
    """How far fp32 rounding of the logits alone may move an output value, to first order, from
    the fp64 reference: max over rows, heads and dims of sum_j p_j |v_jd - out_d| dl_j, with dl_j
    = LOGIT_ROUNDINGS * U32 * scale * sum_i |q_i k_ji| (any summation order's error bound
    scale). Negligible for typical rows; large where large logits nearly tie (a fuzzed fp32 row
    with logits near 235 and two weights of 0.61 / 0.39 moved by ~1e-3 whatever the order).
    0 for cases with score modifiers (the rule without this term)."""
    if case.spec().has_mods:
        return 0.0
    hq, hkv = case.num_heads, case.num_kv_heads
    d = case.v_cache.shape[-1]
    x = case.qkv.double()
    if case.bias is not None:
        x = x + case.bias.double()
    kc, vc = case.k_cache.double(), case.v_cache.double()  # copies: the new tokens go into these
    q, k_new, v_new, _ = reference.new_tokens(
        x,
        case.lengths.long(),
        hq,
        hkv,
        d,
        case.spec(),
        kc,
        None,
        None,
        case.qkv.dtype,
    )
    spread = 0.0
    for row, n in enumerate(case.lengths.tolist()):
        kc[row, :, :, n, :] = k_new[row].reshape(hkv, d // kc.shape[-1], kc.shape[-1])
        vc[row, :, n, :] = v_new[row]
        keys, values = reference.cached_kv(kc, vc, row, n + 1, None, None, torch.float64)
        keys, values = keys.repeat_interleave(hq // hkv, 0), values.repeat_interleave(hq // hkv, 0)
        weights = torch.softmax(torch.einsum("hd,hld->hl", q[row], keys) / math.sqrt(d), dim=-1)
        out = torch.einsum("hl,hld->hd", weights, values)
        dl = LOGIT_ROUNDINGS * U32 / math.sqrt(d) * torch.einsum("hd,hld->hl", q[row].abs(), keys.abs())
        moved = torch.einsum("hl,hld->hd", weights * dl, (values - out[:, None, :]).abs())
        spread = max(spread, moved.max().item())
    return spread


def check_against_reference(
    case: Case, out: torch.Tensor, lse: torch.Tensor | None = None, rope_ulps: bool = False
):
    """Tolerance rule: |kernel - ref64| <= 2 |torch_in_dtype - ref64| + floor * max|ref64| +
    logit_spread (fp32 rounding of the logits, to first order: matters only for ill-conditioned
    rows, where torch's one draw of rounding can land far closer than another order's)."""
    dtype = case.qkv.dtype
    ref, ref_lse, _, _ = run_reference(case, torch.float64)
    low, _, _, _ = run_reference(case, dtype)
    assert torch.isfinite(out).all(), "kernel output has non-finite values"
    err = (out.double() - ref.double()).abs().max().item()
    base = (low.double() - ref.double()).abs().max().item()
    scale = max(1.0, ref.double().abs().max().item())
    spread = logit_spread(case)
    tol = 2 * base + FLOOR[dtype] * scale + spread
    assert err <= tol, (
        f"max error {err:.3e} > tolerance {tol:.3e} (torch {dtype}: {base:.3e}, logit spread {spread:.3e})"
    )
    if lse is not None:
        lse_err = (lse.double() - ref_lse.double()).abs().max().item()
        assert lse_err <= 1e-3 * max(1.0, ref_lse.abs().max().item()), f"lse error {lse_err:.3e}"
    return err


def check_cache_writes(case: Case, ref_k: torch.Tensor, ref_v: torch.Tensor) -> None:
    """The kernel's caches (``case``'s, after the call) equal the reference's bit for bit, except
    that rotated k may differ from the reference's fp32 rotation by one rounding step."""
    if case.rotary:
        k_diff = (case.k_cache.float() - ref_k.float()).abs().nan_to_num(0)
        assert k_diff.max().item() <= 2e-2 * max(1.0, ref_k.float().nan_to_num(0).abs().max().item())
        ref_k = ref_k.clone()
        b = torch.arange(case.qkv.shape[0], device=case.qkv.device)
        pos = case.lengths.long()
        ref_k[b, :, :, pos, :] = case.k_cache[b, :, :, pos, :]
    assert_bits_equal(case.k_cache, ref_k, "k_cache")
    assert_bits_equal(case.v_cache, ref_v, "v_cache")


def raw_args(case, num_splits: int, /, stages: int = 2, tile_source: int = 0, **over) -> dict:
    """Every argument of the raw operator; outputs poisoned with NaN."""
    b, hq = case.qkv.shape[0], case.num_heads
    d = case.v_cache.shape[-1]
    dev = case.qkv.device
    ws = ops.Workspace.allocate(dev, b, hq, d, max(num_splits, 1))
    a = dict(
        qkv=case.qkv, k_cache=case.k_cache, v_cache=case.v_cache, lengths=case.lengths,
        qkv_bias=case.bias, out=torch.full((b, hq * d), float("nan"), dtype=case.qkv.dtype, device=dev),
        lse=torch.full((b, hq), float("nan"), device=dev), partials=ws.partials, counters=ws.counters,
        status=ws.status, num_heads=hq, num_kv_heads=case.num_kv_heads, scale=1.0 / math.sqrt(d),
        rotary_dim=case.rotary.get("dim", 0), rotary_theta=case.rotary.get("theta", 1e4),
        rotary_interleaved=case.rotary.get("interleaved", False), num_splits=num_splits,
        check_lengths=True, stages=stages, tile_source=tile_source,
    )  # fmt: skip
    a.update(over)
    return a
