"""mmha.hf: a Hugging Face Llama-family model (random weights from a config, nothing downloaded)
decoded through mmha gives the tokens of the model's own greedy ``generate()``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import HAS_GPU, gpu

transformers = pytest.importorskip("transformers")

from mmha.bench.families import (  # noqa: E402
    FAMILIES,
    PROMPT_LENGTHS,
    ROPE_VARIANTS,
    build,
    check_family,
    hf_greedy,
    prompts,
)
from mmha.hf import HFDecoder  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def check_no_decisive_mismatch(model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """16-bit runs may part at a near-tie: at the first difference, the fp32 model's margin of
    transformers' pick over ours must be within twice transformers' own 16-bit logit error there."""
    t = first_difference(ours, theirs)
    if t is None:
        assert len(ours) == len(theirs)
        return
    ids = torch.tensor([prompt + theirs[:t]], device=next(model.parameters()).device)
    with torch.no_grad():
        low = model(ids).logits[0, -1].float()
        model32 = copy.deepcopy(model).float()
        ref = model32(ids).logits[0, -1]
    err = float((low - ref).abs().max())
    margin = float(ref[theirs[t]] - ref[ours[t]])
    assert margin <= 2 * err, f"token {t}: fp32 margin {margin:.4g} > 2 x fp16 logit error {err:.4g}"


def check_matches_generate(model, new_tokens: int, **kw):
    ps = prompts(model.config.vocab_size)
    dec = HFDecoder(model, max_batch=len(ps), max_seq_len=max(PROMPT_LENGTHS) + new_tokens + 1, **kw)
    ours = dec.generate(ps, new_tokens)
    theirs = [hf_greedy(model, p, new_tokens) for p in ps]
    for r, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"row {r} (prompt length {len(ps[r])}): first difference at token " + str(
            next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        )


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_cpu_reference_path_matches_generate(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # KVCache on CPU: reference path
        check_matches_generate(build(model_type, "cpu", torch.float32), new_tokens=12)


@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_paged_cache_matches_generate(block_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        check_matches_generate(
            build("llama", "cpu", torch.float32), new_tokens=20, paged=True, block_size=block_size
        )


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_paged_cache_matches_generate(block_size):
    check_matches_generate(
        build("llama", "cuda", torch.float32), new_tokens=40, paged=True, block_size=block_size
    )


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gpu_kernel_matches_generate(model_type):
    check_matches_generate(build(model_type, "cuda", torch.float32), new_tokens=64)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
def test_gpu_mha_head_dim_128_other_theta():
    model = build("llama", "cuda", torch.float32, hidden_size=512, num_attention_heads=4,
                  num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 5e5})  # fmt: skip
    check_matches_generate(model, new_tokens=32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cpu_families_match_generate(family):
    """Every family through HFDecoder (the model's own layers around mmha's attention: windows,
    soft-caps, sinks, q/k norms, per-layer and partial / interleaved rotations, multipliers, MoE):
    fp32 greedy tokens of a ragged batch equal the model's own generate() of each prompt."""
    row = check_family(family, "graphs", "cpu")
    assert row["refused"] is None and row["tokens_equal"], str(row)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_families_match_generate(family):
    """The same on the kernel, each decode step a CUDA graph (eager steps for gpt-oss's experts)."""
    row = check_family(family, "graphs", "cuda", new_tokens=32)
    assert row["refused"] is None and row["tokens_equal"], str(row)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("route", ["graphs", "native"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "phi3"])  # phi3: longrope's switch at 80
def test_gpu_families_on_a_split_plan(family, route):
    """A cache of 16K tokens: the capacity plan splits each row's sequence (FlashDecoding
    partials merged) for the same fp32 tokens, on both routes."""
    from mmha.bench.families import build_family
    from mmha.cache import KVCache

    model = build_family(family, "cuda", torch.float32)
    config = model.config
    plan = KVCache(1, 4, 16384, config.num_attention_heads, config.num_key_value_heads,
                   getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   torch.float32, "cuda", dispatch_on="capacity").plan(4)  # fmt: skip
    assert plan.num_splits > 1
    row = check_family(family, route, "cuda", new_tokens=24, capacity=16384)
    assert row["refused"] is None and row["tokens_equal"], str(row)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("route", ["graphs", "native"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_families_16bit_no_decisive_mismatch(family, route, dtype):
    from mmha.bench.families import build_family, route_tokens, transformers_tokens

    model = build_family(family, "cuda", dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = route_tokens(model, route, 32)
        theirs = transformers_tokens(model, 32)
    for p, a, b in zip(prompts(model.config.vocab_size), ours, theirs, strict=True):
        check_no_decisive_mismatch(model, p, a, b)


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_cpu_rotary_variants_match_generate(model_type, variant):
    """Llama 3.x's and Qwen 2.5's rotary scalings (and linear): each layer's spec takes the
    model's own frequency table and attention factor; greedy tokens equal generate() in fp32."""
    model = build(model_type, "cpu", torch.float32, rope_parameters=ROPE_VARIANTS[variant])
    dec = HFDecoder(model, 4, 128)
    rotary = dec.cache.attention[0].rotary
    assert torch.equal(rotary.inv_freq, model.model.rotary_emb.inv_freq.float())
    assert rotary.attention_factor == model.model.rotary_emb.attention_scaling
    assert variant != "yarn" or rotary.attention_factor > 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        check_matches_generate(model, new_tokens=24)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_gpu_rotary_variants_match_generate(variant):
    """The kernel's table path (CUDA graphs, capacity plans): fp32 tokens of generate()."""
    model = build("llama", "cuda", torch.float32, rope_parameters=ROPE_VARIANTS[variant])
    check_matches_generate(model, new_tokens=48)


def full_forward_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens with the model's forward over the whole sequence at every step (no cache):
    each step's every key rotated by the frequencies of the sequence's length."""
    dev = next(model.parameters()).device
    ids = list(prompt)
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], device=dev), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_dynamic_ntk_past_its_switch_matches_generate(device):
    """Dynamic NTK scaling past max_position_embeddings (48): each step's q and new k rotated by
    the frequencies transformers computes for the sequence's length (a table row per length);
    fp32 tokens equal generate()'s, from a fresh rotary state per prompt (transformers' keeps
    the longest length it has seen across calls)."""
    from mmha.models.hf_layers import reset_rotary_state

    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    model = build("llama", device, torch.float32, rope_parameters=dynamic, max_position_embeddings=48)
    ps = prompts(model.config.vocab_size)
    dec = HFDecoder(model, len(ps), 112)
    assert dec.rope_switch == 48 and not dec.recompute_at_switch
    ours = dec.generate(ps, 64, eos_token_id=[])
    for p, got in zip(ps, ours, strict=True):
        reset_rotary_state(model.model)
        assert got == hf_greedy(model, p, 64), f"prompt of {len(p)}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_longrope_past_its_switch_recomputes_the_sequence(device):
    """Phi-3's longrope past original_max_position_embeddings (80): when a row first passes it,
    its K/V are recomputed by the model's forward over the whole sequence with the long factors
    (what transformers' generate means to do there: Phi3's prepare_inputs_for_generation drops
    the cache), then steps go on with the long factors. fp32 tokens equal greedy decoding by the
    model's forward over the whole sequence at every step. (transformers 5.17's generate itself,
    having dropped the cache, goes on from the last token alone.)"""
    from mmha.bench.families import build_family

    model = build_family("phi3", device, torch.float32)
    ps = prompts(model.config.vocab_size)
    dec = HFDecoder(model, len(ps), 112)
    assert dec.rope_switch == 80 and dec.recompute_at_switch
    ours = dec.generate(ps, 70, eos_token_id=[])
    for p, got in zip(ps, ours, strict=True):
        assert got == full_forward_greedy(model, p, 70), f"prompt of {len(p)}"


def tiny(config_class: str, **kw):
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kw))


def test_rejects_what_the_kernel_does_not_compute():
    """Refused by what the attention computes, each naming it: attention parts mmha does not know
    (multi-head latent attention, Llama 4's L2 q/k norm), a q/k norm of another shape, a model
    without decoder layers' self_attn, an output head that does more than mmha knows."""
    small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)  # fmt: skip
    mla = tiny("DeepseekV3Config", **small, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
               kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)  # fmt: skip
    llama4 = tiny("Llama4TextConfig", **small, head_dim=32, intermediate_size_mlp=64, num_local_experts=2)
    for model, match in (
        (mla, r"DeepseekV3Attention\) has \['q_a_proj', .*'kv_b_proj'\], which mmha does not compute"),
        (llama4, r"Llama4TextAttention\) has \['qk_norm'\]"),
        (
            tiny("GPT2Config", n_layer=1, n_embd=64, n_head=2, vocab_size=64),
            "has no decoder layers with self_attn",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            HFDecoder(model, 2, 64)
    qwen3 = build("qwen3", "cpu", torch.float32)
    qwen3.model.layers[1].self_attn.k_norm = torch.nn.LayerNorm(7)
    with pytest.raises(ValueError, match=r"layer 1: k_norm has weight \(7,\)"):
        HFDecoder(qwen3, 2, 64)
    model = build("llama", "cpu", torch.float32)
    model.register_forward_hook(lambda m, args, out: out.__setitem__("logits", out.logits * 2) or out)
    with pytest.raises(ValueError, match="output head does more than lm_head"):
        HFDecoder(model, 2, 64)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_kv_teacher_forced_no_decisive_mismatch(dtype):
    """The adapter with an fp8 cache against the same model with a 16-bit cache, fed the same
    tokens for 256 steps: no step where the 16-bit top-1 wins by more than twice the logit
    difference."""
    from mmha.models.hf import compare_kv_dtypes

    model = build("llama", "cuda", dtype)
    res = compare_kv_dtypes(model, prompts(model.config.vocab_size), 256, torch.float8_e4m3fn)
    print(
        f"fp8 vs {dtype} KV, {res['rows']} rows x {res['steps']} steps: max |logit diff| "
        f"{res['max_logit_diff']:.3g} (logits up to {res['logit_scale']:.3g}), top-1 flips {res['top1_flips']}"
    )
    assert res["decisive_mismatches"] == 0


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_int8_kv_teacher_forced_no_decisive_mismatch(family):
    """HFDecoder with an int8 cache (per-token scales; the reference path, on the CPU) against the
    same model with an fp32 cache, fed the same tokens: no decisive mismatch."""
    from mmha.bench.families import build_family
    from mmha.models.hf import compare_kv_dtypes

    model = build_family(family, "cpu", torch.float32)
    res = compare_kv_dtypes(model, prompts(model.config.vocab_size), 24, torch.int8)
    assert res["decisive_mismatches"] == 0 and res["max_logit_diff"] < 0.1 * res["logit_scale"]


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_int4_kv_teacher_forced_no_decisive_mismatch(family):
    """The same with an int4 cache (mmha.int4; the reference path): a coarser format (the logits
    move by about a fifth of their scale on these random-weight models) but no decisive mismatch."""
    from mmha.bench.families import build_family
    from mmha.models.hf import compare_kv_dtypes

    model = build_family(family, "cpu", torch.float32)
    res = compare_kv_dtypes(model, prompts(model.config.vocab_size), 24, "int4")
    assert res["decisive_mismatches"] == 0 and res["max_logit_diff"] < 0.35 * res["logit_scale"]


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_int8_kv_teacher_forced_no_decisive_mismatch(dtype):
    """The same on the kernel: HFDecoder's CUDA graphs over an int8 cache against a 16-bit one."""
    from mmha.models.hf import compare_kv_dtypes

    model = build("llama", "cuda", dtype)
    res = compare_kv_dtypes(model, prompts(model.config.vocab_size), 128, torch.int8)
    assert res["decisive_mismatches"] == 0


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_int4_kv_teacher_forced_no_decisive_mismatch(dtype):
    """The same with an int4 cache on the kernel (HFDecoder's CUDA graphs; 128 steps, rows crossing
    K groups' ends) against a 16-bit one: as coarse as on the CPU, no decisive mismatch."""
    from mmha.models.hf import compare_kv_dtypes

    model = build("llama", "cuda", dtype)
    res = compare_kv_dtypes(model, prompts(model.config.vocab_size), 128, "int4")
    assert res["decisive_mismatches"] == 0 and res["max_logit_diff"] < 0.35 * res["logit_scale"]


class _AlwaysWrongDraft(HFDecoder):
    """A draft that never proposes its model's top token (with the target's own weights, it is
    always wrong)."""

    def step_tree(self, tokens, parents, node_counts=None):
        logits = super().step_tree(tokens, parents, node_counts)
        return logits.scatter(-1, logits.argmax(-1, keepdim=True), float("-inf"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_GPU, reason="needs a CUDA GPU and the built extension"))])  # fmt: skip
@pytest.mark.parametrize("draft_kind", ["same", "other", "wrong"])
@pytest.mark.parametrize(
    "shape",
    [(2, 2, 1), (1, 1, 1, 1), (3,), ((2, 2, 1), (1,), (3, 1), (1, 1, 1, 1))],
    ids=["2-2-1", "chain", "star", "ragged"],
)
def test_speculative_greedy_is_lossless(device, draft_kind, shape):
    """Speculative decoding with a draft equal to the target, a different random model, and a
    draft that is always wrong: the target's plain greedy tokens, token for token (fp32; on a GPU
    the tree steps and one-token steps run the kernels); "ragged": each row its own tree shape
    (node counts 11, 2, 7 and 5 in one step)."""
    target = build("llama", device, torch.float32)
    ps = prompts(target.config.vocab_size)
    new = 24
    seq = max(PROMPT_LENGTHS) + new + 40
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        plain = HFDecoder(target, len(ps), seq).generate(ps, new)
        if draft_kind == "other":
            torch.manual_seed(5)
            other = build("llama", device, torch.float32, num_hidden_layers=1)
            with torch.no_grad():
                for p in other.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
            draft = HFDecoder(other, len(ps), seq)
        elif draft_kind == "wrong":
            draft = _AlwaysWrongDraft(target, len(ps), seq)
        else:
            draft = HFDecoder(target, len(ps), seq)
        spec = HFDecoder(target, len(ps), seq).generate(ps, new, draft=draft, tree_shape=shape)
    assert spec == plain


# ---------------------------------------------------------------------- mmha's own loop: graphs, EOS


def test_buckets_and_prefill_groups():
    from mmha.models.hf import buckets

    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    dec = HFDecoder(build("llama", "cpu", torch.float32), 4, 64, prefill_tokens=64)
    assert dec._prefill_groups([5, 23, 11, 40]) == [[0, 1], [2], [3]]  # 2 x 23 <= 64 < 3 x 23


def test_rejects_bad_loop_settings():
    model = build("llama", "cpu", torch.float32)
    with pytest.raises(ValueError, match="graphs=True needs the model on a CUDA device"):
        HFDecoder(model, 2, 64, graphs=True)
    with pytest.raises(ValueError, match=r"prefill_tokens must be a positive int, got 0"):
        HFDecoder(model, 2, 64, prefill_tokens=0)
    dec = HFDecoder(model, 2, 64)
    with pytest.raises(ValueError, match=r"sync_every must be an int in \[1, 64\], got 65"):
        dec.generate([[1, 2]], 4, sync_every=65)
    with pytest.raises(ValueError, match="eos_token_id may name at most 8 ids"):
        dec.generate([[1, 2]], 4, eos_token_id=list(range(9)))


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
def test_gpu_a_step_no_graph_can_capture_is_named_and_the_process_goes_on():
    """A decode step a CUDA graph cannot capture (here an output head that reads a value to the
    host) raises the error that names graphs=False, and the process goes on: a failed capture left
    torch's CUDA generator in capture mode (every later random op failing) until HFDecoder gave it
    a fresh state, and the same model then decodes without graphs as transformers' generate does."""
    model = build("llama", "cuda", torch.float32)
    ps = prompts(model.config.vocab_size)
    dec = HFDecoder(model, len(ps), max(PROMPT_LENGTHS) + 17)
    assert dec.graphs
    head = dec.head

    def head_reading_the_host(h: torch.Tensor) -> torch.Tensor:
        float(h.float().sum())  # a device-to-host read: not capturable
        return head(h)

    dec.head = head_reading_the_host
    with pytest.raises(RuntimeError, match=r"could not be captured in a CUDA graph.*graphs=False"):
        dec.generate(ps, 16)
    assert torch.isfinite(torch.randn(1024, device="cuda")).all()
    check_matches_generate(model, new_tokens=16, graphs=False)


def check_eos_mid_batch(device: str, **kw) -> None:
    """A row that meets its end-of-sequence token stops there (the token kept) while the others go
    on: per row, transformers' own greedy tokens up to that token."""
    model = build("llama", device, torch.float32, vocab_size=64)
    ps = prompts(64)
    dec = HFDecoder(model, len(ps) + 2, max(PROMPT_LENGTHS) + 41, **kw)
    plain = dec.generate(ps, 40, eos_token_id=[])
    eos = next(t for t in plain[1][2:] if t not in plain[0])  # row 1 stops early, row 0 never
    got = dec.generate(ps, 40, eos_token_id=[eos, 63], sync_every=5)
    assert len(got[1]) < 40 and len(got[0]) == 40
    hf = []
    for p in ps:
        ids = torch.tensor([p], device=device)
        out = model.generate(
            ids, max_new_tokens=40, do_sample=False, eos_token_id=[eos, 63], pad_token_id=eos
        )
        hf.append(out[0, len(p) :].tolist())
    assert got == hf


def test_cpu_eos_in_the_middle_of_a_batch(no_reference_warning):
    check_eos_mid_batch("cpu")


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_eos_in_the_middle_of_a_batch(graphs):
    check_eos_mid_batch("cuda", graphs=graphs)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("max_seq_len", [160, 8192])
def test_gpu_graphs_match_generate_as_lengths_grow(max_seq_len):
    """Graph replays while rows grow across tiles and (long capacity: a split plan) across the
    lengths where a length dispatch would change variant; two buckets (4 and 2 rows) share the
    workspace. fp32: transformers' own tokens."""
    model = build("llama", "cuda", torch.float32)
    ps = prompts(model.config.vocab_size)
    dec = HFDecoder(model, 6, max_seq_len)
    assert dec.graphs and dec.cache.dispatch_on == "capacity"
    new = 110
    got = dec.generate(ps, new, eos_token_id=[])
    assert sorted(dec._graphs) == [4]
    for r, p in enumerate(ps):
        assert got[r] == hf_greedy(model, p, new), f"row {r}"
    assert dec.generate(ps[:2], 30, eos_token_id=[]) == [g[:30] for g in got[:2]]
    assert sorted(dec._graphs) == [2, 4]
    dec.cache.check()


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
def test_gpu_graph_steps_do_not_synchronise():
    """Between the host's reads (every sync_every steps) the decode loop issues no synchronising
    call: 59 steps and 2 steps, each read once, synchronise equally often."""
    model = build("llama", "cuda", torch.float16)
    ps = prompts(model.config.vocab_size)
    dec = HFDecoder(model, 4, 128)
    dec.generate(ps, 4, eos_token_id=[])  # captures the graph

    def syncs(new: int) -> int:
        dec.cache.release(range(4))
        first = dec.prefill(ps).argmax(-1)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                dec._decode(first, new, [], 64)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in seen)

    syncs(3)  # one-time work (first copies, allocator growth) out of the count
    few = syncs(3)
    assert syncs(60) == few > 0


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_graphs_16bit_no_decisive_mismatch(dtype):
    model = build("llama", "cuda", dtype)
    ps = prompts(model.config.vocab_size)
    got = HFDecoder(model, len(ps), max(PROMPT_LENGTHS) + 65).generate(ps, 64, eos_token_id=[])
    for p, ours in zip(ps, got, strict=True):
        check_no_decisive_mismatch(model, p, ours, hf_greedy(model, p, 64))


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the built extension")
def test_gpu_graphs_fp8_cache_equal_eager_steps():
    """fp8 caches in graphs: the tokens of the same plan run eagerly."""
    model = build("llama", "cuda", torch.float16)
    ps = prompts(model.config.vocab_size)
    kw = dict(kv_dtype=torch.float8_e4m3fn, dispatch_on="capacity")
    graphs = HFDecoder(model, len(ps), 256, graphs=True, **kw).generate(ps, 48, eos_token_id=[])
    eager = HFDecoder(model, len(ps), 256, graphs=False, **kw).generate(ps, 48, eos_token_id=[])
    assert graphs == eager


def test_decode_steps_build_no_mask(monkeypatch):
    """A decode step (one token and a tree) runs the model's forward with mmha's attention swapped
    in under an implementation without masks: transformers builds no mask and reads no positions
    for packed sequences (a host synchronisation outside graph capture)."""
    import transformers.masking_utils as masking

    model = build("llama", "cpu", torch.float32)
    dec = HFDecoder(model, 2, 64)
    dec.cache.release(range(2))
    dec.prefill(prompts(model.config.vocab_size)[:2])

    def refuse(*args, **kwargs):
        raise AssertionError("a mask was built for a decode step")

    for name in ("find_packed_sequence_indices", "sdpa_mask", "eager_mask"):
        monkeypatch.setattr(masking, name, refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert dec.step(torch.tensor([3, 4])).shape == (2, model.config.vocab_size)
        parents = torch.tensor([[-1, 0, 0], [-1, 0, 1]])
        assert dec.step_tree(torch.tensor([[1, 2, 3], [4, 5, 6]]), parents).shape == (
            2,
            3,
            model.config.vocab_size,
        )
    assert model.config._attn_implementation == "sdpa" and type(model.model.layers[0].self_attn).__name__ == (
        "LlamaAttention"
    )
