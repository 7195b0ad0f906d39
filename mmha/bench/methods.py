"""The methods the benchmark times: mmha's operator and the peers users would otherwise run.

Each builder takes one ``Problem`` and returns a zero-argument function that makes one call and
returns its output ``[B, Hq * D]``; the SDPA backend of a peer is chosen by ``method_context``
around its calls (the backend is picked when a call is made, so around the graph's capture).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from .. import dispatch, ops
from .problems import FP8_BENCH_SCALE, Config, Problem

MMHA = "mmha"
SDPA = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_default")
PEERS = (*SDPA, "flashinfer", "eager")


def kind(method: str) -> str:
    """Which tensors a method needs (``Problem`` kind)."""
    return "mmha" if method == MMHA else "sdpa"


def plan_str(plan: dispatch.Plan) -> str:
    """``splits x stages``, e.g. ``8x3``: the split count and the tile loop's stages."""
    return f"{plan.num_splits}x{plan.stages}"


def row_of_spec(
    spec: str, dtype: str = "fp16", group: str = "row", kv: str = ""
) -> tuple[Config, dispatch.Plan, bool]:
    """A row named ``B,Hq,Hkv,D,S[@SPLITSxSTAGES]`` (the diagnostic tools' rows; ``kv``: "" for
    caches of ``dtype``, "fp8", "int8" or "int4"): its config, the dispatcher's plan or the one forced
    after ``@``, and whether one was forced."""
    shape, _, forced = spec.partition("@")
    b, hq, hkv, d, s = (int(x) for x in shape.split(","))
    cfg = Config(group, b, hq, hkv, d, s, dtype, kv)
    plan = ops.plan_for("cuda", b, hq, hkv, d, s, cfg.torch_dtype, kv_dtype=cfg.kv_torch_dtype)
    if forced:
        splits, stages = (int(x) for x in forced.split("x"))
        plan = dispatch.Plan("single_pass" if splits == 1 else "split", splits, stages, plan.blocks_per_sm)
    return cfg, plan, bool(forced)


def mmha_fn(prob: Problem, plan: dispatch.Plan, tile_source: str = "auto", pages=None, epilogue=None):
    """The operator on preallocated outputs and workspace, as ``KVCache.step`` calls it; ``pages``:
    ``(k_pages, v_pages, block_tables)`` in place of the problem's contiguous caches; ``epilogue``:
    a ``mmha.epilogue.OutEpilogue`` fused into the call."""
    cfg = prob.cfg
    ws = ops.Workspace.allocate("cuda", cfg.batch, cfg.num_heads, cfg.head_dim, plan.num_splits)
    out_dtype = cfg.torch_dtype if epilogue is None else epilogue.out_dtype(cfg.torch_dtype)
    out = torch.empty(cfg.batch, cfg.num_heads * cfg.head_dim, dtype=out_dtype, device="cuda")
    lse = torch.empty(cfg.batch, cfg.num_heads, dtype=torch.float32, device="cuda")
    op = torch.ops.mmha.decode_attention.default
    k_cache, v_cache, tables = pages if pages is not None else (prob.k_cache, prob.v_cache, None)
    k_scale, v_scale, kw = prob.k_scale, prob.v_scale, {}
    if cfg.kv == "int4":  # the format's planes; its bulk tensor copies are "auto" ("tma" is the 16-bit source)
        c = prob.int4
        k_scale, v_scale = c.k_scale, c.v_scale
        tile_source = "auto" if tile_source == "tma" else tile_source
        kw = dict(k_zero=c.k_zero, v_zero=c.v_zero, k_residual=c.k_residual)
    args = (
        prob.qkv, k_cache, v_cache, prob.lengths, None, out, lse, ws.partials, ws.counters,
        ws.status, cfg.num_heads, cfg.num_kv_heads, prob.scale, 0, 10000.0, False, plan.num_splits, False,
        plan.stages, ops.TILE_SOURCES[tile_source], k_scale, v_scale,
    )  # fmt: skip
    if tables is not None:
        kw["block_tables"] = tables
    if epilogue is not None:
        kw.update(epilogue.kernel_args())

    def fn():
        op(*args, **kw)
        return out

    return fn


def sdpa_fn(prob: Problem):
    """SDPA with q of length 1 (the backend is chosen around the call)."""
    gqa = prob.cfg.num_heads != prob.cfg.num_kv_heads
    b = prob.cfg.batch
    kw = {"enable_gqa": True} if gqa else {}

    def fn():
        return F.scaled_dot_product_attention(prob.q, prob.k, prob.v, **kw).reshape(b, -1)

    return fn


def eager_fn(prob: Problem):
    """matmul, softmax, matmul: what many model codes do."""
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
    """FlashInfer's single-request decode (raises ImportError where FlashInfer is not installed).
    fp8 rows: its decode over e4m3 K/V (one scale for the tensor: the softmax scale takes K's,
    the output V's)."""
    import flashinfer

    cfg = prob.cfg
    if cfg.batch != 1:
        raise RuntimeError("only FlashInfer's single-request decode is wired up (batch 1)")
    fp8 = prob.k8 is not None
    k = (prob.k8 if fp8 else prob.k)[0].transpose(0, 1).contiguous()  # [S, Hkv, D] (NHD)
    v = (prob.v8 if fp8 else prob.v)[0].transpose(0, 1).contiguous()
    q = prob.q[0, :, 0]
    sc = FP8_BENCH_SCALE if fp8 else 1.0

    def fn():
        out = flashinfer.single_decode_with_kv_cache(q, k, v, sm_scale=prob.scale * sc)
        return (out * sc if fp8 else out).reshape(1, -1)

    return fn


def make_fn(method: str, prob: Problem, plan: dispatch.Plan | None = None):
    if method == MMHA:
        return mmha_fn(prob, plan)
    if method in SDPA:
        return sdpa_fn(prob)
    if method == "eager":
        return eager_fn(prob)
    if method == "flashinfer":
        return flashinfer_fn(prob)
    raise ValueError(f"unknown method {method!r}")


def unavailable(method: str) -> str | None:
    """Why a method cannot run on this machine at all (None if it can)."""
    if method == "flashinfer":
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return "not installed"
    return None


@contextlib.contextmanager
def method_context(method: str):
    """Selects the SDPA backend of a peer, and silences the warnings torch raises while the
    benchmark probes backends that cannot run a shape ("Flash attention kernel not used because
    ..."): they are the benchmark's doing, not the user's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*kernel not used because.*")
        warnings.filterwarnings("ignore", message=".*[Mm]emory [Ee]fficient attention.*")
        warnings.filterwarnings("ignore", message=".*[Ff]lash attention.*")
        warnings.filterwarnings("ignore", message=".*cuDNN attention.*")
        warnings.filterwarnings("ignore", message=".*[Tt]orch was not compiled with.*")
        # SDPA's default choice on GQA rows (enable_gqa): its fused kernels need equal head counts.
        warnings.filterwarnings("ignore", message=".*both fused kernels require query, key and value.*")
        if method in backends:
            with sdpa_kernel([backends[method]]):
                yield
        else:
            yield
