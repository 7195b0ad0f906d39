"""``python -m mmha.bench --mods``: decode attention with score modifiers, mmha against its own
plain step and against the peers that can express each modifier, under the decode timing.

Rows (fp16, Hq 32, D 128; every row's length is its context, the new token the last key):
- ``window`` 4096 at contexts 32K and 128K, batch 1 and 16, Hkv 8: ``plain_decode_us`` is mmha's
  plain row of context 4096 (a window should cost what its keys cost);
- ``softcap`` 50, ``alibi`` (the standard slopes) and ``sinks`` on the canonical batch-16 rows
  (Hkv 32: S 512 ... 32768; Hkv 8: S 2048, 32768): ``plain_decode_us`` is the same row without.
Peers (each checked against ``mmha.reference.attend`` in fp32 before it is timed):
``sdpa_mask`` (``scaled_dot_product_attention`` with an explicit mask: boolean for a window, an
additive bias for ALiBi), ``sdpa_window_slice`` (SDPA over the window's keys alone: every row has
the same length here), ``flex`` (``flex_attention`` compiled: a block mask for a window, a
``score_mod`` for the soft-cap and ALiBi, sinks folded in from its log-sum-exp) and ``eager``
(matmul, the modifier, softmax, matmul). Each row's graph holds as many layers as the bytes a call
reads ask for (``Row.layers``: a window's keys, not the cache it holds), as many as fit in memory;
the plain row is timed as its own shape. Writes bench_mods.json and bench_mods.md to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import dispatch, layout, ops, reference
from ..spec import AttentionSpec, alibi_slopes
from .args import parse_args
from .problems import LAYER_BYTES, MAX_LAYERS, MIN_LAYERS, TOLERANCE
from .runner import print_report
from .timing import decode_us

HQ, D = 32, 128
WINDOW, SOFTCAP = 4096, 50.0
PEERS = ("sdpa_mask", "sdpa_window_slice", "flex", "eager")
# Which peers can express which modifier.
CAN = {
    "window": ("sdpa_mask", "sdpa_window_slice", "flex", "eager"),
    "softcap": ("flex", "eager"),
    "alibi": ("sdpa_mask", "flex", "eager"),
    "sinks": ("flex", "eager"),
}
TARGET = {"window": 1.05, "softcap": 1.03, "alibi": 1.03, "sinks": 1.03}


@dataclass(frozen=True)
class Row:
    modifier: str
    batch: int
    num_kv_heads: int
    seq_len: int
    plain_seq_len: int  # the plain row it is held against

    @property
    def kv_bytes(self) -> int:
        """The cache a layer holds (K and V, fp16)."""
        return 2 * self.batch * self.num_kv_heads * self.seq_len * D * 2

    @property
    def read_bytes(self) -> int:
        """The cache bytes one call reads: a window's keys only (and the rest of its first tile)."""
        keys = dispatch.keys_read(self.seq_len, WINDOW if self.modifier == "window" else None)
        return 2 * self.batch * self.num_kv_heads * keys * D * 2

    def layers(self, free_bytes: int | None = None) -> int:
        """The decode timing's calls per graph: from the bytes a call reads, as for any row (a
        window row of 128K holds 537 MB a layer but reads 17 MB: timed over the two layers its
        cache allowed, it ran 1.11-1.13x its plain row timed over eight on the H200, 1.01x over
        32); at most as many layers (each in mmha's and SDPA's layouts) as fit in half of
        ``free_bytes``."""
        n = min(MAX_LAYERS, math.ceil(LAYER_BYTES / self.read_bytes))
        if free_bytes is not None:
            n = min(n, free_bytes // 2 // (2 * self.kv_bytes))
        return max(MIN_LAYERS, n)


def rows(quick: bool = False) -> list[Row]:
    out = [Row("window", b, 8, s, WINDOW) for b in (1, 16) for s in (32768, 131072)]
    shapes = [(32, s) for s in (512, 2048, 8192, 32768)] + [(8, 2048), (8, 32768)]
    if quick:
        shapes = [(32, 2048), (8, 32768)]
    out += [Row(m, 16, h, s, s) for m in ("softcap", "alibi", "sinks") for h, s in shapes]
    return out[:2] + out[4::3] if quick else out


def mods_of(modifier: str | None) -> dict:
    if modifier is None:
        return {}
    return {
        "window": dict(window=WINDOW),
        "softcap": dict(softcap=SOFTCAP),
        "alibi": dict(alibi_slopes=alibi_slopes(HQ).cuda()),
        "sinks": dict(sinks=torch.linspace(-1.0, 3.0, HQ, device="cuda")),
    }[modifier]


class Layer:
    """One layer's data: K/V ``[B, S, Hkv, D]`` (the new token's at slot S - 1) in mmha's
    layouts and in SDPA's ``[B, Hkv, S, D]``; qkv of the new token."""

    def __init__(self, batch: int, num_kv_heads: int, seq_len: int, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        k = torch.randn(batch, seq_len, num_kv_heads, D, generator=g, device="cuda", dtype=torch.float16)
        v = torch.randn(batch, seq_len, num_kv_heads, D, generator=g, device="cuda", dtype=torch.float16)
        q = torch.randn(batch, HQ * D, generator=g, device="cuda", dtype=torch.float16)
        self.qkv = torch.cat([q, k[:, -1].reshape(batch, -1), v[:, -1].reshape(batch, -1)], dim=1)
        self.q = q.view(batch, HQ, 1, D)
        self.kt, self.vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        self.kc, self.vc = layout.pack_k(k), layout.pack_v(v)
        self.lengths = torch.full((batch,), seq_len - 1, dtype=torch.int32, device="cuda")
        self.pos = seq_len - 1


def mmha_fn(layer: Layer, mods: dict):
    b, hkv = layer.q.shape[0], layer.kt.shape[1]
    ws = ops.Workspace.allocate("cuda", b, HQ, D, dispatch.MAX_SPLITS)
    return lambda: ops.decode_attention(
        layer.qkv, layer.kc, layer.vc, layer.lengths, num_heads=HQ, num_kv_heads=hkv, workspace=ws,
        validate_lengths=False, attention=AttentionSpec(**mods),
    )  # fmt: skip


def sink_fold(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink from attention without one: out * e^lse / (e^lse + e^sink)."""
    return out * torch.sigmoid(lse - sinks.view(1, -1, 1))[..., None].to(out.dtype)


def peer_fn(peer: str, layer: Layer, modifier: str, mods: dict):
    q, k, v, pos = layer.q, layer.kt, layer.vt, layer.pos
    s = k.shape[2]
    if peer == "sdpa_window_slice":
        ks, vs = k[:, :, s - WINDOW :], v[:, :, s - WINDOW :]
        return lambda: F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True)
    if peer == "sdpa_mask":
        slots = torch.arange(s, device="cuda")
        if modifier == "window":
            mask = (slots > pos - WINDOW)[None, None, None, :]
        else:  # ALiBi as an additive bias
            bias = mods["alibi_slopes"][:, None] * (slots - pos)[None, :].float()
            mask = bias.to(q.dtype)[None, :, None, :]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if peer == "eager":
        hkv = k.shape[1]

        def eager():
            qg = q.view(q.shape[0], hkv, HQ // hkv, D)
            sc = torch.matmul(qg, k.transpose(-1, -2)).float() / math.sqrt(D)  # [B, Hkv, G, S]
            sc = sc.view(q.shape[0], HQ, s)
            slots = torch.arange(s, device="cuda")
            if modifier == "softcap":
                sc = SOFTCAP * torch.tanh(sc / SOFTCAP)
            elif modifier == "alibi":
                sc = sc + mods["alibi_slopes"][:, None] * (slots - pos)
            elif modifier == "window":
                sc = sc.masked_fill(slots <= pos - WINDOW, float("-inf"))
            if modifier == "sinks":
                sink = mods["sinks"].expand(q.shape[0], -1)[..., None]
                lse = torch.logsumexp(torch.cat([sc, sink], -1), -1)
            else:
                lse = torch.logsumexp(sc, -1)
            p = torch.exp(sc - lse[..., None]).to(v.dtype).view(q.shape[0], hkv, HQ // hkv, s)
            return torch.matmul(p, v).view(q.shape[0], HQ, 1, D)

        return eager
    # flex_attention, compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    block_mask, score_mod = None, None
    if modifier == "window":
        first = pos - WINDOW + 1
        block_mask = create_block_mask(lambda b, h, qi, kv: kv >= first, None, None, 1, s, device="cuda")
    elif modifier == "softcap":

        def score_mod(score, b, h, qi, kv):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
    elif modifier == "alibi":
        slopes = mods["alibi_slopes"]

        def score_mod(score, b, h, qi, kv):
            return score + slopes[h] * (kv - pos)

    if modifier == "sinks":
        sinks = mods["sinks"]

        def with_sinks():
            out, lse = flex(q, k, v, enable_gqa=True, return_lse=True)
            return sink_fold(out, lse, sinks)

        return with_sinks
    return lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)


def error(out: torch.Tensor, layer: Layer, mods: dict) -> float:
    """Max |out - reference| (``mmha.reference.attend`` in fp32, row by row)."""
    out = out.reshape(layer.q.shape[0], HQ, D).float()
    sm = AttentionSpec(**mods)
    err = 0.0
    for r in range(layer.q.shape[0]):
        ref, _ = reference.attend(layer.q[r, :, 0].float(), layer.kt[r].float(), layer.vt[r].float(),
                                  1.0 / math.sqrt(D), sm, layer.pos)  # fmt: skip
        err = max(err, (out[r] - ref).abs().max().item())
    return err


def run_row(row: Row, peers: tuple[str, ...], plain_cache: dict) -> dict:
    mods = mods_of(row.modifier)
    n_layers = row.layers(torch.cuda.mem_get_info()[0])
    layers = [Layer(row.batch, row.num_kv_heads, row.seq_len, seed=i) for i in range(n_layers)]
    res: dict = {**asdict(row), "layers": n_layers, "errors": {}, "skipped": {}}
    methods = {"mmha": lambda layer: mmha_fn(layer, mods)}
    fns: list = []
    for peer in peers:
        if peer in CAN[row.modifier]:
            methods[peer] = lambda layer, peer=peer: peer_fn(peer, layer, row.modifier, mods)
    for name, make in methods.items():
        try:
            fns = [make(layer) for layer in layers]
            err = error(fns[0](), layers[0], mods)
            res["errors"][name] = err
            if not err <= TOLERANCE["fp16"]:
                res["skipped"][name] = f"wrong result: max error {err:.3g}"
                continue
            res[f"{name}_decode_us"] = decode_us(fns)["us"]
        except Exception as exc:  # a peer that cannot run this shape
            res["skipped"][name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
        torch.cuda.empty_cache()
    del layers, fns
    torch.cuda.empty_cache()
    key = (row.batch, row.num_kv_heads, row.plain_seq_len)
    if key not in plain_cache:  # the plain row timed as its own shape is (its layers from its bytes)
        plain_row = Row("plain", row.batch, row.num_kv_heads, row.plain_seq_len, row.plain_seq_len)
        n_plain = plain_row.layers(torch.cuda.mem_get_info()[0])
        plain = [Layer(row.batch, row.num_kv_heads, row.plain_seq_len, seed=i) for i in range(n_plain)]
        plain_cache[key] = decode_us([mmha_fn(layer, {}) for layer in plain])["us"]
        del plain
    res["plain_decode_us"] = plain_cache[key]
    timed = {m: res[f"{m}_decode_us"] for m in methods if m != "mmha" and f"{m}_decode_us" in res}
    if timed:
        best = min(timed, key=timed.get)
        res["best_peer_decode"], res["best_peer_decode_us"] = best, timed[best]
    if "mmha_decode_us" in res:
        res["vs_plain"] = res["mmha_decode_us"] / res["plain_decode_us"]
        if timed:
            res["ratio"] = res["mmha_decode_us"] / res["best_peer_decode_us"]
    return res


def misses(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        label = f"{r['modifier']} B={r['batch']} Hkv={r['num_kv_heads']} S={r['seq_len']}"
        if "vs_plain" not in r:
            out.append(f"{label}: mmha not timed ({r['skipped'].get('mmha', '')})")
            continue
        if r["vs_plain"] > TARGET[r["modifier"]]:
            out.append(f"{label}: {r['vs_plain']:.3f}x the plain row > {TARGET[r['modifier']]}")
        if r.get("ratio", 0) > 1:
            out.append(f"{label}: {r['ratio']:.3f}x {r['best_peer_decode']}")
    return out


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    def us(r, k):
        return f"{r[k]:.1f}" if k in r else "-"

    body = [[r["modifier"], r["batch"], r["num_kv_heads"], r["seq_len"], us(r, "mmha_decode_us"),
             us(r, "plain_decode_us"), f"{r['vs_plain']:.3f}" if "vs_plain" in r else "-",
             *[us(r, f"{p}_decode_us") for p in PEERS],
             f"{r['ratio']:.3f}" if "ratio" in r else "-"] for r in results]  # fmt: skip
    cols = ["modifier", "B", "Hkv", "S", "mmha us", "plain us", "mmha/plain", *[f"{p} us" for p in PEERS],
            "mmha/best peer"]  # fmt: skip
    return tabulate(body, headers=cols, tablefmt="github", disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmha.bench --mods", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rows")
    ap.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS))
    ap.add_argument("--out", type=Path, default=Path("bench_mods"))
    args = parse_args(ap, argv)
    if not torch.cuda.is_available():
        print("python -m mmha.bench --mods needs a CUDA GPU")
        return 1
    torch._dynamo.config.cache_size_limit = 64  # flex compiles once per shape and modifier
    header = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "window": WINDOW, "softcap": SOFTCAP,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    results, plain = [], {}
    for row in rows(args.quick):
        results.append(run_row(row, tuple(args.peers), plain))
        torch._dynamo.reset()  # compiled peers hold their rows' tensors: free them before the next row
        gc.collect()
        torch.cuda.empty_cache()
        brief = {k: v for k, v in results[-1].items() if k.endswith("_us") or k in ("modifier", "seq_len")}
        print(json.dumps(brief), flush=True)
        (args.out / "bench_mods.json").write_text(json.dumps({"header": header, "rows": results}, indent=1))
    print_report(args.out / "bench_mods.md", header, table(results), misses(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
