"""The model families mmha's Hugging Face routes are checked on: small random-weight models built
from each family's own ``transformers`` config class (nothing downloaded), each with what sets its
attention apart, and the greedy-token comparison of a route with transformers' own ``generate``.

``FAMILIES`` maps a family to its model type and config overrides. Windows are shorter than the
prompts (they matter from the first step), the rotary variants' original contexts are short (the
positions pass their switch points), gpt-oss's sinks are spread so that they matter. Used by the
tests (``tests/test_hf.py``, ``tests/test_hf_attention.py``) and by ``python -m mmha.bench.models``.
"""

from __future__ import annotations

import warnings

import torch

# The transformers config class of each model type.
CONFIG_CLASSES = {
    "llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "gemma2": "Gemma2Config",
    "gpt_oss": "GptOssConfig", "qwen3": "Qwen3Config", "gemma3_text": "Gemma3TextConfig",
    "phi3": "Phi3Config", "olmo2": "Olmo2Config", "granite": "GraniteConfig", "glm4": "Glm4Config",
    "smollm3": "SmolLM3Config", "starcoder2": "Starcoder2Config", "cohere": "CohereConfig",
}  # fmt: skip
# Every small model: 2 layers, 8 query / 2 kv heads of 32.
SMALL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip
# Rotary variants transformers computes from the config (original contexts of 16: the prompts and
# steps pass the variants' switch points).
ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip
ALTERNATING = ["sliding_attention", "full_attention"]
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama3": ("llama", dict(rope_parameters=ROPE_VARIANTS["llama3"])),
    "qwen2.5": ("qwen2", {}),
    "qwen2.5-yarn": ("qwen2", dict(rope_parameters=ROPE_VARIANTS["yarn"])),
    "mistral": ("mistral", dict(sliding_window=8)),
    "gemma2": ("gemma2", dict(sliding_window=8, head_dim=32, query_pre_attn_scalar=24,
                              attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                              layer_types=ALTERNATING)),
    "gpt-oss": ("gpt_oss", dict(sliding_window=8, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                layer_types=ALTERNATING,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    "qwen3": ("qwen3", {}),
    "gemma3": ("gemma3_text", dict(sliding_window=8, head_dim=32, query_pre_attn_scalar=24,
                                   layer_types=ALTERNATING)),
    "phi3": ("phi3", dict(original_max_position_embeddings=80, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0 + i / 16 for i in range(16)],
        "long_factor": [1.0 + i / 4 for i in range(16)], "original_max_position_embeddings": 80})),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", dict(attention_multiplier=0.05, residual_multiplier=0.5, embedding_multiplier=4.0,
                                logits_scaling=2.0)),
    "glm4": ("glm4", {}),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0])),
    "starcoder2": ("starcoder2", dict(sliding_window=8)),
    "cohere": ("cohere", dict(use_qk_norm=True, logit_scale=0.5)),
}  # fmt: skip
PROMPT_LENGTHS = [5, 23, 11, 40]


def build(model_type: str, device, dtype: torch.dtype, **over):
    """A small model of ``model_type`` (``SMALL`` with ``over``), weights spread so that greedy
    picks are decisive and biases are non-zero; eval mode, on ``device`` in ``dtype``."""
    import transformers

    config = getattr(transformers, CONFIG_CLASSES[model_type])(**{**SMALL, **over})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.5)
        for layer in model.model.layers:  # sinks that matter
            if getattr(layer.self_attn, "sinks", None) is not None:
                layer.self_attn.sinks.normal_(0, 2.0)
    return model.to(device, dtype).eval()


def build_family(family: str, device, dtype: torch.dtype):
    model_type, over = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(model_type, device, dtype, **over)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def own_attention(model) -> str:
    """The attention transformers' own generate() runs the family with (gpt-oss has no SDPA path)."""
    return "eager" if model.config.model_type == "gpt_oss" else "sdpa"


def hf_greedy(model, prompt: list[int], new_tokens: int, eos: int | None = None) -> list[int]:
    """transformers' own greedy tokens for one prompt (up to its first ``eos`` if one is given)."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    stop = {} if eos is None else dict(eos_token_id=eos, pad_token_id=eos)
    least = {} if eos is not None else dict(min_new_tokens=new_tokens)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **least, **stop)
    return out[0, len(prompt) :].tolist()


def left_padded(ps: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of a left-padded batch (pad id 0)."""
    width = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def native_generate(model, cache, ps: list[list[int]], new: int, **kw) -> list[list[int]]:
    """transformers' generate of a left-padded batch with ``past_key_values=cache``."""
    ids, mask = left_padded(ps, next(model.parameters()).device)
    out = model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
        do_sample=False, **kw,
    )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def route_tokens(model, route: str, new_tokens: int, capacity: int | None = None, **kw) -> list[list[int]]:
    """Greedy tokens of ``prompts`` through ``route``: ``"graphs"`` (``HFDecoder``) or
    ``"native"`` (``attn_implementation="mmha"`` + ``MmhaCache`` in transformers' generate), on a
    cache of ``capacity`` tokens (default: just enough; a long one makes the capacity plan split
    the sequence). Raises ValueError where the route refuses the model."""
    from ..hf import HFDecoder, MmhaCache

    ps = prompts(model.config.vocab_size)
    seq = capacity or max(PROMPT_LENGTHS) + new_tokens + 1
    if route == "graphs":
        return HFDecoder(model, len(ps), seq, **kw).generate(ps, new_tokens)
    own = model.config._attn_implementation
    model.set_attn_implementation("mmha")
    try:
        cache = MmhaCache(model, len(ps), seq)
        moe = getattr(model.config, "num_local_experts", None) is not None
        tokens = native_generate(model, cache, ps, new_tokens, disable_compile=moe, **kw)
        cache.kv.check()
        return tokens
    finally:
        model.set_attn_implementation(own)


def transformers_tokens(model, new_tokens: int) -> list[list[int]]:
    """transformers' own greedy tokens of each prompt alone (its own attention)."""
    own = model.config._attn_implementation
    model.set_attn_implementation(own_attention(model))
    try:
        return [hf_greedy(model, p, new_tokens) for p in prompts(model.config.vocab_size)]
    finally:
        model.set_attn_implementation(own)


def check_family(family: str, route: str, device, new_tokens: int = 16, capacity: int | None = None) -> dict:
    """One row of the families table: ``tokens_equal`` (fp32 greedy tokens of every prompt equal
    transformers' own) or ``refused`` (the route's reason)."""
    model = build_family(family, device, torch.float32)
    row: dict = {"family": family, "model_type": model.config.model_type, "route": route}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = route_tokens(model, route, new_tokens, capacity)
    except ValueError as e:
        return row | {"tokens_equal": False, "refused": str(e)}
    theirs = transformers_tokens(model, new_tokens)
    rows = [r for r, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    return row | {"tokens_equal": not rows, "refused": None, "rows_differing": rows}
