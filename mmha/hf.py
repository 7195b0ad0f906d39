"""mmha for Hugging Face transformers models (``transformers`` is needed here, not by mmha).

Two routes:

- ``HFDecoder(model, max_batch, max_seq_len).generate(prompts, max_new_tokens)``: mmha's own
  greedy loop around the model's layers, each decode step one CUDA graph (``mmha.models.hf``).
- ``attn_implementation="mmha"`` with ``past_key_values=MmhaCache(model, ...)``: mmha's fused
  append + attention inside transformers' own ``generate`` (``mmha.models.hf_attention``);
  importing this module registers the attention implementation.
"""

from .models.hf import HFDecoder
from .models.hf_attention import ATTN_IMPLEMENTATION, MmhaCache, mmha_attention, register

register()

__all__ = ["ATTN_IMPLEMENTATION", "HFDecoder", "MmhaCache", "mmha_attention", "register"]
