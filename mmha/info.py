"""``mmha.info()``: what is installed, what was compiled, and what GPU is there."""

from __future__ import annotations

import torch

from . import dispatch
from ._ext import _C, IMPORT_ERROR
from ._version import __version__


def _archs(raw: str) -> list[str]:
    out = []
    for tok in raw.replace(",", " ").split():
        if tok.isdigit():
            n = int(tok)
            out.append(f"{n // 100}.{(n % 100) // 10}")
    return out


def info() -> dict:
    """Versions, extension status, compiled archs and GPU, with a hint when something is missing."""
    d: dict = {
        "mmha": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "extension_built": _C is not None,
        "extension_error": None if IMPORT_ERROR is None else str(IMPORT_ERROR),
        "compiled_archs": _archs(_C.compiled_cuda_archs()) if _C is not None else [],
        "build_check": bool(getattr(_C, "build_check", lambda: False)()) if _C is not None else False,
        # the decode kernel sets held (a diagnostic build with MMHA_KERNELS holds some only)
        "kernel_sets": list(getattr(_C, "kernel_sets", lambda: [])()) if _C is not None else [],
        "supported_head_dims": list(dispatch.SUPPORTED_HEAD_DIMS),
        "gpu": None,
        "gpu_capability": None,
        "hint": None,
    }
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        d["gpu"] = torch.cuda.get_device_name(idx)
        d["gpu_capability"] = f"{major}.{minor}"
    if _C is None:
        d["hint"] = (
            "the CUDA extension is not built: install with CUDA_HOME set to a CUDA toolkit "
            "(`pip install --no-build-isolation -e .`); until then the reference path runs"
        )
    elif d["build_check"]:
        d["hint"] = (
            "this extension is a build check (MMHA_BUILD_CHECK=1, unoptimised PTX): it launches no "
            "kernels; reinstall without it: `pip install --no-build-isolation -e .`"
        )
    elif d["gpu"] is None:
        d["hint"] = "no CUDA GPU visible: KVCache.step runs the plain-torch reference path"
    elif d["gpu_capability"] not in d["compiled_archs"]:
        d["hint"] = (
            f"this GPU is sm {d['gpu_capability']} but mmha was compiled for "
            f"{', '.join(d['compiled_archs'])}: rebuild with "
            f"TORCH_CUDA_ARCH_LIST={d['gpu_capability']} pip install --no-build-isolation -e ."
        )
    return d


def format_info(d: dict | None = None) -> str:
    d = info() if d is None else d
    rows = [
        ("mmha", d["mmha"]),
        ("torch", f"{d['torch']} (CUDA {d['torch_cuda']})"),
        (
            "extension",
            ("built (build check)" if d["build_check"] else "built")
            if d["extension_built"]
            else f"missing: {d['extension_error']}",
        ),
        ("compiled archs", ", ".join(d["compiled_archs"]) or "-"),
        ("kernel sets", ", ".join(d.get("kernel_sets", [])) or "-"),
        ("head dims", ", ".join(map(str, d["supported_head_dims"]))),
        ("GPU", f"{d['gpu']} (sm {d['gpu_capability']})" if d["gpu"] else "none"),
    ]
    text = "\n".join(f"{k:>15}: {v}" for k, v in rows)
    if d["hint"]:
        text += f"\n{'hint':>15}: {d['hint']}"
    return text
