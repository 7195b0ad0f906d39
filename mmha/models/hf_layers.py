"""What each decoder layer's attention of a Hugging Face causal LM needs, read from the model, and
the module that stands in for it during ``HFDecoder``'s decode steps.

A model is accepted by what its attention computes, not by its model type:

- projections ``q_proj`` / ``k_proj`` / ``v_proj`` (with or without biases) or one ``qkv_proj``
  (Phi-3), and ``o_proj``;
- optional ``q_norm`` / ``k_norm``, per head (Qwen 3, Gemma 3, Cohere's ``[H, D]`` layer norm) or
  over the whole projection (OLMo 2), applied by the model's own norm modules;
- the rotation: the model's own frequency table and attention factor (``rotary_emb``; Gemma 3's
  per layer type), its layout (GPT-NeoX halves or GPT-J pairs) and the rotated width (GLM-4's
  partial rotary), found by running the modeling module's own ``apply_rotary_pos_emb`` on probe
  vectors and matching it; layers with ``use_rope`` off (SmolLM3) have none;
- the layer's scale (``module.scaling``: Granite's multiplier, Gemma's ``query_pre_attn_scalar``),
  sliding window, logit soft-cap and sinks (``layer_mods``).

Anything else in an attention module (another projection or norm: multi-head latent attention,
Llama 4's L2 norm, ...) is refused, naming it. The rest of a layer (norm placement, residual
multipliers, parallel blocks, mixtures of experts) is the model's own code: ``HFDecoder`` runs the
model's own forward with each layer's ``self_attn`` swapped for an ``MmhaSelfAttention``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..reference import apply_rotary
from ..spec import AttentionSpec, Rotary

# Rotary variants whose frequencies transformers changes with the sequence length at run time.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")
# What an attention module may hold: anything else names a computation mmha does not do.
KNOWN_PARTS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm", "sinks")


# Layer types (config.layer_types) whose attention mmha computes.
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_attention_kinds(config, head_dim: int) -> None:
    """Refuses, naming it, attention that no layer spec describes: layer types other than full and
    sliding attention (chunked, linear, ...), chunked attention, q/k and v of other head dims than
    ``head_dim`` (multi-head latent attention)."""
    types = sorted(set(getattr(config, "layer_types", None) or [])) or []
    other = [t for t in types if t not in KNOWN_LAYER_TYPES]
    if other:
        raise ValueError(
            f"config.layer_types holds {other}, attention mmha does not compute "
            f"(it runs {list(KNOWN_LAYER_TYPES)})"
        )
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError(
            f"config.attention_chunk_size ({config.attention_chunk_size}): chunked attention is not "
            "computed by mmha"
        )
    for name in ("qk_head_dim", "v_head_dim"):
        dim = getattr(config, name, None)
        if dim is not None and dim != head_dim:
            raise ValueError(
                f"config.{name} ({dim}) differs from head_dim ({head_dim}): mmha's q, k and v share one head "
                "dim (multi-head latent attention is not computed)"
            )


def attention_modules(model) -> list:
    """The attention module (``self_attn``) of each decoder layer (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(
            f"{type(model).__name__} has no decoder layers with self_attn at model.model.layers: mmha runs "
            "decoder-only causal LMs laid out that way"
        )
    return [layer.self_attn for layer in layers]


def layer_mods(config, i: int, attn, max_seq_len: int) -> dict:
    """Layer ``i``'s score modifiers, ``AttentionSpec`` fields (``attn``: its attention module): its
    sliding window (where it is shorter than the cache), Gemma 2's logit soft-cap, gpt-oss's sinks."""
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
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:
        mods["sinks"] = sinks.detach().float().contiguous()
    return mods


def _rope_params(config, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params


def _switch_point(config, emb, rope_type: str, params: dict) -> int:
    """The sequence length past which transformers changes a dynamic variant's frequencies."""
    if rope_type == "longrope":
        return int(
            params.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None)
            or emb.original_max_seq_len
        )
    return int(emb.original_max_seq_len)


def drops_cache_at_switch(model) -> bool:
    """Whether transformers' ``generate`` recomputes the whole sequence when it first passes
    longrope's switch (Phi-3 and its kin drop the cache there, in their own
    ``prepare_inputs_for_generation``), rather than keep the keys cached with the short factors."""
    try:
        source = inspect.getsource(type(model).prepare_inputs_for_generation)
    except (OSError, TypeError):
        return False
    return "original_max_position_embeddings" in source and "past_key_values = None" in source


def reset_rotary_state(body) -> None:
    """transformers' dynamic rotary keeps the longest length it has seen and its table; a fresh
    sequence (as a new ``generate`` sees it) starts from the original table."""
    emb = getattr(body, "rotary_emb", None)
    if emb is None or not hasattr(emb, "original_max_seq_len"):
        return
    for name in [n for n, _ in emb.named_buffers() if n.endswith("inv_freq") and "original" not in n]:
        prefix = name[: -len("inv_freq")]
        original = getattr(emb, f"{prefix}original_inv_freq", None)
        if original is not None:
            emb.register_buffer(name, original.to(getattr(emb, name).device), persistent=False)
        if hasattr(emb, f"{prefix}max_seq_len_cached"):
            setattr(emb, f"{prefix}max_seq_len_cached", emb.original_max_seq_len)


def tables_by_length(model, emb, rope_type: str, layer_type, table, switch: int, max_seq_len: int):
    """The frequencies of a variant transformers changes with the sequence's length, one row per
    length as ``Rotary(table_start=switch)`` reads them: row 0 the model's own ``table`` (lengths up
    to ``switch``); longrope's one more row, its long factors (every length past ``switch``);
    dynamic NTK's row ``n - switch`` for each length ``n`` up to ``max_seq_len``, each made as
    transformers makes it when the sequence grows to ``n`` (its init function, with ``n`` a tensor
    on the model's device, so in the same fp32 operations)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    device = table.device if not hasattr(emb, "inv_freq") else emb.inv_freq.device
    kw = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":
        lengths = [switch + 1]  # as transformers' longrope update asks for the long factors
    else:
        lengths = [torch.tensor(n, device=device) for n in range(switch + 1, max_seq_len + 1)]
    rows = [table] + [init(model.config, device, seq_len=n, **kw)[0].detach().float().cpu() for n in lengths]
    return torch.stack(rows).contiguous()


def layer_rotary(model, i: int, attn, head_dim: int, max_seq_len: int) -> Rotary | None:
    """Layer ``i``'s rotation (module docstring), or None for a layer without rotary. Refuses a
    rotation mmha does not compute, naming it."""
    if not getattr(attn, "use_rope", True):  # SmolLM3's NoPE layers
        return None
    config = model.config
    emb = getattr(model.model, "rotary_emb", None)
    types = getattr(config, "layer_types", None)
    layer_type = types[i] if types is not None and hasattr(emb, f"{types[i]}_inv_freq") else None
    prefix = "" if layer_type is None else f"{layer_type}_"
    table = getattr(emb, f"{prefix}original_inv_freq", None)
    table = getattr(emb, f"{prefix}inv_freq", None) if table is None else table
    if table is None:
        raise ValueError(
            f"{type(model).__name__} has no model.rotary_emb.inv_freq (the rotation's frequencies)"
        )
    params = _rope_params(config, layer_type)
    rope_type = params.get("rope_type", "default")
    switch = _switch_point(config, emb, rope_type, params) if rope_type in DYNAMIC_ROPE_TYPES else None
    factor = getattr(emb, f"{prefix}attention_scaling", 1.0)
    table = table.detach().float().cpu().contiguous()
    if 2 * table.numel() > head_dim:
        raise ValueError(f"layer {i}: {table.numel()} rotary frequencies do not fit head_dim {head_dim}")
    theta = float(params.get("rope_theta", 10000.0))
    candidates = [
        Rotary(2 * table.numel(), theta, interleaved, inv_freq=table, attention_factor=float(factor))
        for interleaved in (False, True)
    ]
    # The probe's positions stay below a dynamic variant's switch (the model's own table there).
    probe_len = max_seq_len if switch is None else min(max_seq_len, switch)
    for rotary in candidates:
        if _rotates_like_the_model(model, emb, attn, layer_type, rotary, head_dim, probe_len):
            if switch is not None and max_seq_len > switch:
                rows = tables_by_length(model, emb, rope_type, layer_type, table, switch, max_seq_len)
                return replace(rotary, inv_freq=rows, table_start=switch)
            return rotary
    raise ValueError(
        f"layer {i}: the model's rotation ({type(attn).__module__}.apply_rotary_pos_emb) is not GPT-NeoX "
        f"halves or GPT-J pairs over the first {2 * table.numel()} dims of model.rotary_emb's frequencies"
    )


def _rotates_like_the_model(
    model, emb, attn, layer_type, rotary: Rotary, head_dim: int, max_seq_len: int
) -> bool:
    """Whether ``rotary`` rotates probe vectors as the model's own ``apply_rotary_pos_emb`` does,
    at positions up to ``max_seq_len - 1`` (in fp32 on the CPU)."""
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        return False
    pos = torch.tensor([0, 1, 7, max(max_seq_len - 1, 0)])
    x = torch.randn(len(pos), 1, head_dim, generator=torch.Generator().manual_seed(0))
    device = emb.inv_freq.device if hasattr(emb, "inv_freq") else next(model.parameters()).device
    probe = torch.zeros(1, 1, head_dim, device=device)
    args = () if layer_type is None else (layer_type,)
    try:
        with torch.no_grad():
            cos, sin = emb(probe, pos[None].to(device), *args)
            theirs, _ = fn(x.transpose(0, 1)[None].to(device), x.transpose(0, 1)[None].to(device), cos, sin)
    except (TypeError, RuntimeError, ValueError):
        return False
    theirs = theirs[0].transpose(0, 1).float().cpu()
    ours = apply_rotary(x, pos, rotary)
    return theirs.shape == ours.shape and torch.allclose(theirs, ours, rtol=1e-4, atol=1e-5)


def _norm_mode(norm, heads: int, head_dim: int, name: str, i: int) -> str | None:
    """``"head"`` (over each head's D values), ``"whole"`` (over the projection) or None."""
    if norm is None:
        return None
    w = getattr(norm, "weight", None)
    if w is not None and w.dim() == 1 and w.numel() == heads * head_dim and heads > 1:
        return "whole"
    if w is not None and (w.shape == (head_dim,) or w.shape == (heads, head_dim)):
        return "head"
    shape = None if w is None else tuple(w.shape)
    raise ValueError(
        f"layer {i}: {name} has weight {shape}; mmha applies q/k norms per head ([{head_dim}] or "
        f"[{heads}, {head_dim}]) or over the projection ([{heads * head_dim}])"
    )


@dataclass
class LayerAttention:
    """One layer's attention as mmha runs it: the spec, the fused projection, the q/k norms."""

    spec: AttentionSpec
    weight: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]: q, k, v rows in that order
    bias: torch.Tensor | None  # [(Hq + 2 Hkv) D] or None
    q_norm: tuple[nn.Module, str] | None
    k_norm: tuple[nn.Module, str] | None
    o_proj: nn.Module


def _fused_projection(attn) -> tuple[torch.Tensor, torch.Tensor | None]:
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj.weight.detach(), (
            None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach()
        )
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    weight = torch.cat([p.weight.detach() for p in projs])
    if all(p.bias is None for p in projs):
        return weight, None
    bias = torch.cat(
        [p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in projs]
    )
    return weight, bias


def layer_attention(model, i: int, attn, heads: tuple[int, int, int], max_seq_len: int) -> LayerAttention:
    """Layer ``i``'s ``LayerAttention`` (``heads``: Hq, Hkv, D); refuses what mmha does not compute."""
    num_heads, num_kv_heads, head_dim = heads
    parts = [n for n, _ in attn.named_children()] + [n for n, _ in attn.named_parameters(recurse=False)]
    unknown = [n for n in parts if n not in KNOWN_PARTS]
    if unknown:
        raise ValueError(
            f"layer {i}'s attention ({type(attn).__name__}) has {unknown}, which mmha does not compute "
            f"(it knows {list(KNOWN_PARTS)})"
        )
    if not (hasattr(attn, "qkv_proj") or all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))):
        raise ValueError(
            f"layer {i}'s attention ({type(attn).__name__}) has no q_proj / k_proj / v_proj or qkv_proj"
        )
    weight, bias = _fused_projection(attn)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if weight.shape[0] != width:
        raise ValueError(f"layer {i}: the q/k/v projections give {weight.shape[0]} values, expected {width}")
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    q_mode = _norm_mode(q_norm, num_heads, head_dim, "q_norm", i)
    k_mode = _norm_mode(k_norm, num_kv_heads, head_dim, "k_norm", i)
    rotary = layer_rotary(model, i, attn, head_dim, max_seq_len)
    if rotary is not None and rotary.inv_freq is not None:  # probed on the CPU; the kernel reads it here
        rotary = replace(rotary, inv_freq=rotary.inv_freq.to(weight.device))
    spec = AttentionSpec(
        rotary=rotary or Rotary(), scale=float(attn.scaling), **layer_mods(model.config, i, attn, max_seq_len)
    )
    return LayerAttention(
        spec, weight, bias, None if q_mode is None else (q_norm, q_mode),
        None if k_mode is None else (k_norm, k_mode), attn.o_proj,
    )  # fmt: skip


def _normed(x: torch.Tensor, norm: tuple[nn.Module, str] | None, heads: int, head_dim: int) -> torch.Tensor:
    if norm is None:
        return x
    module, mode = norm
    if mode == "whole":
        return module(x)
    return module(x.unflatten(-1, (heads, head_dim))).flatten(-2)


class MmhaSelfAttention(nn.Module):
    """Layer ``index``'s attention on an ``HFDecoder``'s cache: the fused q/k/v projection, the
    model's q/k norms, ``KVCache.step`` (or ``step_tree``: ``decoder.parents`` set) appending and
    attending with the layer's rotation and modifiers, then ``o_proj``. Takes the hidden states
    ``[B, T, hidden]`` a decoder layer passes its ``self_attn``; returns ``(out, None)`` as
    transformers' attention modules do."""

    def __init__(self, decoder, index: int, layer: LayerAttention, row_norm: tuple | None = None):
        """``row_norm``: ``hf_norms.qk_row_norm``'s arguments, to apply the q/k norms in one
        launch in place of the model's modules."""
        super().__init__()
        self.decoder, self.index, self.layer, self.row_norm = decoder, index, layer, row_norm
        normed = layer.q_norm is not None or layer.k_norm is not None
        # The kernel adds qkv_bias before rotary; with q/k norms the bias comes before the norm.
        self.linear_bias = layer.bias if normed else None
        self.kernel_bias = None if normed else layer.bias

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        dec, layer = self.decoder, self.layer
        cache = dec.cache
        hq, hkv, d = cache.num_heads, cache.num_kv_heads, cache.head_dim
        qkv = F.linear(hidden_states, layer.weight, self.linear_bias)
        if self.row_norm is not None:
            rows = qkv.view(-1, qkv.shape[-1])
            ops.rms_norm(rows, rows, *self.row_norm)
        elif layer.q_norm is not None or layer.k_norm is not None:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            qkv = torch.cat([_normed(q, layer.q_norm, hq, d), _normed(k, layer.k_norm, hkv, d), v], dim=-1)
        if dec.parents is not None:
            out = cache.step_tree(
                self.index, qkv, dec.parents, node_counts=dec.node_counts, qkv_bias=self.kernel_bias
            )
        else:
            b = hidden_states.shape[0]
            out = cache.step(self.index, qkv.reshape(b, -1), qkv_bias=self.kernel_bias).view(b, 1, -1)
        return layer.o_proj(out), None


class NoRotaryTables(nn.Module):
    """Stands in for the model's ``rotary_emb`` during mmha's steps: the kernel rotates, so the
    cos / sin the model would compute (and, for the variants that switch with the length, the host
    read that decides them, which a CUDA graph cannot hold) are not needed. Returns empty tables."""

    def forward(self, x: torch.Tensor, *args, **kwargs):
        empty = x.new_zeros(0)
        return empty, empty


_NO_ROTARY_TABLES = NoRotaryTables()  # stateless: one instance stands in for every model's

# The attention implementation a swapped step names: one with no mask function registered, so
# transformers builds no mask (the swapped modules take none) and reads no positions for packed
# sequences (a host synchronisation outside graph capture).
NO_MASK_IMPLEMENTATION = "mmha"


@contextlib.contextmanager
def swapped_attention(model, modules: list[nn.Module], norms: list[tuple[nn.Module, str, nn.Module]] = ()):
    """Each decoder layer's ``self_attn`` replaced by ``modules[i]`` (``rotary_emb``, if the model
    has one, by ``NoRotaryTables``; the config's attention implementation by one without masks;
    each ``(parent, name, module)`` of ``norms``, ``hf_norms.layer_norms``, in its place) for the
    duration."""
    body = model.model
    layers = body.layers
    own = [layer.self_attn for layer in layers]
    own_norms = [getattr(parent, name) for parent, name, _ in norms]
    own_rotary = getattr(body, "rotary_emb", None)
    config = body.config
    own_impl = config._attn_implementation_internal
    try:
        for parent, name, m in norms:
            setattr(parent, name, m)
        for layer, m in zip(layers, modules, strict=True):
            layer.self_attn = m
        if own_rotary is not None:
            body.rotary_emb = _NO_ROTARY_TABLES
        config._attn_implementation_internal = NO_MASK_IMPLEMENTATION
        yield
    finally:
        config._attn_implementation_internal = own_impl
        for layer, m in zip(layers, own, strict=True):
            layer.self_attn = m
        for (parent, name, _), m in zip(norms, own_norms, strict=True):
            setattr(parent, name, m)
        if own_rotary is not None:
            body.rotary_emb = own_rotary


def output_head(model):
    """``head(hidden [N, hidden]) -> fp32 logits [N, vocab]``: ``lm_head`` and what the model's own
    forward does after it (Gemma's final soft-cap, Granite's ``logits_scaling``, Cohere's
    ``logit_scale``), checked against the model's forward on one token."""
    config = model.config
    cap = getattr(config, "final_logit_softcapping", None)
    divide = getattr(config, "logits_scaling", None)
    multiply = getattr(model, "logit_scale", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(hidden)
        if divide is not None:
            logits = logits / divide
        if multiply is not None:
            logits = logits * multiply
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    ids = torch.ones(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        theirs = model(input_ids=ids, use_cache=False).logits[0, -1].float()
        ours = head(model.model(input_ids=ids, use_cache=False).last_hidden_state[0, -1])
    if not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3 * float(theirs.abs().max())):
        raise ValueError(
            f"{type(model).__name__}'s output head does more than lm_head, a final soft-cap, logits_scaling "
            "and logit_scale (its logits differ from lm_head of the final hidden state)"
        )
    return head
