"""The K/V formats on a Hugging Face model, teacher-forced: what a user needs before turning one on.

A prompt of ``context`` random tokens is prefilled in 16 bits (as ``KVCache.prefill`` takes the
model's own prompt pass), then ``steps`` more tokens are fed one at a time with the model's cache;
at each step every cached key and value reaches attention as the format would store it
(``kv_accuracy.store``: per token and kv head, with a zero point, K smoothed or per channel in
groups; fp8 with one scale per layer and kv head from the prompt). Against the same steps with
the 16-bit cache: the share of steps whose greedy pick agrees and the mean KL divergence of the
next-token distributions, ``KL(p_16 || p_format)``.

The formats are simulated in torch through an attention function registered with transformers
(``AttentionInterface``), so this measures the formats, not a kernel: it runs on the CPU or a GPU.
"""

from __future__ import annotations

import torch

from .kv_accuracy import store

# name: (K storage, V storage), in kv_accuracy.store's terms.
MODEL_FORMATS = {
    "fp8": ("fp8", "fp8"),
    "int8": ("int8", "int8"),
    "int8, K per channel": ("int8 channels", "int8"),
    "int4": ("int4", "int4"),
    "int4 asym": ("int4 asym", "int4 asym"),
    "int4 asym, K smoothed": ("int4 asym smooth", "int4 asym"),
    "int4, K per channel": ("int4 channels", "int4 asym"),
}
ATTENTION = "mmha_kv_formats"
_ACTIVE: dict = {}  # "format": (k kind, v kind), "prompt": the prompt's length


def _stored(kind: str, x: torch.Tensor, prompt: int) -> torch.Tensor:
    """``x [B, Hkv, S, D]`` as ``kind`` stores it (the first ``prompt`` tokens calibrate fp8's
    scales and the smoothing), read back in x's dtype."""
    rows = []
    for b in range(x.shape[0]):
        t = x[b].transpose(0, 1)  # [S, Hkv, D]
        rows.append(store(kind, t, t[:prompt]).to(x.dtype).transpose(0, 1))
    return torch.stack(rows)


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fmt = _ACTIVE.get("format")
    if fmt is not None:
        key = _stored(fmt[0], key, _ACTIVE["prompt"])
        value = _stored(fmt[1], value, _ACTIVE["prompt"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


@torch.no_grad()
def teacher_forced_logits(model, ids: torch.Tensor, prompt: int, fmt: tuple[str, str] | None) -> torch.Tensor:
    """fp32 next-token logits ``[len - prompt, vocab]`` of ``ids [1, len]``: the prompt's last
    position, then each fed token's, with the cache read through ``fmt`` (None: 16-bit)."""
    _register()
    own = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    try:
        out = model(input_ids=ids[:, :prompt], use_cache=True)
        cache, logits = out.past_key_values, [out.logits[0, -1].float()]
        _ACTIVE.update(format=fmt, prompt=prompt)
        for t in range(prompt, ids.shape[1] - 1):
            out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1].float())
    finally:
        _ACTIVE.clear()
        model.set_attn_implementation(own)
    return torch.stack(logits)


def compare(model, context: int, steps: int, seed: int = 0, formats=None) -> list[dict]:
    """One row per format: ``agreement`` (share of steps whose greedy pick equals the 16-bit
    cache's) and ``mean_kl`` over ``steps`` teacher-forced steps after a ``context``-token prompt."""
    formats = MODEL_FORMATS if formats is None else formats
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (1, context + steps), generator=g).to(device)
    base = teacher_forced_logits(model, ids, context, None)
    logp = torch.log_softmax(base, -1)
    rows = []
    for name, fmt in formats.items():
        other = teacher_forced_logits(model, ids, context, fmt)
        logq = torch.log_softmax(other, -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        rows.append({
            "format": name, "context": context, "steps": steps,
            "agreement": float((base.argmax(-1) == other.argmax(-1)).float().mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
        })  # fmt: skip
    return rows
