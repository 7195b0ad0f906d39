"""Run a Hugging Face Llama-family causal LM's decode steps through mmha.

``HFDecoder(model, max_batch, max_seq_len)`` takes a ``transformers`` ``LlamaForCausalLM`` (or
Mistral / Qwen2: the same decoder layer, Qwen2 with a qkv bias; Gemma 2: sandwich norms, logit
soft-caps, alternating sliding-window layers; gpt-oss: attention sinks, alternating sliding
windows, a mixture-of-experts MLP) and keeps its K/V in a ``KVCache``. Prompts are prefilled by
the model's own forward (its rotated K/V are copied into the cache); each decode step then runs
the model's own norms, MLPs and projections around ``KVCache.step``, which appends the new K/V
and attends in one kernel. The model's q/k/v projection weights are concatenated once so each
layer needs one matmul for ``qkv``.

Only what mmha computes exactly is accepted: default rotary over the whole head (GPT-NeoX
halves) and head dims the kernel supports. Sliding windows, soft-caps and sinks go to each
layer's ``KVCache.step`` as score modifiers (computed on the CPU path; the CUDA kernel does not
apply them yet, so such models are refused on a GPU). Anything else is rejected with the
setting named. Nothing is downloaded: build the model from a config
(``AutoModelForCausalLM.from_config``) or load your own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..cache import KVCache
from . import speculative

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma2", "gpt_oss")


def _rope_theta(config) -> float:
    """Rotary base; rejects rotary variants the kernel does not compute."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(
            f"config.rope_parameters['rope_type'] must be 'default' (plain rotary), got {rope_type!r}"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config must give rope_theta (config.rope_parameters['rope_theta'])")
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ValueError(
            f"config partial_rotary_factor must be 1.0 (rotary over the whole head), got {factor}"
        )
    return float(theta)


def _layer_kv(past, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated keys and values ``[1, Hkv, L, D]`` of one layer from a transformers cache."""
    if hasattr(past, "layers"):  # transformers >= 4.56
        return past.layers[layer].keys, past.layers[layer].values
    return past.key_cache[layer], past.value_cache[layer]


def _layer_mods(config, i: int, layer, max_seq_len: int) -> dict:
    """Layer ``i``'s score modifiers for ``KVCache.step``: its sliding window (where it is shorter
    than the cache), Gemma 2's logit soft-cap, gpt-oss's sinks."""
    mods = {}
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        sliding = types[i] == "sliding_attention"
    else:
        sliding = getattr(config, "use_sliding_window", True)
    if sliding and window is not None and window < max_seq_len:
        mods["window"] = int(window)
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        mods["softcap"] = float(cap)
    sinks = getattr(layer.self_attn, "sinks", None)
    if sinks is not None:
        mods["sinks"] = sinks.detach().float().contiguous()
    return mods


def _full_length(t: torch.Tensor, n: int) -> torch.Tensor:
    """A layer's prompt K or V ``[1, Hkv, L, D]`` as ``n`` slots: a sliding-window layer's cache
    keeps only its last ``L < n`` tokens, which go to slots ``n - L .. n - 1`` (the slots before
    are outside every later token's window, and are zero)."""
    if t.shape[2] >= n:
        return t[:, :, :n]
    full = t.new_zeros(t.shape[0], t.shape[1], n, t.shape[3])
    full[:, :, n - t.shape[2] :] = t
    return full


class HFDecoder:
    """Greedy/step decoding of a Hugging Face Llama-family model with mmha's decode kernel."""

    def __init__(
        self, model, max_batch: int, max_seq_len: int, *, dispatch_on: str = "length",
        kv_dtype: torch.dtype | None = None, kv_scale_margin: float = 1.0, paged: bool = False,
        block_size: int = 16, num_blocks: int | None = None,
    ):  # fmt: skip
        """``kv_dtype``: the caches' dtype (default the model's); ``torch.float8_e4m3fn`` stores
        K/V in fp8 with per-layer, per-kv-head scales taken from the first prompt's absolute
        maxima times ``kv_scale_margin`` (``KVCache.prefill``), or set with
        ``self.cache.set_scales`` before the first prompt (e.g. a checkpoint's). ``paged``,
        ``block_size``, ``num_blocks``: a paged cache (``KVCache(paged=True)``; CPU only for now)."""
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model.config.model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}"
            )
        theta = _rope_theta(config)
        self.model = model
        self.body = model.model
        attn = self.body.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        param = next(model.parameters())
        self.mods = [_layer_mods(config, i, layer, max_seq_len) for i, layer in enumerate(self.body.layers)]
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        if param.device.type == "cuda" and any(self.mods):
            named = sorted({k for m in self.mods for k in m})
            raise ValueError(
                f"this {model_type} config needs score modifiers ({', '.join(named)}) that mmha's CUDA "
                "kernel does not apply yet: run it on the CPU (the reference path), or use a config "
                "without them"
            )
        self.cache = KVCache(
            config.num_hidden_layers, max_batch, max_seq_len, self.num_heads, self.num_kv_heads,
            self.head_dim, param.dtype, param.device, rotary_dim=self.head_dim, rotary_theta=theta,
            scale=float(attn.scaling), dispatch_on=dispatch_on, kv_dtype=kv_dtype, paged=paged,
            block_size=block_size, num_blocks=num_blocks,
        )  # fmt: skip
        self.kv_scale_margin = kv_scale_margin
        # One [(Hq + 2 Hkv) D, hidden] weight (and bias) per layer: q, k, v rows in that order.
        self.qkv_weight, self.qkv_bias = [], []
        with torch.no_grad():
            for layer in self.body.layers:
                a = layer.self_attn
                self.qkv_weight.append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
                biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
                if all(b is None for b in biases):
                    self.qkv_bias.append(None)
                else:
                    self.qkv_bias.append(
                        torch.cat([b if b is not None else torch.zeros_like(p.weight[:, 0])
                                   for b, p in zip(biases, (a.q_proj, a.k_proj, a.v_proj), strict=True)])
                    )  # fmt: skip

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[int] | None = None) -> torch.Tensor:
        """Run each prompt through the model's own forward and copy its K/V into cache ``rows``
        (default ``0..n-1``; they must be free, e.g. released). Returns the logits at each
        prompt's last token ``[n, vocab]``."""
        rows = list(range(len(prompts))) if rows is None else list(rows)
        if len(rows) != len(prompts):
            raise ValueError(f"rows must name {len(prompts)} rows (one per prompt), got {len(rows)}")
        dev = self.cache.device
        for r, prompt in zip(rows, prompts, strict=True):
            if len(prompt) == 0:
                raise ValueError(f"prompts must be non-empty, got an empty prompt for row {r}")
            if len(prompt) >= self.cache.max_seq_len:
                raise ValueError(
                    f"prompt for row {r} has {len(prompt)} tokens; the cache holds max_seq_len "
                    f"{self.cache.max_seq_len} including the tokens still to generate"
                )
        self.cache.admit(rows)
        logits = []
        for r, prompt in zip(rows, prompts, strict=True):
            ids = torch.tensor([list(prompt)], device=dev)
            res = self.model(input_ids=ids, use_cache=True)
            n = ids.shape[1]
            for i in range(len(self.body.layers)):
                k, v = _layer_kv(res.past_key_values, i)
                k, v = _full_length(k, n), _full_length(v, n)
                self.cache.prefill(i, k.transpose(1, 2), v.transpose(1, 2), [n], [r],
                                   scale_margin=self.kv_scale_margin)  # fmt: skip
            logits.append(res.logits[0, -1].float())
        return torch.stack(logits)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row ``tokens [B]`` through every layer; lengths advance. Returns fp32
        logits ``[B, vocab]``."""
        x = self.body.embed_tokens(tokens)
        for i, layer in enumerate(self.body.layers):
            qkv = F.linear(layer.input_layernorm(x), self.qkv_weight[i])
            out = self.cache.step(i, qkv, qkv_bias=self.qkv_bias[i], **self.mods[i])
            a = layer.self_attn.o_proj(out)
            if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2: norms around both blocks
                x = x + layer.post_attention_layernorm(a)
                x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            else:
                x = x + a
                # [B, 1, hidden] as in a forward; gpt-oss's MoE also returns its router scores
                m = layer.mlp(layer.post_attention_layernorm(x)[:, None])
                x = x + (m[0] if isinstance(m, tuple) else m)[:, 0]
        self.cache.advance()
        logits = self.model.lm_head(self.body.norm(x)).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.no_grad()
    def step_tree(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """A tree of tokens per row through every layer (``KVCache.step_tree``): ``tokens [B, T]``
        as the nodes of ``parents [B, T]``. Returns fp32 logits ``[B, T, vocab]`` (node t's
        prediction of the token after it); lengths do not move (``self.cache.accept``)."""
        if any(self.mods):
            raise ValueError("tree steps do not take score modifiers yet (sliding windows, soft-caps, sinks)")
        x = self.body.embed_tokens(tokens)  # [B, T, hidden]
        for i, layer in enumerate(self.body.layers):
            qkv = F.linear(layer.input_layernorm(x), self.qkv_weight[i])
            out = self.cache.step_tree(i, qkv, parents, qkv_bias=self.qkv_bias[i])
            x = x + layer.self_attn.o_proj(out)
            m = layer.mlp(layer.post_attention_layernorm(x))
            x = x + (m[0] if isinstance(m, tuple) else m)
        return self.model.lm_head(self.body.norm(x)).float()

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        draft: HFDecoder | None = None,
        tree_shape: Sequence[int] = (2, 2, 1),
    ) -> list[list[int]]:
        """Greedy decoding of a ragged batch (``len(prompts) <= max_batch``): ``max_new_tokens``
        new tokens per prompt (the first from the prefill logits, the rest from mmha steps).

        With ``draft`` (an ``HFDecoder`` of a model with the same tokenizer): speculative decoding.
        Each round the draft grows a tree under the last token, ``tree_shape[d]`` children per
        node at depth ``d`` (its top tokens), and the target verifies the whole tree in one
        ``step_tree``: the longest root path whose tokens are the target's own greedy picks is
        accepted in both caches (``KVCache.accept``), plus the target's next pick. The tokens are
        exactly those of plain greedy decoding with the target."""
        if not 1 <= len(prompts) <= self.cache.max_batch:
            raise ValueError(
                f"prompts must hold 1..{self.cache.max_batch} prompts (max_batch), got {len(prompts)}"
            )
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.cache.max_seq_len:
            raise ValueError(
                f"max_new_tokens ({max_new_tokens}) plus the longest prompt ({longest}) must fit in "
                f"max_seq_len ({self.cache.max_seq_len})"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if draft is not None:
            return self._speculate(prompts, max_new_tokens, draft, list(tree_shape))
        self.cache.release(range(self.cache.max_batch))
        tok = self.prefill(prompts).argmax(-1)
        out = [[int(t)] for t in tok.tolist()]
        for _ in range(max_new_tokens - 1):
            tok = self.step(tok).argmax(-1)
            for r, t in enumerate(tok.tolist()):
                out[r].append(t)
        return out

    def _speculate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft: HFDecoder, shape: list[int]
    ) -> list[list[int]]:
        nodes = speculative.tree_nodes(shape)
        longest = max(len(p) for p in prompts)
        for name, dec in (("the target", self), ("the draft", draft)):
            if longest + max_new_tokens + len(shape) + nodes > dec.cache.max_seq_len:
                raise ValueError(
                    f"max_seq_len of {name} ({dec.cache.max_seq_len}) must hold the longest prompt "
                    f"({longest}), max_new_tokens ({max_new_tokens}) and a tree of {nodes} nodes past "
                    f"up to {len(shape)} extra accepted tokens"
                )
        for dec in (self, draft):
            dec.cache.release(range(dec.cache.max_batch))
        cur = self.prefill(prompts).argmax(-1)  # emitted, not yet cached
        draft.prefill(prompts)
        out, _ = speculative.speculate(
            self, draft, cur, [[int(t)] for t in cur.tolist()], max_new_tokens, shape
        )
        return out


@torch.no_grad()
def compare_kv_dtypes(
    model,
    prompts: Sequence[Sequence[int]],
    steps: int,
    kv_dtype: torch.dtype,
    *,
    kv_scale_margin: float = 1.0,
) -> dict:
    """Teacher-forced decoding of ``prompts`` with caches of the model's dtype (A) and of
    ``kv_dtype`` (B): both are fed A's greedy tokens for ``steps`` steps, and each step's logits
    are compared. A step of a row is a top-1 flip when B's pick differs from A's, and a decisive
    mismatch when A's pick beats B's under A's logits by more than twice that row's largest logit
    difference. Returns per-step max |logit difference| and the counts."""
    longest = max(len(p) for p in prompts)
    a = HFDecoder(model, len(prompts), longest + steps + 1)
    b = HFDecoder(
        model, len(prompts), longest + steps + 1, kv_dtype=kv_dtype, kv_scale_margin=kv_scale_margin
    )
    for dec in (a, b):
        dec.cache.release(range(dec.cache.max_batch))
    tok = a.prefill(prompts).argmax(-1)
    b.prefill(prompts)
    diffs, flips, decisive = [], 0, 0
    for _ in range(steps):
        la, lb = a.step(tok), b.step(tok)
        d = (la - lb).abs().amax(-1)
        pa, pb = la.argmax(-1), lb.argmax(-1)
        rows = (pa != pb).nonzero().flatten()
        flips += len(rows)
        if len(rows):
            margin = la[rows, pa[rows]] - la[rows, pb[rows]]
            decisive += int((margin > 2 * d[rows]).sum())
        diffs.append(d.max().item())
        tok = pa
    return {
        "steps": steps,
        "rows": len(prompts),
        "max_logit_diff": max(diffs),
        "mean_step_max_logit_diff": sum(diffs) / len(diffs),
        "logit_diff_per_step": diffs,
        "top1_flips": flips,
        "decisive_mismatches": decisive,
        "logit_scale": float(la.abs().max()),
    }
