"""Loads the compiled extension (which registers ``torch.ops.mmha.*``) if it was built."""

from __future__ import annotations

import torch  # noqa: F401  (loads libc10 and friends before the extension)

try:
    from . import _C  # noqa: F401

    IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # built with MMHA_SKIP_CUDA=1, or not built at all
    _C = None
    IMPORT_ERROR = exc


def extension_available() -> bool:
    return _C is not None
