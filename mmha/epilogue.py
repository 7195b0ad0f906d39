"""The output epilogue: shift, smooth and quantisation of the attention output, in the same kernel.

W8A8 pipelines (SmoothQuant-style models, Paddle's and TensorRT-LLM's int8 attention) follow the
attention with an int8 ``o_proj`` GEMM. Its input is the attention output ``x`` (fp32, as the
kernel holds it before it rounds to the activations' dtype), per output channel ``c = head * D +
d``::

    y = (x + shift[c]) * smooth[c]                  # shift and smooth each optional
    q = saturate(round(y * scale))                  # scale: a float, or one per channel

``q`` is int8 (``round``: half to even or half away from zero; bounds ``[min_bound, 127]``,
``min_bound`` -127 or -128, as Paddle's ``quant_round_type`` / ``quant_min_bound``) or e4m3
(``torch.float8_e4m3fn``: saturated to +-448, rounded to nearest even). Without a scale the output
keeps the activations' dtype and holds ``y`` rounded to it. Every step is one fp32 operation, in
this order (no fused multiply-add), so the GPU and ``OutEpilogue.apply`` give the same bits for
the same ``x``. A NaN ``x`` (a row the kernel refused) quantises to int8 0 (e4m3: NaN); rows that
take no part and unused tree nodes have ``x = 0``, and the epilogue applies to them like any other.
"""

from __future__ import annotations

import math

import torch

from ._constants import FP8_MAX

FP8 = torch.float8_e4m3fn
INT8_MAX = 127
# round argument of the raw operator (Paddle's quant_round_type: 0 rint, 1 round).
ROUNDING = {"half_even": 0, "half_away": 1}
# out_kind of the raw operator: what the output tensor holds.
QUANT_DTYPES = (torch.int8, FP8)


class OutEpilogue:
    """A checked output epilogue (module docstring). ``shift`` and ``smooth``: fp32 ``[Hq * D]``
    or None; ``scale``: None (no quantisation), a float, or an fp32 ``[Hq * D]`` tensor, finite and
    positive; ``dtype``: ``torch.int8`` or ``torch.float8_e4m3fn`` (with a scale); ``rounding``:
    ``"half_even"`` or ``"half_away"`` (int8; e4m3 rounds to nearest even only); ``min_bound``: -127
    or -128 (int8). Tensor values are read once, here (one host synchronisation), so build an
    epilogue once per layer and reuse it; the tensors must not change afterwards.
    """

    def __init__(
        self,
        shift: torch.Tensor | None = None,
        smooth: torch.Tensor | None = None,
        scale: float | torch.Tensor | None = None,
        *,
        dtype: torch.dtype = torch.int8,
        rounding: str = "half_even",
        min_bound: int = -INT8_MAX,
    ):
        if shift is None and smooth is None and scale is None:
            raise ValueError("OutEpilogue needs at least one of shift, smooth and scale")
        tensors = [("shift", shift), ("smooth", smooth)]
        if isinstance(scale, torch.Tensor):
            tensors.append(("scale", scale))
        elif scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                raise ValueError(f"scale must be a float or a float32 tensor, got {type(scale).__name__}")
            as_fp32 = torch.tensor(float(scale), dtype=torch.float64).float().item()  # what the kernel gets
            if not (math.isfinite(as_fp32) and as_fp32 > 0):
                raise ValueError(f"scale must be finite and positive in fp32, got {scale}")
        device, channels = None, None
        for name, t in tensors:
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
                got = type(t).__name__
                if isinstance(t, torch.Tensor):
                    got = f"{t.dtype} of shape {tuple(t.shape)}"
                raise ValueError(f"{name} must be a 1-D float32 tensor [num_heads * head_dim], got {got}")
            if channels is not None and (t.numel() != channels or t.device != device):
                raise ValueError(
                    f"{name} must have the other tensors' shape [{channels}] and device {device}, "
                    f"got [{t.numel()}] on {t.device}"
                )
            device, channels = t.device, t.numel()
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} must be finite, got non-finite values at {_bad(torch.isfinite(t))}")
            if name == "scale" and not bool((t > 0).all()):
                raise ValueError(f"scale must be positive, got values <= 0 at {_bad(t > 0)}")
        if scale is not None and dtype not in QUANT_DTYPES:
            raise ValueError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
        if rounding not in ROUNDING:
            raise ValueError(f"rounding must be one of {tuple(ROUNDING)}, got {rounding!r}")
        if min_bound not in (-INT8_MAX, -INT8_MAX - 1) or isinstance(min_bound, bool):
            raise ValueError(f"min_bound must be -127 or -128, got {min_bound!r}")
        if scale is not None and dtype == FP8 and (rounding != "half_even" or min_bound != -INT8_MAX):
            raise ValueError(
                "rounding and min_bound must keep their defaults for a float8_e4m3fn output "
                f"(it saturates to +-448 and rounds to nearest even), got {rounding!r}, {min_bound}"
            )
        # The kernel reads the tensors in 16-byte vectors: a view that starts elsewhere is copied.
        shift, smooth, scale = (
            t.clone() if isinstance(t, torch.Tensor) and t.data_ptr() % 16 else t
            for t in (shift, smooth, scale)
        )
        self.shift, self.smooth, self.scale = shift, smooth, scale
        self.dtype = dtype if scale is not None else None
        self.rounding, self.min_bound = rounding, min_bound
        self.channels, self.device = channels, device

    @property
    def quantised(self) -> bool:
        return self.scale is not None

    def out_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The output's dtype for activations of ``activations``."""
        return self.dtype if self.quantised else activations

    def check_for(self, num_heads: int, head_dim: int, device) -> None:
        """The tensors fit a layer of ``num_heads`` heads of ``head_dim`` on ``device``."""
        want = num_heads * head_dim
        if self.channels is not None and self.channels != want:
            raise ValueError(
                f"epilogue tensors must have shape [num_heads * head_dim = {want}], got [{self.channels}]"
            )
        if self.device is not None and self.device != torch.device(device):
            raise ValueError(f"epilogue tensors must be on {torch.device(device)}, got {self.device}")

    def channels_of(self, first: int, last: int) -> OutEpilogue:
        """The epilogue of output channels ``first .. last - 1`` alone (a rank's heads)."""

        def part(t):
            return t[first:last] if isinstance(t, torch.Tensor) else t

        return OutEpilogue(
            part(self.shift), part(self.smooth), part(self.scale), dtype=self.dtype or torch.int8,
            rounding=self.rounding, min_bound=self.min_bound,
        )  # fmt: skip

    def kernel_args(self) -> dict:
        """The raw operator's arguments."""
        tensor_scale = isinstance(self.scale, torch.Tensor)
        return dict(
            out_shift=self.shift,
            out_smooth=self.smooth,
            out_scales=self.scale if tensor_scale else None,
            out_scale=0.0 if tensor_scale or self.scale is None else float(self.scale),
            out_round=ROUNDING[self.rounding],
            out_min=self.min_bound,
        )

    def apply(self, x: torch.Tensor, activations: torch.dtype) -> torch.Tensor:
        """The definition: ``x [..., Hq * D]`` (attention output, any float dtype; rounded to fp32
        first) -> the epilogue's output in ``out_dtype(activations)``."""
        y = x.float()
        if self.shift is not None:
            y = y + self.shift.to(y.device)
        if self.smooth is not None:
            y = y * self.smooth.to(y.device)
        if not self.quantised:
            return y.to(activations)
        scale = self.scale.to(y.device) if isinstance(self.scale, torch.Tensor) else self.scale
        y = y * scale
        if self.dtype == FP8:
            return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)
        if self.rounding == "half_even":
            r = torch.round(y)
        else:
            t = torch.trunc(y)  # y - t is exact in fp32; floor(|y| + 0.5) is not (0.49999997)
            r = t + torch.sign(y) * ((y - t).abs() >= 0.5)
        r = r.clamp(self.min_bound, INT8_MAX)
        return torch.where(torch.isnan(r), torch.zeros_like(r), r).to(torch.int8)


def check_epilogue(epilogue, num_heads: int, head_dim: int, device) -> None:
    """``epilogue`` is None or an ``OutEpilogue`` whose tensors fit a step of ``num_heads`` heads of
    ``head_dim`` on ``device`` (ValueError naming ``epilogue`` otherwise)."""
    if epilogue is None:
        return
    if not isinstance(epilogue, OutEpilogue):
        raise ValueError(
            f"epilogue must be a mmha.epilogue.OutEpilogue or None, got {type(epilogue).__name__}"
        )
    epilogue.check_for(num_heads, head_dim, device)


def _bad(ok: torch.Tensor) -> list[int]:
    return (~ok).nonzero().flatten()[:8].tolist()
