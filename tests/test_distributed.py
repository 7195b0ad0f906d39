"""mmha.distributed on CPUs: ranks spawned over gloo, the reference path on each (tests/distributed_cases.py
holds the scenarios); sharding and merge arithmetic in-process."""

import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from distributed_cases import run_ranks

from mmha import reference
from mmha.distributed import merge, sharding

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.parametrize("world,block", [(1, 16), (2, 16), (2, 1), (3, 4), (4, 64)])
def test_sequence_shards_partition_every_row(world, block):
    for length in (0, 1, block - 1, block, 3 * block + 1, 200):
        held = [sharding.local_positions(length, world, r, block) for r in range(world)]
        assert sorted(torch.cat(held).tolist()) == list(range(length))
        for r in range(world):
            assert held[r].numel() == sharding.local_length(length, world, r, block)
            assert all(sharding.owner(int(p), world, block) == r for p in held[r])
        if length:  # balanced to within one block
            sizes = [h.numel() for h in held]
            assert max(sizes) - min(sizes) <= block
    cap = sharding.local_capacity(200, world, block)
    assert cap == max(sharding.local_length(200, world, r, block) for r in range(world))


def test_head_range_refuses_uneven():
    assert sharding.head_range(8, 2, 1) == (4, 8)
    with pytest.raises(ValueError, match="divisible by the world size"):
        sharding.head_range(6, 4, 0)


def test_merge_partials_equals_attention_over_the_union():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(4, 50, 16, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(4, 50, 16, generator=gen, dtype=torch.float64)
    want, want_lse = reference.attend(q, k, v, 0.25)
    cuts = [0, 7, 7, 31, 50]  # one empty shard
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if a == b:
            outs.append(torch.zeros(4, 16, dtype=torch.float64))
            lses.append(torch.full((4,), float("-inf"), dtype=torch.float64))
        else:
            o, lse = reference.attend(q, k[:, a:b], v[:, a:b], 0.25)
            outs.append(o)
            lses.append(lse)
    out, lse = merge.merge_partials(torch.stack(outs)[:, None], torch.stack(lses)[:, None])
    torch.testing.assert_close(out[0].double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[0].double(), want_lse, atol=1e-6, rtol=1e-6)
    # every shard empty: zeros and -inf; a sink then gives zeros and the sink
    out, lse = merge.merge_partials(torch.zeros(2, 1, 3, 4), torch.full((2, 1, 3), float("-inf")))
    assert torch.equal(out, torch.zeros(1, 3, 4)) and torch.isinf(lse).all()
    out, lse = merge.merge_partials(
        torch.zeros(2, 1, 3, 4), torch.full((2, 1, 3), float("-inf")), torch.tensor([1.0, 2.0, 3.0])
    )
    assert torch.equal(out, torch.zeros(1, 3, 4)) and lse.tolist() == [[1.0, 2.0, 3.0]]


# Each configuration's ranks against the single cache, by world size: name -> (world, kwargs).
DECODE_CONFIGS = {
    "seq": (2, dict(mode="sequence")),
    "seq-block1": (2, dict(mode="sequence", block=1)),
    "seq-world3": (3, dict(mode="sequence", block=8)),
    "seq-heads-out-mods": (2, dict(mode="sequence", output="heads", mods=True)),
    "seq-fp8": (2, dict(mode="sequence", dtype=torch.float16, kv_dtype=torch.float8_e4m3fn)),
    "seq-int8": (2, dict(mode="sequence", dtype=torch.float16, kv_dtype=torch.int8)),
    "heads": (2, dict(mode="heads")),
    "heads-full-mods": (2, dict(mode="heads", output="full", mods=True)),
    "heads-int8": (2, dict(mode="heads", dtype=torch.float16, kv_dtype=torch.int8)),
    "heads-int4": (2, dict(mode="heads", dtype=torch.float16, kv_dtype="int4")),
    "seq-int4": (2, dict(mode="sequence", dtype=torch.float16, kv_dtype="int4", block=64)),  # whole K groups
}


@pytest.mark.parametrize("world", sorted({w for w, _ in DECODE_CONFIGS.values()}))
def test_decode_matches_single_cache(world):
    """Every configuration of this world size in one spawn of the ranks (``each_config``: a
    failure names its configuration)."""
    configs = [(name, kw) for name, (w, kw) in DECODE_CONFIGS.items() if w == world]
    run_ranks("each_config", world, configs=configs)


def test_heads_mode_takes_the_ranks_slice_of_qkv():
    run_ranks("heads_local_qkv", 2)


def test_ranks_that_build_different_caches_all_refuse():
    run_ranks("config_differs", 2)


def test_ranks_that_disagree_on_q_k_norms_all_refuse():
    run_ranks("qk_norm_differs", 2)


@pytest.mark.parametrize("stay_s", [0.0, 6.0], ids=["rank-exits", "rank-stays-past-timeout"])
def test_a_failing_rank_ends_the_step_on_every_rank(stay_s):
    t0 = time.monotonic()
    run_ranks("rank_fails", 2, timeout_s=3.0, stay_s=stay_s)
    assert time.monotonic() - t0 < 60


def _torchrun(module: str, *args: str) -> str:
    """``torchrun --nproc-per-node 2 -m module args`` on CPUs (gloo); its output."""
    import subprocess
    import sys

    from distributed_cases import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", module, *args]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the gloo / reference path, GPU or not
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_demo_runs_under_torchrun():
    out = _torchrun("mmha.distributed.demo", "--preset", "tiny", "--context", "100", "--steps", "4",
                    "--weight-sets", "1")  # fmt: skip
    assert "2 ranks" in out and "1 weight sets" in out, out
    assert re.search(
        r"decode \(eager\): [\d.]+ ms per step, [\d.]+ tokens/s \(3 steps, final length 104\)", out
    ), out


def test_distributed_bench_runs_under_torchrun(tmp_path):
    path = tmp_path / "bench.json"
    _torchrun("mmha.bench.distributed", "--tiny", "--iters", "2", "--out", str(path))
    data = json.loads(path.read_text())
    assert data["header"] == {"world_size": 2, "backend": "gloo"}
    assert [(r["mode"], r["world_size"]) for r in data["rows"]] == [("sequence", 2), ("heads", 2)]
    for r in data["rows"]:
        assert r["mmha_decode_us"] > 0 and r["single_gpu_decode_us"] > 0 and r["speedup"] > 0
