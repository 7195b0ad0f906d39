"""``Fp8Scales``: an fp8 cache's scales, one per layer and kv head for K and for V.

The cache stores ``saturate(x / scale[h])`` rounded to e4m3 (``mmha.spec.quantize_fp8``). Scales
start at 1 and are set once per layer: by ``set`` (e.g. a checkpoint's calibrated scales) or
from a prompt's absolute maxima (``calibrate``). They change in place, so captured CUDA graphs
read the current values; the kernel refuses a step whose scales are not finite and positive.
"""

from __future__ import annotations

import math

import torch

from .spec import fp8_scale, quantize_fp8


class Fp8Scales:
    """``k``, ``v``: fp32 ``[num_layers, Hkv]`` on ``device``; ``was_set[layer]``."""

    def __init__(self, num_layers: int, num_kv_heads: int, device: torch.device):
        self.num_kv_heads = num_kv_heads
        self.k = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.v = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.was_set = [False] * num_layers

    def of(self, layer: int) -> dict:
        """The ``k_scale`` / ``v_scale`` arguments of a step of ``layer``."""
        return dict(k_scale=self.k[layer], v_scale=self.v[layer])

    def checked(self, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
        """Host fp32 ``[Hkv]`` copies of ``k_scale`` / ``v_scale`` (numbers or tensors), finite and
        positive (ValueError naming the argument)."""
        values = []
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            t = torch.as_tensor(s, dtype=torch.float32).detach().to("cpu")
            if t.dim() == 0:
                t = t.expand(self.num_kv_heads)
            if t.shape != (self.num_kv_heads,):
                raise ValueError(
                    f"{name} must be a number or have shape [{self.num_kv_heads}] (one per kv head), "
                    f"got shape {tuple(t.shape)}"
                )
            if not bool(torch.all(torch.isfinite(t) & (t > 0))):
                raise ValueError(f"{name} must be finite and positive, got {t.tolist()}")
            values.append(t)
        return values[0], values[1]

    def set(self, layer: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Layer ``layer``'s scales (already ``checked``)."""
        self.k[layer].copy_(k_scale.to(self.k.device))
        self.v[layer].copy_(v_scale.to(self.v.device))
        self.was_set[layer] = True

    def calibrate(self, layer: int, k_amax: torch.Tensor, v_amax: torch.Tensor, margin: float) -> None:
        """Scales that map ``amax * margin`` to 448 per kv head (``mmha.spec.fp8_scale``)."""
        self.set(layer, fp8_scale(k_amax, margin), fp8_scale(v_amax, margin))

    def quantize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8(k, self.k[layer]), quantize_fp8(v, self.v[layer])


def amax_of(prompts: list[torch.Tensor]) -> torch.Tensor:
    """Per kv head ``[Hkv]``: the largest absolute value over prompts ``[n, Hkv, D]``."""
    return torch.stack([t.float().abs().amax(dim=(0, 2)) for t in prompts]).amax(dim=0)


def check_margin(margin) -> float:
    if not (
        isinstance(margin, (int, float))
        and not isinstance(margin, bool)
        and math.isfinite(margin)
        and margin > 0
    ):
        raise ValueError(f"scale_margin must be a finite positive number, got {margin!r}")
    return float(margin)
