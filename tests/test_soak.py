"""The soak (tests/soak.py): continuous batching on a paged cache, short on the CPU (CI) and long
on a GPU (``MMHA_SOAK_STEPS`` steps, 2000 by default)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import gpu
from soak import Soak, SoakConfig

FP8 = torch.float8_e4m3fn

pytestmark = pytest.mark.usefixtures("no_reference_warning")


@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("scenario", ["modifiers", "speculative"])
def test_cpu_soak(scenario, kv_dtype):
    cfg = SoakConfig(scenario=scenario, kv_dtype=kv_dtype, steps=100, seed=1 if kv_dtype else 0)
    stats = Soak(cfg, "cpu").run()
    assert stats["steps"] > 20 and stats["admitted"] > 4 and stats["released"] > 2
    assert stats["forked"] > 0 and stats["checked"] > 5
    if scenario == "speculative":
        assert stats["tree_rounds"] > 10


@gpu
@pytest.mark.parametrize(
    "dtype, kv_dtype", [(torch.float16, None), (torch.bfloat16, FP8)], ids=["fp16", "bf16-fp8"]
)
@pytest.mark.parametrize("scenario", ["modifiers", "speculative"])
def test_gpu_soak(scenario, dtype, kv_dtype):
    steps = int(os.environ.get("MMHA_SOAK_STEPS", "2000"))
    cfg = SoakConfig(
        scenario=scenario, dtype=dtype, kv_dtype=kv_dtype, steps=steps, max_batch=8, num_heads=8,
        num_kv_heads=2, head_dim=128, max_seq_len=400, block_size=16, check_every=25, seed=3,
    )  # fmt: skip
    stats = Soak(cfg, "cuda").run()
    assert stats["steps"] > steps // 3 and stats["forked"] > 0 and stats["checked"] > 20
