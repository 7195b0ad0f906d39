"""mmha inside Hugging Face's own generation loop: ``attn_implementation="mmha"`` and ``MmhaCache``.

transformers runs a layer's projections and rotary itself, then calls the cache's ``update`` and
the attention function registered under the config's ``_attn_implementation``. This module plugs
into those two extension points (``transformers.AttentionInterface`` and ``transformers.Cache``):

- ``MmhaCache`` keeps K/V in mmha's layouts (a ``KVCache`` with rotary off: the keys arrive
  rotated). Its layers' ``update`` passes the new K/V through and arms the layer, so the attention
  function knows that this forward carries the cache.
- ``mmha_attention`` then runs, for a one-token step, mmha's fused append + attention on the
  cache (the CUDA kernel; ``mmha.reference`` on the CPU) with the layer's ``AttentionSpec``
  (scale, sliding window, logit soft-cap, sinks, from the model's config and modules) and advances
  the lengths after the last layer; for a prompt, transformers' own attention (SDPA, or the
  model's own eager attention where the layer has score modifiers, which applies its soft-cap and
  sinks, with a mask that holds the padding, causality and the window), with the prompt's K/V
  written to the cache. A forward without an armed ``MmhaCache`` is plain SDPA (no mask is built
  for it, so a padded prompt there is refused).

Prompts are compacted: a left-padded prompt of ``n`` tokens (what ``generate`` feeds a ragged
batch) lands in slots ``0 .. n - 1`` of its row, which are its tokens' positions, so decode steps
need no mask. The padding is read from ``position_ids`` (``generate`` derives them from the
attention mask), so no mask function is registered and transformers builds no mask at all.

A one-token step has no host synchronisation and no Python state that changes from step to step,
so ``generate`` compiles it (``torch.compile`` with CUDA graphs: transformers does this by itself
for caches that say ``is_compileable``) once per batch size.
"""

from __future__ import annotations

import sys
import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.generation import GenerationMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .. import int4, ops, reference
from ..cache import KVCache
from ..spec import AttentionSpec
from .hf_layers import attention_modules, check_attention_kinds, layer_mods

ATTN_IMPLEMENTATION = "mmha"


def mmha_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``attn_implementation="mmha"`` function: ``query [B, Hq, S, D]``, ``key`` / ``value``
    ``[B, Hkv, S, D]`` (rotated, as the layer's cache ``update`` returned them). Returns
    ``(out [B, S, Hq, D], None)``."""
    ref = module.__dict__.get("_mmha_layer")
    layer = ref() if ref is not None else None
    if layer is None or not layer.armed:  # no MmhaCache in this forward
        if attention_mask is None and query.shape[2] > 1:
            _refuse_padding(kwargs.get("position_ids"))
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer.armed = False
    if attention_mask is not None:
        raise ValueError(
            "MmhaCache takes each row's padding from position_ids (left-padded prompts); an explicit "
            "4D attention_mask is not supported"
        )
    scale = module.scaling if scaling is None else scaling
    if query.shape[2] == 1:
        return layer.owner.decode(layer.index, query, key, value, scale), None
    extra = {k: v for k, v in kwargs.items() if k in ("softcap", "s_aux")}  # the eager attention's own
    return layer.owner.prefill(
        layer.index, module, query, key, value, scale, kwargs.get("position_ids"), **extra
    ), None


def _refuse_padding(position_ids) -> None:
    """No mask function is registered for "mmha", so a forward without an ``MmhaCache`` gets no
    padding mask: refuse a padded prompt rather than attend its pads."""
    if position_ids is None:
        return
    width = position_ids.shape[-1]
    if bool((position_ids[..., -1] + 1 != width).any()):
        raise ValueError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" without an MmhaCache in past_key_values is plain '
            "SDPA with no padding mask, and this prompt is padded: pass past_key_values=MmhaCache(model, ...)"
        )


def _check_cache_is_kept(model, max_cache_len: int) -> None:
    """Phi-3's ``generate`` drops the cache once a sequence passes the config's
    ``original_max_position_embeddings`` (to recompute every key with longrope's long factors);
    MmhaCache does not follow that recomputation, so its sequences must stay below that point."""
    switch = getattr(model.config, "original_max_position_embeddings", None)
    own = type(model).prepare_inputs_for_generation
    if switch is None or own is GenerationMixin.prepare_inputs_for_generation or max_cache_len <= switch:
        return
    raise ValueError(
        f"{type(model).__name__}.generate drops its cache when a sequence passes "
        f"config.original_max_position_embeddings ({switch}) to recompute it (longrope's switch), which "
        f"MmhaCache does not follow yet: max_cache_len ({max_cache_len}) must be at most {switch}"
    )


def register() -> None:
    """Make ``attn_implementation="mmha"`` known to transformers (done on ``import mmha.hf``)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, mmha_attention)


def _eager_attention(module):
    """The model's own eager attention function (its modeling module's ``eager_attention_forward``,
    which applies the layer's soft-cap and sinks), for prompts of layers with score modifiers."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(
            f"{type(module).__name__} has score modifiers but its module has no eager_attention_forward for "
            "the prompt's attention; MmhaCache cannot run this model"
        )
    return fn


def _prompt_mask(counts: list[int], width: int, window: int | None, device) -> torch.Tensor | None:
    """A prompt's attention mask ``[B, 1, S, S]`` (True: attended) for rows of ``counts`` tokens
    left-padded to ``width``: the row's own tokens, causal, within the window (the last ``window``
    keys, the query's own included); a pad query sees itself. None: plain causal (no padding or
    window)."""
    if min(counts) == width and (window is None or window >= width):
        return None
    i = torch.arange(width, device=device)
    first = torch.tensor([width - n for n in counts], device=device)
    causal = i[None, :] <= i[:, None]
    if window is not None:
        causal = causal & (i[None, :] > i[:, None] - window)
    mask = (i[None, :] >= first[:, None])[:, None, None, :] & causal[None, None]
    return mask | torch.eye(width, dtype=torch.bool, device=device)[None, None]


class MmhaLayer(CacheLayerMixin):
    """One decoder layer's view of an ``MmhaCache`` (transformers' per-layer cache interface)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: MmhaCache, index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.armed = False
        self.is_initialized = True  # the storage exists from the start

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """Pass the new K/V through (mmha_attention appends them) and arm this layer."""
        self.owner.bind(self)
        self.armed = True
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return self.owner.kv.max_seq_len

    def reset(self) -> None:
        self.owner.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("MmhaCache does not reorder rows (beam search); use greedy or sampling")


class MmhaCache(Cache):
    """K/V of a transformers causal LM in mmha's caches, for ``model.generate``.

    ``MmhaCache(model, max_batch_size, max_cache_len)``: the model must have been loaded (or set)
    with ``attn_implementation="mmha"`` (``import mmha.hf`` registers it). Pass the cache as
    ``past_key_values``; prompts must be left-padded (``generate``'s way for decoder-only models).
    Between unrelated ``generate`` calls, ``reset()`` it. ``kv_dtype=torch.float8_e4m3fn``:
    fp8 caches with scales from the first prompt's absolute maxima (``KVCache.prefill``);
    ``torch.int8``: codes with a scale per token; ``"int4"``: ``mmha.int4``'s format (on a GPU the
    kernel's int4 steps, contiguous caches).

    Any rotary variant works (transformers applies it); sliding windows, logit soft-caps and
    sinks (Mistral, Gemma 2, gpt-oss) are each layer's ``AttentionSpec``: the kernel applies them
    to a decode step, the model's own eager attention to a prompt. ``self.kv`` is the underlying
    ``KVCache`` (its ``check()`` raises for rows the kernel's guard refused).
    """

    def __init__(
        self,
        model,
        max_batch_size: int,
        max_cache_len: int,
        *,
        kv_dtype: torch.dtype | str | None = None,
        kv_scale_margin: float = 1.0,
    ):
        config = model.config
        if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"model must use attn_implementation={ATTN_IMPLEMENTATION!r} (load it with that argument "
                f"or call model.set_attn_implementation({ATTN_IMPLEMENTATION!r})), got "
                f"{getattr(config, '_attn_implementation', None)!r}"
            )
        _check_cache_is_kept(model, max_cache_len)
        modules = attention_modules(model)
        specs = [
            AttentionSpec(scale=float(m.scaling), **layer_mods(config, i, m, max_cache_len))
            for i, m in enumerate(modules)
        ]
        self._eager = [
            _eager_attention(m) if spec.has_mods else None for m, spec in zip(modules, specs, strict=True)
        ]
        param = next(model.parameters())
        num_heads = config.num_attention_heads
        num_kv_heads = config.num_key_value_heads or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        check_attention_kinds(config, head_dim)
        self.kv_scale_margin = kv_scale_margin
        self.kv = KVCache(
            len(modules), max_batch_size, max_cache_len, num_heads, num_kv_heads, head_dim, param.dtype,
            param.device, attention=specs, dispatch_on="capacity", kv_dtype=kv_dtype,
        )  # fmt: skip
        self.kv.release(range(max_batch_size))
        self._modules = modules
        self._prompt_lengths: list[int] = []
        self._plans: dict[int, tuple[int, int]] = {}
        self._workspace: ops.Workspace | None = None
        if self.kv.use_kernel:
            # One plan per batch size, from the capacity: it holds as lengths grow, so the step
            # reads no host state; the cache's workspace fits every batch size's plan (and its
            # check() reads the kernel's flags there).
            batches = range(1, max_batch_size + 1)
            self._plans = {b: (p.num_splits, p.stages) for b in batches for p in [self.kv.plan(b)]}
            self._workspace = self.kv.reserve_workspace(batches)
            # Fixed addresses: a compiled step mutates them in place and may be a CUDA graph.
            static = [*self.kv.k_caches, *self.kv.v_caches, self.kv.lengths, self.kv.rows.active_mask]
            static += [self._workspace.partials, self._workspace.counters, self._workspace.status]
            static += [t for t in (self.kv.k_scales, self.kv.v_scales) if t is not None]
            for t in static:
                torch._dynamo.mark_static_address(t)
        super().__init__(layers=[MmhaLayer(self, i) for i in range(len(modules))])
        for layer in self.layers:
            self.bind(layer)

    # ------------------------------------------------------------------ transformers' interface
    def bind(self, layer: MmhaLayer) -> None:
        """Point the layer's attention module at ``layer`` (weakly: the model does not keep the
        cache alive); a no-op once it does."""
        module = self._modules[layer.index]
        ref = module.__dict__.get("_mmha_layer")
        if ref is None or ref() is not layer:
            module._mmha_layer = weakref.ref(layer)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens in the longest row (a device read: called by ``generate`` before a prefill)."""
        return int(self.kv.lengths.max()) if self.kv.max_batch else 0

    def reset(self) -> None:
        """Empty every row (before new prompts)."""
        self.kv.release(range(self.kv.max_batch))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("MmhaCache does not expand rows (num_return_sequences > 1 or beam search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("MmhaCache does not select rows (contrastive search)")

    # ------------------------------------------------------------------ attention
    def decode(self, layer: int, query, key, value, scale: float) -> torch.Tensor:
        """One token per row: append its K/V at slot ``lengths[b]`` of rows ``0..B-1`` and attend
        (fused); after the last layer every active row's length moves on. ``[B, 1, Hq, D]``."""
        kv = self.kv
        b = query.shape[0]
        qkv = torch.cat([query.reshape(b, -1), key.reshape(b, -1), value.reshape(b, -1)], dim=1)
        kc, vc, lengths = kv.k_caches[layer][:b], kv.v_caches[layer][:b], kv.lengths[:b]
        spec = kv.attention[layer]
        if scale != spec.scale:  # transformers passed another scaling than the module's
            spec = spec.replace(scale=float(scale))
        scales = kv.scales_of(layer, b)
        kw = dict(num_heads=kv.num_heads, num_kv_heads=kv.num_kv_heads, attention=spec, **scales)
        if kv.use_kernel and kv.int4:
            splits, stages = self._plans[b]
            out = ops.decode_attention_int4(
                qkv, kv.storage.view(layer, b)[0], lengths, num_splits=splits, stages=stages,
                workspace=self._workspace, validate_lengths=False, **kw,
            )  # fmt: skip
        elif kv.use_kernel:
            splits, stages = self._plans[b]
            out = ops.decode_attention(
                qkv, kc, vc, lengths, num_splits=splits, stages=stages, workspace=self._workspace,
                validate_lengths=False, **kw,
            )  # fmt: skip
        elif kv.int4:  # the format's own reference step over its storage's view (mmha.int4)
            out = int4.decode_step(qkv, kv.storage.view(layer, b)[0], lengths, **kw)
        else:
            out = reference.decode_step(qkv, kc, vc, lengths, **kw)
        if layer == kv.num_layers - 1:
            kv.advance()
        return out.view(b, 1, kv.num_heads, kv.head_dim)

    def prefill(
        self, layer: int, module, query, key, value, scale: float, position_ids, **extra
    ) -> torch.Tensor:
        """A prompt step of rows ``0..B-1``: transformers' SDPA attention over the prompt, whose
        K/V (each row's last ``n`` tokens: left padding) go to slots ``0..n-1``. ``[B, S, Hq, D]``."""
        kv = self.kv
        b, s = key.shape[0], key.shape[2]
        if layer == 0:
            self._prompt_lengths = self._check_prompt(b, s, position_ids)
        counts = self._prompt_lengths
        window = kv.attention[layer].window
        mask = _prompt_mask(counts, s, window, query.device)
        eager = self._eager[layer]
        if eager is not None:  # the model's own attention applies its soft-cap and sinks
            if mask is None:
                mask = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()[None, None]
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            additive = additive.masked_fill(~mask, torch.finfo(query.dtype).min)
            out, _ = eager(module, query, key, value, additive, dropout=0.0, scaling=scale, **extra)
        else:
            out, _ = sdpa_attention_forward(
                module, query, key, value, mask, dropout=0.0, scaling=scale, is_causal=mask is None
            )
        # Row r's tokens are its last n: slot j takes position s - n + j (the rest is never read).
        shift = torch.tensor([s - n for n in counts], device=key.device)
        idx = (shift[:, None] + torch.arange(s, device=key.device)[None]).clamp(max=s - 1)
        gather = idx[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        k_rows = key.gather(2, gather).transpose(1, 2)
        v_rows = value.gather(2, gather).transpose(1, 2)
        kv.prefill(
            layer, k_rows, v_rows, lengths=counts, rows=list(range(b)), scale_margin=self.kv_scale_margin
        )
        return out

    def _check_prompt(self, batch: int, width: int, position_ids) -> list[int]:
        """Tokens per row of a prompt (host reads: a prefill synchronises anyway); checks that the
        rows are empty, fit, and are left-padded."""
        kv = self.kv
        if batch > kv.max_batch:
            raise ValueError(f"batch ({batch}) must be at most the cache's max_batch_size ({kv.max_batch})")
        held = kv.lengths[:batch].tolist()
        if any(held):
            raise ValueError(
                "MmhaCache already holds tokens of earlier prompts (continuing a prompt with several new "
                "tokens is not supported): call cache.reset() before generating for new prompts"
            )
        if position_ids is None:
            counts = [width] * batch
        else:
            # Left padding: a row of n tokens has positions 0..n-1 in its last n places, and its
            # last position is its largest (generate gives pads position 0).
            pos = position_ids.expand(batch, -1)
            n = pos[:, -1] + 1
            j = torch.arange(width, device=pos.device)
            first = (width - n)[:, None]
            ok = (n >= 1) & (n <= width) & (pos.amax(-1) == pos[:, -1])
            ok &= ((pos == j[None] - first) | (j[None] < first)).all(-1)
            bad = (~ok).nonzero().flatten().tolist()
            if bad:
                raise ValueError(
                    "MmhaCache needs left-padded prompts (tokenizer.padding_side = 'left'): the positions of "
                    f"rows {bad} do not end in 0..n-1"
                )
            counts = [int(c) for c in n.tolist()]
        longest = max(counts)
        if longest >= kv.max_seq_len:
            raise ValueError(
                f"a prompt of {longest} tokens leaves no room in max_cache_len ({kv.max_seq_len})"
            )
        kv.release(range(kv.max_batch))
        return counts
