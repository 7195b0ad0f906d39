"""mmha: fused append + masked multi-head attention for the decode step of transformer inference."""

from . import dispatch, layout, reference, spec
from ._ext import extension_available
from ._version import __version__
from .cache import KVCache
from .dispatch import Plan, choose_variant
from .epilogue import OutEpilogue
from .info import info
from .spec import AttentionSpec, QKNorm, Rotary

__all__ = [
    "AttentionSpec",
    "KVCache",
    "OutEpilogue",
    "Plan",
    "QKNorm",
    "Rotary",
    "__version__",
    "choose_variant",
    "dispatch",
    "extension_available",
    "info",
    "layout",
    "reference",
    "spec",
]
