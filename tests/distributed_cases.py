"""Scenarios of ``mmha.distributed`` run by every rank of a process group (gloo on CPUs, NCCL on
GPUs): each rank builds the sharded cache and a single ``KVCache`` over the same inputs (same
seed on every rank) and checks the sharded steps against the single cache's. Used by
tests/test_distributed.py (CPU, spawned ranks) and tests/test_distributed_gpu.py."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist

import mmha
from mmha.distributed import CollectiveError, ShardedKVCache, sharding
from mmha.epilogue import OutEpilogue
from mmha.spec import AttentionSpec, QKNorm, Rotary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(case: str, world: int, backend: str = "gloo", timeout_s: float = 60.0, **kw) -> None:
    """Spawn ``world`` processes that each run scenario ``case``; a failure in any raises here."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(world, free_port(), backend, timeout_s, case, kw), nprocs=world, join=True)


def _entry(rank, world, port, backend, timeout_s, case, kw):
    warnings.simplefilter("ignore")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        if case == "rank_fails":
            # a collective's wait raises at the group's timeout (CollectiveError) instead of the
            # watchdog ending the process; not with CUDA graphs (the wait syncs on the host)
            os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    # The rendezvous keeps a minute whatever the group's timeout: a short one (rank_fails) is for
    # the collectives, and connecting to the store can take seconds on a loaded machine.
    rendezvous = datetime.timedelta(seconds=max(60.0, timeout_s))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=rendezvous)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    CASES[case](rank, world, **kw)
    if case == "rank_fails":  # a failed collective leaves the group unusable: skip its teardown
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()


def _tol(dtype):
    return {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]


def _caches(world, mode, device, dtype, kv_dtype=None, block=16, hq=4, hkv=2, d=16, max_batch=3, max_seq_len=160,
            rotary_dim=8, layers=2, mods=None):  # fmt: skip
    """A sharded cache and a single one of the same layers; ``mods``: every layer's spec's score
    modifiers (beside rotary over ``rotary_dim``)."""
    kw = dict(attention=AttentionSpec(rotary=Rotary(rotary_dim), **(mods or {})), kv_dtype=kv_dtype)
    sharded = ShardedKVCache(
        layers, max_batch, max_seq_len, hq, hkv, d, dtype, device, mode=mode, block=block, **kw
    )
    single = mmha.KVCache(layers, max_batch, max_seq_len, hq, hkv, d, dtype, device, **kw)
    return sharded, single


def _churn_row_1(step, sharded, single):
    """Row 1 leaves both caches at step 7 and is admitted again at step 11."""
    if step == 7:
        sharded.release([1])
        single.release([1])
    if step == 11:
        assert sharded.admit([1]) == [1] and single.admit([1]) == [1]


def _prefill_both(sharded, single, lens, gen, device, dtype, hkv, d, layers=2):
    """The same random prompts of ``len(lens)`` rows (``max(lens)`` wide) into both caches."""
    for layer in range(layers):
        k = torch.randn(len(lens), max(lens), hkv, d, generator=gen).to(device, dtype)
        v = torch.randn(len(lens), max(lens), hkv, d, generator=gen).to(device, dtype)
        sharded.prefill(layer, k, v, lens)
        single.prefill(layer, k, v, lens)


def _compare(got, want, dtype, what):
    atol, rtol = _tol(dtype)
    got, want = got.float(), want.float()
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), f"{what}: non-finite entries differ"
    torch.testing.assert_close(got[fin], want[fin], atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def decode_matches_single(rank, world, mode="sequence", device="cpu", dtype=torch.float32, kv_dtype=None,
                          block=16, steps=40, output=None, mods=False):  # fmt: skip
    """Prefill ragged rows (one empty, one shorter than a block, one over several blocks), then
    steps with a release and an admit on the way; every step's out and lse equal the single cache's."""
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    gen = torch.Generator().manual_seed(1234)
    # the kernel's smallest head dim, and int4's (whole 32-channel chunks)
    hq, hkv, d = 4, 2, 16 if device == "cpu" and kv_dtype != "int4" else 32
    if mods:  # every head's settings: each rank takes its heads' sinks and epilogue channels; q/k norms
        g = torch.Generator().manual_seed(5)
        epilogue = OutEpilogue(shift=torch.randn(hq * d, generator=g).to(device),
                               smooth=(torch.rand(hq * d, generator=g) + 0.5).to(device))  # fmt: skip
        mods = dict(
            softcap=5.0,
            sinks=torch.tensor([0.5, -3.0, 2.0, 0.0], device=device),
            epilogue=epilogue,
            qk_norm=QKNorm((torch.rand(d, generator=g) + 0.5).to(device), torch.ones(d, device=device)),
        )
    sharded, single = _caches(world, mode, device, dtype, kv_dtype, block, d=d, mods=mods or None)
    _prefill_both(sharded, single, [0, 5, 120], gen, device, dtype, hkv, d)
    for step in range(steps):
        _churn_row_1(step, sharded, single)
        for layer in range(2):
            qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
            out, lse = sharded.step(layer, qkv, return_lse=True, output=output)
            want, want_lse = single.step(layer, qkv, return_lse=True)
            heads_out = output == "heads" or (output is None and mode == "heads")
            if heads_out and world > 1:
                h0, h1 = sharding.head_range(hq, world, rank)
                want, want_lse = want[:, h0 * d : h1 * d], want_lse[:, h0:h1]
            rows = single.active_rows  # a released row's output is unused
            _compare(out[rows], want[rows], dtype, f"rank {rank} step {step} layer {layer} out")
            _compare(lse[rows], want_lse[rows], dtype, f"rank {rank} step {step} layer {layer} lse")
        sharded.advance()
        single.advance()
        assert sharded.host_lengths == single.host_lengths
    assert sharded.lengths.tolist() == single.lengths.tolist()
    sharded.check()
    if mode == "sequence":  # the shards hold every token once
        local = sharded.local.host_lengths
        totals = torch.tensor(local, device="cpu" if dist.get_backend() == "gloo" else device)
        dist.all_reduce(totals)
        assert totals.tolist() == single.host_lengths, (totals.tolist(), single.host_lengths)
        for r in sharded.active_rows:
            want_local = sharding.local_length(single.host_lengths[r], world, rank, block)
            assert local[r] == want_local, (r, local[r], want_local)


def graph_matches_single(rank, world, mode="sequence", dtype=torch.float16, block=16, steps=40, output=None):
    """GPU: both layers' sharded steps captured once in a CUDA graph (collectives and merge
    inside) and replayed on fresh qkv, ``advance`` between replays, rows crossing ranks' blocks
    and a release and an admit on the way: every replay's out and lse equal the single cache's
    eager steps."""
    device = f"cuda:{torch.cuda.current_device()}"
    gen = torch.Generator().manual_seed(99)
    hq, hkv, d = 4, 2, 32
    sharded, single = _caches(world, mode, device, dtype, None, block, d=d)
    _prefill_both(sharded, single, [3, 17, 100], gen, device, dtype, hkv, d)
    qkvs = [torch.zeros(3, (hq + 2 * hkv) * d, device=device, dtype=dtype) for _ in range(2)]

    def layers():
        return [sharded.step(i, qkvs[i], return_lse=True, output=output) for i in range(2)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layers()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layers()
    for step in range(steps):
        _churn_row_1(step, sharded, single)
        for q in qkvs:
            q.copy_(torch.randn(q.shape, generator=gen).to(device, dtype))
        graph.replay()
        for layer in range(2):
            want, want_lse = single.step(layer, qkvs[layer], return_lse=True)
            if output == "heads" and world > 1:
                h0, h1 = sharding.head_range(hq, world, rank)
                want, want_lse = want[:, h0 * d : h1 * d], want_lse[:, h0:h1]
            rows = single.active_rows
            out, lse = outs[layer]
            _compare(out[rows], want[rows], dtype, f"rank {rank} replay {step} layer {layer} out")
            _compare(lse[rows], want_lse[rows], dtype, f"rank {rank} replay {step} layer {layer} lse")
        sharded.advance()
        single.advance()
    sharded.check()


def heads_local_qkv(rank, world, device="cpu", dtype=torch.float32):
    """Heads mode fed the rank's slice of qkv (a column-parallel projection) equals full qkv."""
    gen = torch.Generator().manual_seed(99)
    a, _ = _caches(world, "heads", device, dtype)
    b, _ = _caches(world, "heads", device, dtype)
    hq, hkv, d = 4, 2, 16
    (h0, h1), (g0, g1) = sharding.head_range(hq, world, rank), sharding.head_range(hkv, world, rank)
    for _ in range(5):
        qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
        mine = torch.cat(
            [qkv[:, h0 * d : h1 * d], qkv[:, (hq + g0) * d : (hq + g1) * d],
             qkv[:, (hq + hkv + g0) * d : (hq + hkv + g1) * d]], dim=1,
        )  # fmt: skip
        assert torch.equal(a.step(0, qkv), b.step(0, mine))
        full = a.step(1, qkv, output="full")
        assert full.shape == (3, hq * d)
        a.advance()
        b.advance()


def rank_fails(rank, world, device="cpu", stay_s=0.0):
    """Rank 1 raises before the step's collective (then exits, or stays ``stay_s`` seconds, past
    the group's timeout): every other rank gets CollectiveError, not a hang."""
    import time

    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    d = 16 if device == "cpu" else 32  # the kernel's smallest head dim
    sharded, _ = _caches(world, "sequence", device, torch.float32, d=d)
    qkv = torch.randn(3, (4 + 4) * d, device=device)
    if rank == 1:
        try:
            sharded.step(0, qkv[:, :-1])  # a bad qkv: refused on this rank only
        except ValueError:
            time.sleep(stay_s)
            return
        raise AssertionError("rank 1 expected a ValueError")
    try:
        sharded.step(0, qkv)
    except CollectiveError as e:
        assert "layer 0" in str(e) and f"rank {rank}" in str(e), str(e)
        return
    raise AssertionError("expected CollectiveError")


def config_differs(rank, world, device="cpu"):
    """Rank 1 builds its cache with another block: every rank's constructor raises ValueError
    naming the field, none hangs."""
    try:
        _caches(world, "sequence", device, torch.float32, block=16 if rank == 0 else 8)
    except ValueError as e:
        assert "block differs between ranks" in str(e) and "[16, 8]" in str(e), str(e)
        return
    raise AssertionError("expected ValueError")


def qk_norm_differs(rank, world, device="cpu"):
    """Rank 1's layers norm q and k, rank 0's do not: every rank refuses, naming the field."""
    mods = dict(qk_norm=QKNorm(torch.ones(16, device=device))) if rank == 1 else None
    try:
        _caches(world, "sequence", device, torch.float32, mods=mods)
    except ValueError as e:
        assert "qk_norms differs between ranks" in str(e), str(e)
        return
    raise AssertionError("expected ValueError")


def each_config(rank, world, configs):
    """``decode_matches_single`` for each ``(name, kwargs)`` of ``configs`` in one process group:
    one spawn of the ranks (their interpreters and torch's import are most of a case's time on a
    CPU) for the whole list; a failure names its configuration."""
    for name, kw in configs:
        try:
            decode_matches_single(rank, world, **kw)
        except Exception as e:
            raise AssertionError(f"configuration {name} on rank {rank}: {e}") from e


CASES = {
    "config_differs": config_differs,
    "qk_norm_differs": qk_norm_differs,
    "decode_matches_single": decode_matches_single,
    "each_config": each_config,
    "graph_matches_single": graph_matches_single,
    "heads_local_qkv": heads_local_qkv,
    "rank_fails": rank_fails,
}
