"""Decode across GPUs: one layer's KV cache over the ranks of a ``torch.distributed`` process
group, sharded by heads (tensor parallel) or by sequence (context parallel), merged exactly with
FlashDecoding's rescale (``merge``). ``ShardedKVCache`` keeps ``KVCache``'s API; the demo runs
under ``torchrun --nproc-per-node 2 -m mmha.distributed.demo``. Not imported by ``import mmha``."""

from .cache import MODES, CollectiveError, ShardedKVCache
from .merge import merge_partials

__all__ = ["MODES", "CollectiveError", "ShardedKVCache", "merge_partials"]
