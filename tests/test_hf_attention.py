"""mmha.models.hf_attention: ``attn_implementation="mmha"`` with ``MmhaCache`` inside transformers'
own ``generate`` (random-init models from configs, nothing downloaded)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import HAS_GPU

transformers = pytest.importorskip("transformers")

from test_hf import (  # noqa: E402
    FAMILIES,
    MORE_FAMILIES,
    PROMPT_LENGTHS,
    build,
    check_no_decisive_mismatch,
    hf_greedy,
    prompts,
)

from mmha.hf import MmhaCache  # noqa: E402
from mmha.models.hf_layers import attention_modules  # noqa: E402

gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
pytestmark = pytest.mark.usefixtures("no_reference_warning")


def left_padded(ps: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of a left-padded batch (pad id 0)."""
    width = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def mmha_model(model_type: str, device: str, dtype: torch.dtype, **over):
    model = build(model_type, device, dtype, **over)
    model.set_attn_implementation("mmha")
    return model


def generate(model, cache, ps, new: int, **kw) -> list[list[int]]:
    ids, mask = left_padded(ps, next(model.parameters()).device)
    out = model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
        do_sample=False, **kw,
    )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_cpu_ragged_batch_matches_generate(model_type):
    """A left-padded ragged batch through transformers' loop with MmhaCache (the reference path
    on the CPU): each row's tokens equal the model's own greedy generate() of that prompt; after
    reset() the same cache gives them again."""
    model = mmha_model(model_type, "cpu", torch.float32)
    ps = prompts(model.config.vocab_size)
    cache = MmhaCache(model, 6, max(PROMPT_LENGTHS) + 13)
    got = generate(model, cache, ps, 12)
    model.set_attn_implementation("sdpa")
    expect = [hf_greedy(model, p, 12) for p in ps]
    assert got == expect
    assert cache.get_seq_length() == max(PROMPT_LENGTHS) + 11  # the last pick is not cached
    assert cache.kv.host_lengths[:4] == [n + 11 for n in PROMPT_LENGTHS]
    model.set_attn_implementation("mmha")
    cache.reset()
    assert generate(model, cache, ps, 12) == expect


def test_cpu_eos_in_the_middle_of_a_batch():
    """transformers' loop stops a row at its end-of-sequence token and pads it while the others go
    on: the same output as its own batched generate() with SDPA on the same left-padded batch."""
    model = mmha_model("llama", "cpu", torch.float32, vocab_size=64)
    ps = prompts(64)
    cache = MmhaCache(model, 4, max(PROMPT_LENGTHS) + 41)
    plain = generate(model, cache, ps, 40)
    eos = next(t for t in plain[1][2:] if t not in plain[0])  # row 1 stops early, row 0 never
    cache.reset()
    ids, mask = left_padded(ps, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    got = model.generate(ids, past_key_values=cache, **kw)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, **kw)
    assert torch.equal(got, want)
    assert (got[1, ids.shape[1] :] == eos).sum() > 1 and (got[0, ids.shape[1] :] != eos).all()


def test_cpu_forward_without_the_cache_is_sdpa():
    """attn_implementation="mmha" in a forward that carries no MmhaCache is transformers' SDPA."""
    model = mmha_model("llama", "cpu", torch.float32)
    ids = torch.tensor([prompts(model.config.vocab_size)[1]])
    MmhaCache(model, 2, 64)  # bound to the model, but not passed
    got = model(ids, use_cache=False).logits
    model.set_attn_implementation("sdpa")
    assert torch.equal(got, model(ids, use_cache=False).logits)


def test_cpu_refusals_name_the_problem():
    model = build("llama", "cpu", torch.float32)
    with pytest.raises(ValueError, match="model must use attn_implementation='mmha'.*got 'sdpa'"):
        MmhaCache(model, 2, 64)
    model.set_attn_implementation("mmha")
    cache = MmhaCache(model, 2, 64)
    ps = prompts(model.config.vocab_size)[:2]
    generate(model, cache, ps, 2)
    with pytest.raises(ValueError, match=r"already holds tokens .* call cache.reset\(\)"):
        generate(model, cache, ps, 2)
    cache.reset()
    right = torch.tensor([ps[0] + [0] * (len(ps[1]) - len(ps[0])), ps[1]])
    mask = (torch.arange(right.shape[1])[None] < torch.tensor([len(ps[0]), len(ps[1])])[:, None]).long()
    with pytest.raises(ValueError, match="needs left-padded prompts"):
        model.generate(right, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.get_seq_length() == 0  # a refused prompt wrote nothing
    with pytest.raises(ValueError, match=r"prompt of 70 tokens leaves no room in max_cache_len \(64\)"):
        model.generate(torch.ones(1, 70, dtype=torch.long), past_key_values=cache, max_new_tokens=2)
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(torch.tensor([ps[0]]), past_key_values=cache, max_new_tokens=2, num_beams=2)


def family_model(model_type: str, device: str, dtype: torch.dtype):
    """A FAMILIES config (windows shorter than the prompts, soft-caps, sinks that matter) on mmha."""
    model = mmha_model(model_type, device, dtype, **FAMILIES[model_type])
    if model_type == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2.0)
    return model


def own_attention(model_type: str) -> str:
    """The attention transformers' own generate() runs the family with (gpt-oss has no SDPA path)."""
    return "eager" if model_type == "gpt_oss" else "sdpa"


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_cpu_windows_softcaps_and_sinks_match_generate(model_type):
    """Mistral (a sliding window), Gemma 2 (alternating windows, attention and final soft-caps) and
    gpt-oss (sinks, alternating windows, MoE) through MmhaCache: each layer's spec carries its
    modifiers (the prompt through the model's own eager attention, decode steps through mmha), and
    a left-padded ragged batch gives each prompt's own greedy tokens."""
    model = family_model(model_type, "cpu", torch.float32)
    ps = prompts(model.config.vocab_size)
    cache = MmhaCache(model, 6, max(PROMPT_LENGTHS) + 17)
    specs = cache.kv.attention
    assert specs[0].window == 8 and (model_type == "mistral" or specs[1].window is None)
    assert (specs[0].softcap == 20.0) == (model_type == "gemma2")
    assert (specs[0].sinks is not None) == (model_type == "gpt_oss")
    got = generate(model, cache, ps, 16)
    model.set_attn_implementation(own_attention(model_type))
    assert got == [hf_greedy(model, p, 16) for p in ps]


@gpu
@pytest.mark.parametrize("compiled", [True, False])
def test_gpu_ragged_batch_matches_generate(compiled):
    """fp32 on the kernel, compiled by transformers (torch.compile + CUDA graphs, its default for
    a compileable cache) and eagerly (disable_compile): transformers' own greedy tokens."""
    model = mmha_model("llama", "cuda", torch.float32)
    ps = prompts(model.config.vocab_size)
    cache = MmhaCache(model, 4, 1024)
    got = generate(model, cache, ps, 40, disable_compile=not compiled)
    model.set_attn_implementation("sdpa")
    for r, p in enumerate(ps):
        assert got[r] == hf_greedy(model, p, 40), f"row {r}"
    cache.kv.check()


@gpu
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_gpu_windows_softcaps_and_sinks_match_generate(model_type):
    """The same families on the kernel, fp32: transformers' own greedy tokens (eager steps for
    gpt-oss, whose mixture of experts transformers does not compile)."""
    model = family_model(model_type, "cuda", torch.float32)
    ps = prompts(model.config.vocab_size)
    cache = MmhaCache(model, 4, 256)
    got = generate(model, cache, ps, 32, disable_compile=model_type == "gpt_oss")
    model.set_attn_implementation(own_attention(model_type))
    for r, p in enumerate(ps):
        assert got[r] == hf_greedy(model, p, 32), f"row {r}"
    cache.kv.check()


def native_family_model(model_type: str, device: str, dtype: torch.dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mmha_model(model_type, device, dtype, **MORE_FAMILIES[model_type])


def check_native_family(model, cache: MmhaCache, new_tokens: int, **kw) -> None:
    """A left-padded ragged batch through MmhaCache gives each prompt transformers' own greedy
    tokens (its SDPA attention); each layer's spec holds the module's scale and window."""
    config = model.config
    for i, (spec, module) in enumerate(zip(cache.kv.attention, attention_modules(model), strict=True)):
        assert spec.scale == float(module.scaling)
        sliding = (
            getattr(config, "layer_types", None) is not None and config.layer_types[i] == "sliding_attention"
        )
        window = config.sliding_window if (sliding or config.model_type == "starcoder2") else None
        assert spec.window == window, f"layer {i}"
    ps = prompts(config.vocab_size)
    got = generate(model, cache, ps, new_tokens, **kw)
    model.set_attn_implementation("sdpa")
    for r, p in enumerate(ps):
        assert got[r] == hf_greedy(model, p, new_tokens), f"row {r} (prompt length {len(p)})"


@pytest.mark.parametrize("model_type", list(MORE_FAMILIES))
def test_cpu_families_match_generate(model_type):
    model = native_family_model(model_type, "cpu", torch.float32)
    check_native_family(model, MmhaCache(model, 6, max(PROMPT_LENGTHS) + 17), 16)


def test_refuses_what_it_would_get_wrong():
    """Phi-3's generate drops the cache past longrope's switch point (to recompute every key): a
    cache that reaches past it is refused. Without an MmhaCache the "mmha" attention is plain SDPA
    with no padding mask: a padded prompt is refused, an unpadded one runs."""
    phi3 = native_family_model("phi3", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"original_max_position_embeddings \(80\).*must be at most 80"):
        MmhaCache(phi3, 2, 81)
    MmhaCache(phi3, 2, 80)
    model = mmha_model("llama", "cpu", torch.float32)
    ps = prompts(model.config.vocab_size)[:2]
    ids, mask = left_padded(ps, "cpu")
    with pytest.raises(ValueError, match="without an MmhaCache .* this prompt is padded"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    out = model.generate(ids[1:], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    model.set_attn_implementation("sdpa")
    assert out[0, ids.shape[1] :].tolist() == hf_greedy(model, ps[1], 3)


@gpu
@pytest.mark.parametrize("model_type", list(MORE_FAMILIES))
def test_gpu_families_match_generate(model_type):
    """The same families on the kernel in fp32, compiled by transformers (CUDA graphs)."""
    model = native_family_model(model_type, "cuda", torch.float32)
    cache = MmhaCache(model, 4, 80)
    check_native_family(model, cache, 32)
    cache.kv.check()


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_16bit_no_decisive_mismatch(dtype):
    model = mmha_model("llama", "cuda", dtype)
    ps = prompts(model.config.vocab_size)
    got = generate(model, MmhaCache(model, 4, 256), ps, 64)
    model.set_attn_implementation("sdpa")
    for p, ours in zip(ps, got, strict=True):
        check_no_decisive_mismatch(model, p, ours, hf_greedy(model, p, 64))


@gpu
def test_gpu_fp8_cache_teacher_forced():
    """An fp8 MmhaCache against a 16-bit one, both fed the 16-bit run's greedy tokens through
    transformers' forward: no step where the 16-bit pick beats the fp8 one by more than twice the
    row's largest logit difference."""
    model = mmha_model("llama", "cuda", torch.float16)
    ps = prompts(model.config.vocab_size)
    ids, mask = left_padded(ps, "cuda")
    caches = [MmhaCache(model, 4, 256), MmhaCache(model, 4, 256, kv_dtype=torch.float8_e4m3fn)]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = [model(ids, position_ids=pos, past_key_values=c).logits[:, -1].float() for c in caches]
        nxt = pos[:, -1:] + 1
        decisive = 0
        for _ in range(64):
            tok = logits[0].argmax(-1, keepdim=True)
            d = (logits[0] - logits[1]).abs().amax(-1)
            a, b = logits[0].argmax(-1), logits[1].argmax(-1)
            rows = (a != b).nonzero().flatten()
            margin = logits[0][rows, a[rows]] - logits[0][rows, b[rows]]
            decisive += int((margin > 2 * d[rows]).sum())
            logits = [model(tok, position_ids=nxt, past_key_values=c).logits[:, -1].float() for c in caches]
            nxt = nxt + 1
    assert decisive == 0
    for c in caches:
        c.kv.check()


@gpu
def test_gpu_guard_flags_reach_the_cache_check():
    """A row whose device length left the cache (changed behind its back) is refused by the
    kernel's guard; the cache's check() reports it."""
    from mmha.ops import LengthError

    model = mmha_model("llama", "cuda", torch.float32)
    ps = prompts(model.config.vocab_size)[:2]
    cache = MmhaCache(model, 2, 64)
    generate(model, cache, ps, 2, disable_compile=True)
    cache.kv.lengths[0] = cache.kv.capacity
    with torch.no_grad():
        out = model(torch.ones(2, 1, dtype=torch.long, device="cuda"), past_key_values=cache).logits
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()
    with pytest.raises(LengthError, match=r"rows \[0\]"):
        cache.kv.check()
