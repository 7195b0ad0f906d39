"""``HFDecoder`` under its public path (``from mmha.hf import HFDecoder``); the adapter lives in
``mmha.models.hf``."""

from .models.hf import HFDecoder

__all__ = ["HFDecoder"]
