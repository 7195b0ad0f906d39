"""Generation with mmha agrees with reference decoding (RELIABILITY.md row 25)."""

from __future__ import annotations

import pytest
import torch
from helpers import gpu

from mmha.models.generate import Request, agree, generate, random_prompts
from mmha.models.llama import PRESETS, ModelConfig, TinyLlama

pytestmark = pytest.mark.usefixtures("no_reference_warning")


def test_cpu_reference_path_agrees_and_batches_continuously():
    model = TinyLlama(PRESETS["tiny"], seed=1).eval()
    prompts = random_prompts(5, [3, 9, 6], model.cfg.vocab_size, seed=2)
    a = agree(model, prompts[:3], 8)
    assert a["first_mismatch"] is None and a["identical_steps"] == 8
    reqs = [Request(p, n) for p, n in zip(prompts, [4, 7, 2, 5, 3], strict=True)]
    res = generate(model, reqs, batch=2, max_seq_len=20)
    assert [len(r.output) for r in reqs] == [4, 7, 2, 5, 3]
    # Each request's greedy output does not depend on who shared the batch with it.
    for r in reqs:
        solo = Request(r.prompt, len(r.output))
        generate(model, [solo], batch=1, max_seq_len=20)
        assert solo.output == r.output
    assert res.tokens == sum(len(r.output) - 1 for r in reqs)


def test_sampling_is_seeded():
    model = TinyLlama(PRESETS["tiny"], seed=1).eval()
    prompts = random_prompts(2, [4], model.cfg.vocab_size, seed=3)
    outs = []
    for _ in range(2):
        reqs = [Request(p, 6) for p in prompts]
        generate(model, reqs, 2, 16, temperature=0.8, top_k=20, seed=7)
        outs.append([r.output for r in reqs])
    assert outs[0] == outs[1]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gpu_greedy_tokens_identical_to_reference(dtype, graph):
    model = TinyLlama(PRESETS["small"], seed=0).to("cuda", dtype).eval()
    prompts = random_prompts(4, [17, 100, 250, 31], model.cfg.vocab_size, seed=0)
    a = agree(model, prompts, 256, graph=graph)
    print(a)
    assert a["first_mismatch"] is None, a
    # The rest are near-ties within rounding noise (bf16 has 8x the rounding of fp16).
    assert a["identical_steps"] >= (0.95 if dtype == torch.float16 else 0.85) * 256, a
    assert a["max_logit_abs_err"] < 0.5, a


@gpu
def test_gpu_qkv_bias_model_and_graph_generation_match_eager():
    cfg = ModelConfig(vocab_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, ffn_dim=512,
                      qkv_bias=True)  # fmt: skip
    model = TinyLlama(cfg, seed=3).to("cuda", torch.float16).eval()
    prompts = random_prompts(6, [5, 40, 90], cfg.vocab_size, seed=1)
    a = agree(model, prompts[:4], 64)
    print(a)
    assert a["first_mismatch"] is None, a
    runs = []
    for graph in (False, True):
        reqs = [Request(p, n) for p, n in zip(prompts, [30, 12, 25, 8, 20, 16], strict=True)]
        generate(model, reqs, batch=3, max_seq_len=160, graph=graph)
        runs.append([r.output for r in reqs])
    assert runs[0] == runs[1]


def test_cpu_fp8_cache_generates_and_batches_continuously():
    model = TinyLlama(PRESETS["tiny"], seed=1).to(torch.bfloat16).eval()
    prompts = random_prompts(4, [3, 9, 6], model.cfg.vocab_size, seed=2)
    reqs = [Request(p, n) for p, n in zip(prompts, [4, 6, 2, 5], strict=True)]
    generate(model, reqs, batch=2, max_seq_len=20, kv_dtype=torch.float8_e4m3fn)
    assert [len(r.output) for r in reqs] == [4, 6, 2, 5]
    a = agree(model, prompts[:2], 8, kv_dtype=torch.float8_e4m3fn)
    assert a["kv_dtype"] == "float8_e4m3fn" and a["first_mismatch"] is None, a


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gpu_fp8_cache_no_decisive_mismatch(dtype, graph):
    """fp8 caches against reference decoding with unquantised K/V: every differing pick is
    within twice the step's logit difference (RELIABILITY.md's near-tie rule)."""
    model = TinyLlama(PRESETS["small"], seed=0).to("cuda", dtype).eval()
    prompts = random_prompts(4, [17, 100, 250, 31], model.cfg.vocab_size, seed=0)
    a = agree(model, prompts, 256, graph=graph, kv_dtype=torch.float8_e4m3fn)
    print(a)
    assert a["first_mismatch"] is None, a


def test_cpu_paged_cache_batches_continuously_like_the_contiguous_one():
    """Requests of very different lengths through a paged cache (rows admitted and released as
    they finish) give the contiguous cache's tokens."""
    model = TinyLlama(PRESETS["tiny"], seed=1).eval()
    prompts = random_prompts(6, [3, 40, 9, 70], model.cfg.vocab_size, seed=4)
    budgets = [20, 3, 35, 8, 12, 5]
    runs = []
    for paged in (False, True):
        reqs = [Request(p, n) for p, n in zip(prompts, budgets, strict=True)]
        generate(model, reqs, batch=3, max_seq_len=110, paged=paged, block_size=16)
        runs.append([r.output for r in reqs])
    assert runs[0] == runs[1]


def test_speculative_demo_reports_where_paths_part_and_fails_only_in_fp32():
    from mmha.models.generate import first_difference, speculative_status

    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_difference([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == (1, 1)
    assert first_difference([[1, 2]], [[1, 2, 3]]) == (0, 2)
    assert speculative_status(True, torch.float32) == 0
    assert speculative_status(False, torch.float32) == 1
    assert speculative_status(False, torch.float16) == 0
    assert speculative_status(False, torch.bfloat16) == 0


def test_cpu_speculative_demo_is_lossless():
    """The demo model drafting with its own first layer (trees of several shapes): the tokens of
    plain greedy decoding."""
    from mmha.models.generate import speculative_demo

    model = TinyLlama(PRESETS["tiny"], seed=1).eval()
    prompts = random_prompts(3, [3, 9, 6], model.cfg.vocab_size, seed=2)
    for shape in ([2, 2, 1], [1, 1], [4]):
        a = speculative_demo(model, prompts, 12, 1, shape)
        assert a["identical"], (shape, a)
        assert a["parted"] is None
        assert a["mean_accepted"] >= 1
