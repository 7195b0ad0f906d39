"""Applications of the library: a small Llama-style demo model and its reference decoder
(``llama``), generation with continuous batching (``generate``, ``python -m mmha generate``), and
the Hugging Face adapter (``hf``). Nothing here is imported by ``import mmha``."""
