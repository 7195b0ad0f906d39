"""mmha.models.hf_attention: ``attn_implementation="mmha"`` with ``MmhaCache`` inside transformers'
own ``generate`` (random-init models from configs, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from helpers import HAS_GPU

transformers = pytest.importorskip("transformers")

from test_hf import check_no_decisive_mismatch  # noqa: E402

from mmha.bench.families import (  # noqa: E402
    FAMILIES,
    PROMPT_LENGTHS,
    build,
    build_family,
    check_family,
    hf_greedy,
    left_padded,
    prompts,
)
from mmha.bench.families import native_generate as generate  # noqa: E402
from mmha.hf import MmhaCache  # noqa: E402
from mmha.models.hf_layers import attention_modules  # noqa: E402

gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
pytestmark = pytest.mark.usefixtures("no_reference_warning")


def mmha_model(model_type: str, device: str, dtype: torch.dtype, **over):
    model = build(model_type, device, dtype, **over)
    model.set_attn_implementation("mmha")
    return model


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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cpu_specs_hold_each_layers_attention(family):
    """Each layer's spec: the module's scale, its window (where the layer slides), the config's
    attention soft-cap, the module's sinks."""
    model = build_family(family, "cpu", torch.float32)
    model.set_attn_implementation("mmha")
    config = model.config
    cache = MmhaCache(model, 2, 64)
    for i, (spec, module) in enumerate(zip(cache.kv.attention, attention_modules(model), strict=True)):
        assert spec.scale == float(module.scaling)
        types = getattr(config, "layer_types", None)
        sliding = config.model_type in ("mistral", "starcoder2") or (
            types is not None and types[i] == "sliding_attention"
        )
        assert spec.window == (config.sliding_window if sliding else None), f"layer {i}"
        assert spec.softcap == getattr(config, "attn_logit_softcapping", None)
        sinks = getattr(module, "sinks", None)
        assert (spec.sinks is None) == (sinks is None)
        assert sinks is None or torch.equal(spec.sinks, sinks.float())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cpu_families_match_generate(family):
    """Every family through MmhaCache in transformers' generate (prompts through transformers'
    attention or the model's own eager attention where a layer has modifiers, steps through
    mmha): a left-padded ragged batch gives each prompt transformers' own greedy tokens (fp32)."""
    row = check_family(family, "native", "cpu")
    assert row["refused"] is None and row["tokens_equal"], row


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


def test_refuses_what_it_would_get_wrong():
    """Phi-3's generate drops the cache past longrope's switch point (to recompute every key): a
    cache that reaches past it is refused. Attention no spec describes (multi-head latent attention,
    Llama 4's chunked layers) is refused, named. Without an MmhaCache the "mmha" attention is plain SDPA
    with no padding mask: a padded prompt is refused, an unpadded one runs."""
    phi3 = build_family("phi3", "cpu", torch.float32)
    phi3.set_attn_implementation("mmha")
    with pytest.raises(ValueError, match=r"original_max_position_embeddings \(80\).*must be at most 80"):
        MmhaCache(phi3, 2, 81)
    MmhaCache(phi3, 2, 80)
    small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)  # fmt: skip
    mla = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)  # fmt: skip
    for config, match in (
        (transformers.DeepseekV3Config(**small, **mla), r"config.qk_head_dim \(24\) differs from head_dim \(8\)"),
        (transformers.Llama4TextConfig(**small, head_dim=32, intermediate_size_mlp=64, num_local_experts=2),
         r"config.layer_types holds \['chunked_attention'\]"),
    ):  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.set_attn_implementation("mmha")
        with pytest.raises(ValueError, match=match):
            MmhaCache(model, 2, 64)
    model = mmha_model("llama", "cpu", torch.float32)
    ps = prompts(model.config.vocab_size)[:2]
    ids, mask = left_padded(ps, "cpu")
    with pytest.raises(ValueError, match="without an MmhaCache .* this prompt is padded"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    out = model.generate(ids[1:], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    model.set_attn_implementation("sdpa")
    assert out[0, ids.shape[1] :].tolist() == hf_greedy(model, ps[1], 3)


@gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_families_match_generate(family):
    """The same on the kernel in fp32, compiled by transformers (CUDA graphs; eager steps for
    gpt-oss, whose mixture of experts transformers does not compile)."""
    row = check_family(family, "native", "cuda", new_tokens=32)
    assert row["refused"] is None and row["tokens_equal"], row


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
    _teacher_forced("cuda", torch.float16, torch.float8_e4m3fn, 64)


@gpu
def test_gpu_int8_cache_teacher_forced():
    """An int8 MmhaCache on the kernel against a 16-bit one, the same way."""
    _teacher_forced("cuda", torch.float16, torch.int8, 64)


@gpu
def test_gpu_int4_cache_teacher_forced():
    """An int4 MmhaCache on the kernel against a 16-bit one, the same way."""
    _teacher_forced("cuda", torch.float16, "int4", 64)


def test_int8_cache_teacher_forced_on_the_cpu():
    """The same with an int8 MmhaCache (per-token scales; the reference path) against an fp32 one."""
    _teacher_forced("cpu", torch.float32, torch.int8, 16)


def test_int4_cache_teacher_forced_on_the_cpu():
    """The same with an int4 MmhaCache (mmha.int4; the reference path) against an fp32 one."""
    _teacher_forced("cpu", torch.float32, "int4", 16)


def _teacher_forced(device, dtype, kv_dtype, steps: int) -> None:
    model = mmha_model("llama", device, dtype)
    ps = prompts(model.config.vocab_size)
    ids, mask = left_padded(ps, device)
    caches = [MmhaCache(model, 4, 256), MmhaCache(model, 4, 256, kv_dtype=kv_dtype)]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = [model(ids, position_ids=pos, past_key_values=c).logits[:, -1].float() for c in caches]
        nxt = pos[:, -1:] + 1
        decisive = 0
        for _ in range(steps):
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_dynamic_ntk_past_its_switch_matches_the_batch(device):
    """Dynamic NTK past max_position_embeddings (48) on this route: transformers rotates q and k
    (its table follows the batch's longest sequence), so a left-padded ragged batch through the
    "mmha" attention and MmhaCache equals the same batch through transformers' own attention and
    cache, token for token (fp32; eager steps: the table changes with the length)."""
    from mmha.models.hf_layers import reset_rotary_state

    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    model = build("llama", device, torch.float32, rope_parameters=dynamic, max_position_embeddings=48)
    ps = prompts(model.config.vocab_size)
    model.set_attn_implementation("eager")
    reset_rotary_state(model.model)
    theirs = generate(model, None, ps, 64, disable_compile=True)
    model.set_attn_implementation("mmha")
    reset_rotary_state(model.model)
    ours = generate(model, MmhaCache(model, len(ps), max(map(len, ps)) + 65), ps, 64, disable_compile=True)
    assert ours == theirs
