"""A small Llama-style decoder (RMSNorm, rotary, GQA, SwiGLU; optional qkv bias) with seeded random
weights, and two ways to decode with it: through ``KVCache`` (mmha) and through a plain reference
(concatenated K/V tensors, torch SDPA in fp32)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..reference import apply_rotary
from ..spec import Rotary


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 1024
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 1024
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    norm_eps: float = 1e-5

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim


PRESETS = {
    "tiny": ModelConfig(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=256),
    "small": ModelConfig(),
    "medium": ModelConfig(
        vocab_size=4096, num_layers=8, num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=4096
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wqkv = nn.Linear(cfg.dim, width, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp_norm(x)
        return self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class TinyLlama(nn.Module):
    """Decoder-only transformer; ``seed`` fixes the random weights (nothing is downloaded)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # fp32 rotary frequencies per device
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    continue
                fan_in = p.shape[-1] if p.dim() > 1 else cfg.dim
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            self.lm_head.weight.mul_(4.0)  # sharper logits: fewer near-ties in greedy decoding

    # ------------------------------------------------------------------ shared pieces
    def _split(self, qkv: torch.Tensor):
        c = self.cfg
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                             c.num_kv_heads * c.head_dim], dim=-1)  # fmt: skip
        shape = qkv.shape[:-1]
        return (
            q.reshape(*shape, c.num_heads, c.head_dim),
            k.reshape(*shape, c.num_kv_heads, c.head_dim),
            v.reshape(*shape, c.num_kv_heads, c.head_dim),
        )

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [N, H, D]`` at ``positions [N]``: GPT-NeoX style over the whole head."""
        c = self.cfg
        rotary = Rotary(c.head_dim, c.rope_theta)
        inv_freq = self._inv_freq.get(x.device)
        if inv_freq is None:  # once per device, so a captured step creates no host tensor
            inv_freq = self._inv_freq[x.device] = rotary.frequencies(torch.float32, x.device)
        return apply_rotary(x.float(), positions, rotary, inv_freq).to(x.dtype)

    def new_cache(self, max_batch: int, max_seq_len: int, device, dtype, **kw) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, max_batch, max_seq_len, c.num_heads, c.num_kv_heads, c.head_dim,
                       dtype, device, rotary_dim=c.head_dim, rotary_theta=c.rope_theta, **kw)  # fmt: skip

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: list[int], cache: KVCache | None = None,
                rows: list[int] | None = None):  # fmt: skip
        """Run right-padded prompts ``tokens [n, S]`` through SDPA (causal); write K/V into
        ``cache`` rows. Returns logits at each prompt's last token ``[n, V]`` and the per-layer
        rotated K/V ``[n, S, Hkv, D]`` (for the reference decoder)."""
        n, s = tokens.shape
        x = self.embed(tokens)
        pos = torch.arange(s, device=tokens.device).repeat(n)
        kvs = []
        for i, blk in enumerate(self.layers):
            q, k, v = self._split(blk.wqkv(blk.attn_norm(x)))
            q = self._rope(q.reshape(n * s, *q.shape[2:]), pos).view(q.shape)
            k = self._rope(k.reshape(n * s, *k.shape[2:]), pos).view(k.shape)
            if cache is not None:
                cache.prefill(i, k, v, lengths, rows)
            kvs.append((k, v))
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True,
            )  # fmt: skip
            x = x + blk.wo(att.transpose(1, 2).reshape(n, s, -1))
            x = x + blk.mlp(x)
        last = torch.tensor(lengths, device=tokens.device) - 1
        h = self.norm(x[torch.arange(n, device=tokens.device), last])
        return self.lm_head(h).float(), kvs

    # ------------------------------------------------------------------ decode (mmha)
    @torch.no_grad()
    def warm_up(self, tokens: torch.Tensor, cache: KVCache) -> None:
        """Every layer's step without ``advance`` (before CUDA-graph capture: allocates the split
        workspace; it only writes the slots that the next real step writes again)."""
        x = self.embed(tokens)
        for i, blk in enumerate(self.layers):
            bias = blk.wqkv.bias.detach() if blk.wqkv.bias is not None else None
            cache.step(i, F.linear(blk.attn_norm(x), blk.wqkv.weight), qkv_bias=bias)

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row ``tokens [B]`` through every layer via ``cache.step``; then advance."""
        x = self.embed(tokens)
        for i, blk in enumerate(self.layers):
            # The kernel adds the qkv bias itself (in fp32), fused with rotary and the append.
            qkv = F.linear(blk.attn_norm(x), blk.wqkv.weight)
            bias = blk.wqkv.bias.detach() if blk.wqkv.bias is not None else None
            out = cache.step(i, qkv, qkv_bias=bias)
            x = x + blk.wo(out)
            x = x + blk.mlp(x)
        cache.advance()
        return self.lm_head(self.norm(x)).float()


class TreeDecoder:
    """``model``'s (or its first ``layers`` layers') tree steps on ``cache``: the decoder that
    ``mmha.models.speculative`` drives. A model truncated to its first layers, sharing its
    embeddings and head, is a self-speculative draft (layer skipping)."""

    def __init__(self, model: TinyLlama, cache: KVCache, layers: int | None = None):
        self.model, self.cache = model, cache
        self.layers = model.layers[: layers or len(model.layers)]
        if cache.num_layers != len(self.layers):
            raise ValueError(f"cache must have {len(self.layers)} layers, got {cache.num_layers}")

    @torch.no_grad()
    def step_tree(self, tokens: torch.Tensor, parents: torch.Tensor, node_counts=None) -> torch.Tensor:
        m = self.model
        x = m.embed(tokens)
        for i, blk in enumerate(self.layers):
            bias = blk.wqkv.bias.detach() if blk.wqkv.bias is not None else None
            qkv = F.linear(blk.attn_norm(x), blk.wqkv.weight)
            out = self.cache.step_tree(i, qkv, parents, node_counts=node_counts, qkv_bias=bias)
            x = x + blk.wo(out)
            x = x + blk.mlp(x)
        return m.lm_head(m.norm(x)).float()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Prompts through the model's own prefill, K/V of this decoder's layers into its cache;
        logits of the whole model at each prompt's last token."""
        n = tokens.shape[0]
        logits, kvs = self.model.prefill(tokens, lengths)
        self.cache.release(range(self.cache.max_batch))
        self.cache.admit(list(range(n)))
        for i in range(len(self.layers)):
            k, v = kvs[i]
            self.cache.prefill(i, k, v, lengths, list(range(n)))
        return logits


class ReferenceDecoder:
    """Plain decoding: per-row K/V kept as concatenated tensors, attention by SDPA in fp32."""

    def __init__(self, model: TinyLlama, prefill_kvs, lengths: list[int]):
        self.model = model
        # layer -> row -> (k [Hkv, L, D], v [Hkv, L, D]) in the model dtype, as a cache holds them
        self.kv = [
            [(k[r, :n].transpose(0, 1).contiguous(), v[r, :n].transpose(0, 1).contiguous())
             for r, n in enumerate(lengths)]
            for k, v in prefill_kvs
        ]  # fmt: skip
        self.lengths = list(lengths)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.embed(tokens)
        pos = torch.tensor(self.lengths, device=tokens.device)
        for i, blk in enumerate(m.layers):
            # As one decode step is defined (mmha.reference): the bias is added in fp32, q stays
            # in fp32 after rotary, k and v are rounded to the cache dtype.
            qkv = F.linear(blk.attn_norm(x), blk.wqkv.weight).float()
            if blk.wqkv.bias is not None:
                qkv = qkv + blk.wqkv.bias.float()
            q, k, v = m._split(qkv)
            q = m._rope(q, pos)  # q is fp32 here, and stays so
            k = m._rope(k, pos).to(x.dtype)
            v = v.to(x.dtype)
            outs = []
            for r in range(x.shape[0]):
                kr = torch.cat([self.kv[i][r][0], k[r][:, None]], dim=1)
                vr = torch.cat([self.kv[i][r][1], v[r][:, None]], dim=1)
                self.kv[i][r] = (kr, vr)
                o = F.scaled_dot_product_attention(
                    q[r][None, :, None], kr[None].float(), vr[None].float(), enable_gqa=True
                )
                outs.append(o.reshape(-1).to(x.dtype))
            x = x + blk.wo(torch.stack(outs))
            x = x + blk.mlp(x)
        self.lengths = [n + 1 for n in self.lengths]
        return m.lm_head(m.norm(x)).float()
