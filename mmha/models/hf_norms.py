"""A Hugging Face model's RMSNorm modules as mmha's one-launch row norm (``mmha.ops.rms_norm``)
during ``HFDecoder``'s decode steps.

An eager RMSNorm is five to eight elementwise kernels (casts, square, mean, add, rsqrt, two
multiplies); inside a decode step's CUDA graph each is a launch of a few microseconds on a
``[batch, hidden]`` tensor. The row norm does the same in one. A module is taken by what it
computes, not by its class: its weight and eps are read, and its output on probe rows (on its
own device, in its own dtype) is matched against the row norm's forms (``offset`` 0 or 1:
Llama's ``weight * n`` or Gemma's ``(1 + weight) * n``; ``cast_first``: whether ``n`` is rounded
to the dtype before the weight multiplies it). A module no form matches (a LayerNorm, an L2 norm,
anything else) keeps running as it is. Only on a CUDA device with the extension built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from .._ext import _C
from ..spec import QKNorm

# Probe tolerance by dtype: a few units in the last place (the reduction order differs).
_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class NormForm:
    """What an RMSNorm module computes, in ``mmha.reference.rms_norm``'s terms."""

    eps: float
    offset: float
    cast_first: bool


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        v = getattr(module, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def norm_form(module: nn.Module | None, dtype: torch.dtype | None = None) -> NormForm | None:
    """The form in which ``module`` computes on inputs of ``dtype`` (default its weight's), or None
    (no form matches, its output is of another dtype, not on a CUDA device, no extension): its
    output on probe rows equals the row norm's in that form to a few units in the last place of
    ``dtype``, closest first."""
    w = getattr(module, "weight", None)
    eps = _eps(module) if module is not None else None
    if _C is None or not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_cuda or eps is None:
        return None
    dtype = w.dtype if dtype is None else dtype
    if dtype not in _TOLERANCE:
        return None
    g = torch.Generator(device=w.device).manual_seed(0)
    x = (torch.randn(4, w.numel(), generator=g, device=w.device) * 3).to(dtype)
    with torch.no_grad():
        try:
            theirs = module(x)
        except (RuntimeError, TypeError, ValueError):
            return None
        if not isinstance(theirs, torch.Tensor) or theirs.shape != x.shape or theirs.dtype != dtype:
            return None
        best, best_err = None, None
        tol = _TOLERANCE[dtype]
        for offset in (0.0, 1.0):
            for cast_first in (True, False):
                form = NormForm(eps, offset, cast_first)
                ours = ops.rms_norm(x, torch.empty_like(x), [w.detach()], [0, 1, w.numel()], [eps], offset,
                                    cast_first)  # fmt: skip
                if not torch.allclose(ours.float(), theirs.float(), rtol=tol, atol=tol):
                    continue
                err = float((ours.float() - theirs.float()).abs().sum())
                if best_err is None or err < best_err:
                    best, best_err = form, err
    return best


class RowRMSNorm(nn.Module):
    """Stands in for an RMSNorm module (``form`` from ``norm_form``): the row norm over the last
    dim of its input, with the module's own weight."""

    def __init__(self, module: nn.Module, form: NormForm):
        super().__init__()
        self.weight_ref = [module.weight]  # the module's parameter, not registered twice
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, f = self.weight_ref[0], self.form
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        ops.rms_norm(rows, out, [w], [0, 1, w.numel()], [f.eps], f.offset, f.cast_first)
        return out.view(x.shape)


def layer_norms(model) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, name, RowRMSNorm)`` for each RMSNorm of ``model.model`` outside the attention
    modules (decoder layers' norms, the final norm) that the row norm computes on the hidden
    states' dtype (the embedding's); one probe per class and weight dtype and width, each
    instance's own eps taken."""
    hidden = model.model.get_input_embeddings().weight.dtype
    swaps, forms = [], {}
    for parent_name, parent in model.model.named_modules():
        if parent_name.endswith("self_attn") or ".self_attn." in parent_name:
            continue
        for name, child in parent.named_children():
            if name == "self_attn" or "RMSNorm" not in type(child).__name__:
                continue
            w, eps = getattr(child, "weight", None), _eps(child)
            if not isinstance(w, torch.Tensor) or eps is None:
                continue
            key = (type(child), w.dtype, w.numel())
            if key not in forms:
                forms[key] = norm_form(child, hidden)
            form = forms[key]
            if form is not None:
                swaps.append((parent, name, RowRMSNorm(child, NormForm(eps, form.offset, form.cast_first))))
    return swaps


def qk_row_norm(
    q_norm, k_norm, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple | None:
    """The row norm's arguments after ``x, out`` (``weights, layout, eps, offset, cast_first``)
    that apply a layer's q and k norms (``(module, "head" | "whole")`` or None, as
    ``LayerAttention`` holds them) in place on a fused qkv row of ``dtype`` in one launch; None
    when a norm is not one the row norm computes (or both are in different forms)."""
    weights, layout, eps, forms = [], [], [], set()
    for norm, col, heads in ((q_norm, 0, num_heads), (k_norm, num_heads * head_dim, num_kv_heads)):
        if norm is None:
            continue
        module, mode = norm
        form = norm_form(module, dtype)
        if form is None:
            return None
        weights.append(module.weight)
        layout += [col, 1, heads * head_dim] if mode == "whole" else [col, heads, head_dim]
        eps.append(form.eps)
        forms.add((form.offset, form.cast_first))
    if len(forms) != 1:
        return None
    ((offset, cast_first),) = forms
    return weights, layout, eps, offset, cast_first


def qk_kernel_norm(q_norm, k_norm, head_dim: int, dtype: torch.dtype) -> QKNorm | None:
    """The ``QKNorm`` with which the decode kernel computes a layer's q and k norms
    (``(module, "head" | "whole")`` or None, as ``LayerAttention`` holds them) for qkv of ``dtype``
    inside its q/k build: both per head with one ``[head_dim]`` weight each, in one form (offset,
    rounding) and one eps. None otherwise (a whole-projection norm, OLMo 2's; a norm the row norm
    does not compute; mixed forms): then ``qk_row_norm`` or the model's modules."""
    weights, forms = {}, set()
    for side, norm in (("q", q_norm), ("k", k_norm)):
        if norm is None:
            continue
        module, mode = norm
        w = getattr(module, "weight", None)
        if mode != "head" or not isinstance(w, torch.Tensor) or w.shape != (head_dim,):
            return None
        form = norm_form(module, dtype)
        if form is None:
            return None
        weights[side] = w.detach()
        forms.add(form)
    if len(forms) != 1:
        return None
    (form,) = forms
    return QKNorm(
        weights.get("q"), weights.get("k"), eps=form.eps, offset=form.offset, cast_first=form.cast_first
    )
