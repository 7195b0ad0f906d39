"""mmha: fused append + masked multi-head attention for the decode step of transformer inference."""

__version__ = "0.1.0"

from . import dispatch, layout, reference  # noqa: E402
from ._ext import extension_available  # noqa: E402
from .cache import KVCache  # noqa: E402
from .dispatch import Plan, choose_variant  # noqa: E402
from .epilogue import OutEpilogue  # noqa: E402
from .info import info  # noqa: E402

__all__ = [
    "KVCache",
    "OutEpilogue",
    "Plan",
    "choose_variant",
    "dispatch",
    "extension_available",
    "info",
    "layout",
    "reference",
]
