"""mmha.bench on the CPU: the grid, the decode timing's layer count, the summary of a row, the
speed bar and the tables, the alternating rounds of compared timings (timings themselves run on a
GPU: bench/validate.sh)."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmha.bench import report
from mmha.bench.args import CHECK_ARGS
from mmha.bench.methods import PEERS
from mmha.bench.problems import CANONICAL, Config, build_configs


def test_canonical_grid_is_the_documented_one():
    cfgs = build_configs("canonical")
    canon = [c for c in cfgs if c.head_dim == 128]
    assert len(canon) == 2 * len(CANONICAL) == 36
    assert {c.dtype for c in canon} == {"fp16", "bf16"}
    assert {(c.batch, c.num_kv_heads, c.seq_len) for c in canon} == {(b, h, s) for _, b, h, s in CANONICAL}
    assert all(c.num_heads == 32 for c in canon)
    small = [c for c in cfgs if c.group.startswith("small-head")]
    assert all(c.batch * c.seq_len == 16384 and c.head_dim == 64 and c.num_heads == 16 for c in small)


def test_custom_grid_takes_several_kv_head_counts():
    cfgs = build_configs("custom", ["fp16"], custom=([1, 16], [1024, 4096], 32, [8, 32], 128), int4=True)
    plain = [(c.num_kv_heads, c.batch, c.seq_len) for c in cfgs if c.kv != "int4"]
    assert plain == [(h, b, s) for h in (8, 32) for b in (1, 16) for s in (1024, 4096)]
    assert [c.kv for c in cfgs[:2]] == ["", "int4"]  # each twin right after its row
    one = build_configs("custom", ["fp16"], custom=([1], [1024], 32, 8, 128))
    assert [(c.num_kv_heads, c.batch, c.seq_len) for c in one] == [(8, 1, 1024)]


@pytest.mark.parametrize(
    "batch, hkv, seq, layers",
    [
        (1, 32, 1024, 32),
        (1, 8, 4096, 32),
        (16, 32, 512, 8),
        (64, 32, 256, 4),
        (64, 32, 1024, 2),
        (1, 32, 65536, 2),
    ],
)
def test_decode_timing_layers(batch, hkv, seq, layers):
    # L = max(2, min(32, ceil(1 GiB / cache bytes))).
    cfg = Config("t", batch, 32, hkv, 128, seq, "fp16")
    assert cfg.layers == layers
    assert cfg.layers * cfg.kv_bytes >= 2**30 or cfg.layers == 32


def fake_result(cfg: Config, mmha_us: float, peers: dict, floor_us: float) -> dict:
    return {
        "config": cfg,
        "plan": "8x3",
        "decode": {
            "mmha": {"us": mmha_us, "p20": mmha_us, "p80": mmha_us},
            **{k: {"us": v} for k, v in peers.items()},
        },
        "errors": {},
        "skipped": {"flashinfer": "not installed", "sdpa_flash": "RuntimeError: no kernel"},
        "cold": {},
        "graph": {},
        "floor": {"us": floor_us, "shape": "1024x1 floats, 4 warps"},
        "floor_cold_us": math.nan,
    }


def test_summary_ratios_and_floor():
    cfg = Config("MHA latency", 1, 32, 32, 128, 1024, "fp16")
    row = report.summarize(fake_result(cfg, 10.0, {"sdpa_cudnn": 12.5, "eager": 40.0}, 6.0), 4600.0)
    assert row["best_peer_decode"] == "sdpa_cudnn" and row["best_peer_decode_us"] == 12.5
    assert row["ratio"] == pytest.approx(0.8)
    assert row["pct_floor"] == pytest.approx(60.0)
    assert row["read_floor_decode_us"] == 6.0 and row["layers"] == 32
    assert set(PEERS) <= {k[: -len("_decode_us")] for k in row if k.endswith("_decode_us")}
    table = report.table([row])
    assert "sdpa_cudnn" in table and "0.80" in table and "60.0" in table
    assert len(table.splitlines()[0].split("|")) < 12  # the default table fits a terminal
    assert "eager" in report.table([row], full=True)
    assert (
        report.skipped_line([row])
        == "not timed: flashinfer (not installed, 1 row); sdpa_flash (RuntimeError, 1 row)"
    )


def canonical_rows(ratio: float, pct: float) -> list[dict]:
    rows = []
    for g, b, hkv, s in CANONICAL:
        cfg = Config(g, b, 32, hkv, 128, s, "fp16")
        floor = 100.0
        rows.append(
            report.summarize(
                fake_result(cfg, floor * 100 / pct, {"sdpa_cudnn": floor * 100 / pct / ratio}, floor), 1.0
            )
        )
    return rows


def test_speed_bar_holds_and_misses():
    assert report.bar(canonical_rows(0.8, 98.0)) == []
    misses = report.bar(canonical_rows(1.01, 98.0))
    assert any("median mmha/best peer 1.010 > 0.97" in m for m in misses)
    assert sum("x sdpa_cudnn" in m for m in misses) == len(CANONICAL)
    misses = report.bar(canonical_rows(0.9, 90.0))
    assert any("of the read floor < 97 %" in m for m in misses)  # the >= 1 GB rows
    assert any("of the read floor < 94 %" in m for m in misses)  # 256 MB - 1 GB
    assert not any("< 85 %" in m for m in misses)
    assert any("small cache" in m for m in misses)  # 0.9x > 0.85x on the 17 MB rows


def test_fp8_rows_follow_their_16bit_twins_and_the_fp8_bar():
    cfgs = build_configs("canonical", ["fp16"], extras=False, fp8=True)
    assert len(cfgs) == 2 * len(CANONICAL)
    assert [c.kv for c in cfgs[:2]] == ["", "fp8"] and cfgs[1].same_shape() == cfgs[0]
    assert cfgs[1].kv_bytes * 2 == cfgs[0].kv_bytes and "kv=fp8" in cfgs[1].label
    big16 = Config("MHA b16", 16, 32, 32, 128, 8192, "fp16")
    big8 = big16.same_shape("fp8")
    rows = [
        report.summarize(fake_result(big16, 480.0, {"sdpa_cudnn": 470.0}, 460.0), 4000.0),
        report.summarize(fake_result(big8, 250.0, {"sdpa_cudnn": 470.0}, 240.0), 4000.0),
    ]
    (r,) = report.fp8_rows(rows)
    assert r["mmha_16bit_us"] == 480.0 and r["fp8_speedup_ratio"] == pytest.approx(250 / 480)
    assert report.fp8_bar(rows) == []  # 0.52x the 16-bit time, 96 % of the fp8 floor, ahead of the peer
    rows[1] = report.summarize(fake_result(big8, 480.0, {"sdpa_cudnn": 470.0}, 240.0), 4000.0)
    misses = report.fp8_bar(rows)
    assert len(misses) == 3
    assert "best 16-bit peer" in misses[0] and "16-bit time > 0.55" in misses[1] and "< 95 %" in misses[2]


def test_int8_rows_follow_their_16bit_twins_and_the_int8_bar():
    cfgs = build_configs("canonical", ["fp16"], extras=False, fp8=True, int8=True)
    assert len(cfgs) == 3 * len(CANONICAL)
    assert [c.kv for c in cfgs[:3]] == ["", "fp8", "int8"] and cfgs[2].same_shape() == cfgs[0]
    # int8: a byte a value and a 4-byte scale per token and kv head, K and V.
    assert cfgs[2].kv_bytes == cfgs[1].kv_bytes + 2 * 1 * 32 * 1024 * 4 and "kv=int8" in cfgs[2].label
    big16 = Config("MHA b16", 16, 32, 32, 128, 8192, "fp16")
    small16 = Config("MHA b16", 16, 32, 32, 128, 512, "fp16")
    rows = [
        report.summarize(fake_result(big16, 480.0, {"sdpa_cudnn": 470.0}, 460.0), 4000.0),
        report.summarize(fake_result(big16.same_shape("int8"), 260.0, {"sdpa_cudnn": 470.0}, 240.0), 4000.0),
        report.summarize(fake_result(small16, 20.0, {"sdpa_cudnn": 19.0}, 15.0), 4000.0),
        report.summarize(fake_result(small16.same_shape("int8"), 15.0, {"sdpa_cudnn": 19.0}, 8.0), 4000.0),
    ]
    big, small = report.int8_rows(rows)
    assert big["mmha_16bit_us"] == 480.0 and big["int8_speedup_ratio"] == pytest.approx(260 / 480)
    assert report.int8_bar(rows) == []  # 0.54x on the 2.1 GB row; the 134 MB row is under the bar's size
    rows[1] = report.summarize(
        fake_result(big16.same_shape("int8"), 300.0, {"sdpa_cudnn": 470.0}, 240.0), 4000.0
    )
    (miss,) = report.int8_bar(rows)
    assert "0.625x mmha's 16-bit time > 0.55" in miss


def test_rounds_alternate_and_cancel_a_linear_drift(monkeypatch):
    from mmha.bench import timing

    assert timing.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    # A machine that gets 1 us slower at every graph timed: in one pass the last method timed
    # would look 2 us slower than the first; over two rounds of alternating order every method
    # keeps its own time plus the same drift.
    base = {"plain": 100.0, "fused": 101.0, "unfused": 103.0}
    timed = []
    monkeypatch.setattr(timing, "capture", lambda fns: fns[0])
    monkeypatch.setattr(timing, "replay_us", lambda graph, calls, replays: timed.append(graph) or {
        "us": base[graph] + len(timed) - 1})  # fmt: skip
    got = timing.decode_us_rounds({name: [name, name] for name in base}, rounds=2)
    assert timed == ["plain", "fused", "unfused", "unfused", "fused", "plain"]
    assert got["plain"]["rounds_us"] == [100.0, 105.0]
    assert got["fused"]["us"] - got["plain"]["us"] == 1.0
    assert got["unfused"]["us"] - got["plain"]["us"] == 3.0
    assert all(got[name]["layers"] == 2 for name in base)
    # Four rounds (the default): the drift still cancels, and one round slowed as a whole (a
    # spike of 80 us on the fused call's second round) moves the fused time by at most the drift
    # between two of its rounds (3 us), not by a share of the spike (the mean would be 20 us off).
    timed.clear()
    got = timing.decode_us_rounds({name: [name, name] for name in base})
    assert timed == ["plain", "fused", "unfused", "unfused", "fused", "plain"] * 2
    assert got["fused"]["us"] - got["plain"]["us"] == 1.0
    timed.clear()
    spike = {4}
    monkeypatch.setattr(timing, "replay_us", lambda graph, calls, replays: timed.append(graph) or {
        "us": base[graph] + len(timed) - 1 + (80.0 if len(timed) - 1 in spike else 0.0)})  # fmt: skip
    got = timing.decode_us_rounds({name: [name, name] for name in base})
    assert got["fused"]["rounds_us"][1] > 180
    assert got["fused"]["us"] - got["plain"]["us"] <= 1.0 + 3.0


@pytest.mark.parametrize("method", ["sdpa_default", "sdpa_cudnn", "mmha"])
def test_peer_probing_warnings_stay_inside_the_benchmark(method):
    import warnings

    from mmha.bench.methods import method_context

    # What torch says while the benchmark runs SDPA's default choice on a GQA row (dense inputs).
    said = (
        "For dense input, both fused kernels require query, key and value to have the same "
        "num_heads. Query.sizes(): [1, 32, 1, 128], Key sizes(): [1, 8, 4096, 128]"
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with method_context(method):
            warnings.warn(said, UserWarning, stacklevel=1)
            warnings.warn("Flash attention kernel not used because: head_dim", UserWarning, stacklevel=1)
        warnings.warn("a user's own warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a user's own warning"]


def test_tree_targets_name_the_tflops_they_need():
    from mmha.bench import tree

    row = dict(batch=16, num_heads=32, num_kv_heads=8, head_dim=128, context=4096, nodes=64, shape="chain")
    flops = 4 * 16 * 32 * 64 * (4096 + 64) * 128
    r = {**row, "mmha_decode_us": 200.0, "mmha_single_token_us": 50.0, "tflop_per_s": flops / 200.0 / 1e6}
    assert tree.target_tflops(r) == pytest.approx(flops / (1.3 * 50.0) / 1e6)
    assert (
        tree.target_tflops({**r, "context": 1024}) is None and tree.target_tflops({**r, "nodes": 16}) is None
    )
    r["vs_single_token"] = 4.0
    (miss,) = tree.misses([r])
    assert f"needs {tree.target_tflops(r):.0f})" in miss and f"({r['tflop_per_s']:.0f} TFLOP/s;" in miss
    assert tree.ceiling_lines({"header": {}}) == []
    lines = tree.ceiling_lines({"header": {"gemm_tflops": 781.4, "gemm_how": "torch.matmul"}})
    assert "781 TFLOP/s" in lines[0]
    need = tree.target_tflops(r)
    head = {
        "gemm_tflops": need * 2,
        "gemm_how": "torch.matmul",
        "attention_tflops": need / 2,
        "attention_how": "sdpa",
    }
    (miss,) = tree.misses([r], head)
    assert miss.endswith(f"needs {need:.0f}, above the fastest dense attention)")
    (miss,) = tree.misses([r], {**head, "gemm_tflops": need / 1.5})
    assert miss.endswith("above the dense matrix product)")
    (miss,) = tree.misses([r], {**head, "attention_tflops": need * 1.5})
    assert miss.endswith(f"needs {need:.0f})")
    lines = tree.ceiling_lines({"header": head})
    assert f"{need / 2:.0f} TFLOP/s" in lines[1] and lines[-1] == ""
    # The other way to meet it: >= 0.6x the dense matrix product of the same run.
    at = r["tflop_per_s"] / tree.TARGET_GEMM_SHARE * 0.999
    assert tree.misses([r], {**head, "gemm_tflops": at}) == []
    (miss,) = tree.misses([r], {**head, "gemm_tflops": at * 1.02})
    assert f"under 0.6x the dense matrix product's {at * 1.02:.0f};" in miss


def test_tree_int8_rows_follow_their_16_bit_twins():
    from mmha.bench import tree

    plain, both = tree.rows(), tree.rows(int8=True)
    llama = [r for r in plain if r.num_heads == 32]
    assert len(both) == len(plain) + len(llama)
    for r in llama:
        i = both.index(r)
        twin = both[i + 1]
        assert twin.kv == "int8" and twin.context == r.context and twin.nodes == r.nodes
        # codes (a byte a value) and one fp32 scale per token and kv head, for K and V
        assert twin.kv_bytes == 2 * r.batch * r.num_kv_heads * (r.context + r.nodes) * (r.head_dim + 4)
        assert twin.layers >= r.layers
    assert all(r.kv == "" for r in both if r.num_heads == 1)
    assert [r.kv for r in tree.rows(quick=True, int8=True)] == ["", "", "int8", "", "int8"]
    old = {**{f: getattr(llama[0], f) for f in ("batch", "num_heads", "num_kv_heads", "head_dim")},
           "context": 4096, "nodes": 64, "shape": "binary", "mmha_single_token_us": 50.0}  # fmt: skip
    assert tree.target_tflops(old) is not None  # a kept JSON's row without "kv"


def test_tree_bias_rows_follow_their_twins():
    from mmha.bench import tree

    plain, both = tree.rows(int8=True), tree.rows(int8=True, bias=True)
    twins = [r for r in plain if r.num_heads == 32 and not r.kv]
    assert len(both) == len(plain) + len(twins)
    for r in twins:
        twin = both[both.index(r) + 2]  # after the int8 twin
        assert twin == dataclasses.replace(r, features="bias") and twin.kv_bytes == r.kv_bytes
    assert all(r.features == "" for r in both if r.num_heads == 1 or r.kv)
    assert [r.features for r in tree.rows(quick=True, bias=True)] == ["", "", "bias", "", "bias"]
    row = {**dataclasses.asdict(dataclasses.replace(twins[0], features="bias")), "mmha_decode_us": 30.0, "best_peer_decode": "flex",
           "best_peer_decode_us": 20.0, "ratio": 1.5}  # fmt: skip
    (miss,) = tree.misses([row])
    assert "binary +bias: 1.500x flex" in miss
    assert "binary +bias" in tree.table([row])
    every = tree.rows(bias=True, norm=True)
    for r in twins:  # the norm twin after the bias one
        assert every[every.index(r) + 2] == dataclasses.replace(r, features="norm")
    assert [r.features for r in tree.rows(quick=True, norm=True)] == ["", "", "norm", "", "norm"]


def test_tree_rows_chosen_by_batch_context_and_nodes():
    from mmha.bench import tree

    all_rows = tree.rows(int8=True)
    assert tree.select(all_rows, None) == all_rows
    picked = tree.select(all_rows, ["1,1024,4", "16,4096,64"])
    assert {(r.batch, r.context, r.nodes) for r in picked} == {(1, 1024, 4), (16, 4096, 64)}
    assert {r.kv for r in picked} == {"", "int8"} and {r.shape for r in picked} == {"binary", "chain"}
    with pytest.raises(ValueError, match="three integers"):
        tree.select(all_rows, ["1,1024"])
    with pytest.raises(ValueError, match="T in"):
        tree.select(all_rows, ["1,1024,65"])
    # A size the table does not hold: the Llama-shaped binary tree, with the table's twins.
    made = tree.select(all_rows, ["16,4096,32", "1,1024,4"])
    assert [(r.batch, r.context, r.nodes, r.shape, r.kv) for r in made if r.nodes == 32] == [
        (16, 4096, 32, "binary", ""),
        (16, 4096, 32, "binary", "int8"),
    ]
    assert all((r.num_heads, r.num_kv_heads, r.head_dim) == (32, 8, 128) for r in made if r.nodes == 32)
    assert [r for r in made if r.nodes == 4] == [r for r in picked if (r.batch, r.context, r.nodes) == (1, 1024, 4)]


def test_tree_spec_rows_for_the_timeline_and_profiles():
    from mmha.bench import tree

    row, splits, stages = tree.spec_row("16,4096,64")
    assert (row.batch, row.context, row.nodes, row.shape, row.kv) == (16, 4096, 64, "binary", "")
    assert (splits, stages) == (None, None)
    row, splits, stages = tree.spec_row("4,1024,54@8X2")  # the seeds' row: a random tree, one head
    assert (row.shape, row.num_heads, splits, stages) == ("random", 1, 8, 2)
    with pytest.raises(ValueError, match="SPLITSxSTAGES"):
        tree.spec_row("1,1024,4@8")
    row, _, _ = tree.spec_row("1,1000,32")  # a size the table does not hold: made, Llama-shaped
    assert (row.batch, row.context, row.nodes, row.shape, row.num_heads) == (1, 1000, 32, "binary", 32)
    row, splits, stages = tree.spec_row("16,4096,4@1x6", "int8")  # a Llama-shaped row's int8 twin
    assert (row.batch, row.context, row.nodes, row.shape, row.kv) == (16, 4096, 4, "binary", "int8")
    assert (splits, stages) == (1, 6)
    with pytest.raises(ValueError, match="no row over kv='int8'"):
        tree.spec_row("4,1024,54", "int8")  # the seeds' row has no int8 twin
    with pytest.raises(ValueError, match="kv='fp8'"):
        tree.spec_row("16,4096,4", "fp8")


def test_mods_rows_time_as_many_layers_as_their_reads_need():
    from mmha.bench import mods
    from mmha.bench.problems import MAX_LAYERS, MIN_LAYERS

    window = mods.Row("window", 1, 8, 131072, mods.WINDOW)
    plain = mods.Row("plain", 1, 8, mods.WINDOW, mods.WINDOW)
    # a window of 4096 reads its keys and the rest of its first tile, not the 537 MB it holds
    assert window.read_bytes == 2 * 8 * (mods.WINDOW + 63) * mods.D * 2 < window.kv_bytes
    assert window.layers() == plain.layers() == MAX_LAYERS
    assert window.layers(free_bytes=8 * 2 * window.kv_bytes) == 4  # half the free memory, both layouts
    assert mods.Row("window", 16, 8, 131072, mods.WINDOW).layers(free_bytes=40 << 30) == MIN_LAYERS
    softcap = mods.Row("softcap", 16, 32, 32768, 32768)
    assert softcap.read_bytes == softcap.kv_bytes and softcap.layers() == MIN_LAYERS


def test_models_table_writes_each_family_and_route(tmp_path, monkeypatch):
    """python -m mmha.bench.models on the CPU: a row per family and route, tokens compared with
    transformers' own, the refusals recorded with their reason."""
    pytest.importorskip("transformers")
    import json

    from mmha.bench import families, models

    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: False)
    assert models.gpu_slug() == "cpu"
    assert models.main(["--families", "qwen3", "--new-tokens", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "models_cpu.json").read_text())
    assert [(r["family"], r["route"]) for r in data["rows"]] == [("qwen3", "graphs"), ("qwen3", "native")]
    assert all(r["tokens_equal"] and r["refused"] is None for r in data["rows"]) and data["speed"] == []
    monkeypatch.setitem(families.FAMILIES, "phi3-long", ("phi3", dict(original_max_position_embeddings=16)))
    row = families.check_family("phi3-long", "native", "cpu", 4)
    assert not row["tokens_equal"] and "original_max_position_embeddings (16)" in row["refused"]


def test_graph_breaks_script_counts_the_native_steps_breaks(capsys):
    """bench/graph_breaks.py runs one decode step of the native route under torch._dynamo.explain
    (on the CPU the reference path's host reads are its breaks)."""
    import ast
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "graph_breaks.py"
    spec = importlib.util.spec_from_file_location("graph_breaks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--family", "llama3", "--generate", "2"]) == 0
    out = capsys.readouterr().out
    on_gpu = "llama3 on cuda:" in out
    assert "llama3 on cpu:" in out or on_gpu
    assert "graphs," in out and (on_gpu or "break 0:" in out)
    tokens = ast.literal_eval(out.split("compiled generate, 2 tokens")[1].splitlines()[1])
    assert len(tokens) == 4 and all(len(t) == 2 for t in tokens)


def test_hf_bench_times_one_decode_step_inside_generate(monkeypatch):
    """mmha.bench.hf --forward: the TIMED_CALL-th call of generate's compiled step runs 2 + REPLAYS
    times back to back (the last REPLAYS timed) and returns the last call's result; other calls
    pass through once; unwrapping restores the compiled call; a model generate did not compile is
    left alone; the row's loop_ms is the step less the step alone."""
    from types import SimpleNamespace

    import torch

    from mmha.bench import hf

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = len(calls)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return float(other.t - self.t)  # 1 "ms" per call between the events

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls: list[int] = []

    def compiled(step):
        calls.append(step)
        return len(calls)

    model = SimpleNamespace(_compiled_call=compiled)
    out: dict = {}
    assert hf._step_timer(model, out)
    results = [model._compiled_call(step=i) for i in range(1, hf.TIMED_CALL + 2)]
    repeats = 2 + hf.REPLAYS  # 2 untimed, REPLAYS timed
    assert calls == [*range(1, hf.TIMED_CALL), *[hf.TIMED_CALL] * repeats, hf.TIMED_CALL + 1]
    assert results[hf.TIMED_CALL - 1] == len(calls) - 1 and out["forward_ms"] == 1.0
    out.pop("_unwrap")()
    assert model._compiled_call is compiled
    assert not hf._step_timer(SimpleNamespace(), {})

    def generate(model, ids, new, **kw):
        return [model._compiled_call(step=1) for _ in range(new)]

    monkeypatch.setattr(hf, "_hf_generate", generate)
    res = hf._forward_row({"step_ms": 3.0}, SimpleNamespace(_compiled_call=compiled), None)
    assert res == {"step_ms": 3.0, "forward_ms": 1.0, "loop_ms": 2.0}
    assert hf._forward_row({"step_ms": 3.0}, SimpleNamespace(), None) == {"step_ms": 3.0}
    row = {"batch": 16, "context": 1024, "method": "mmha_native", "decode_tok_s": 2000.0, "step_ms": 8.0,
           "forward_ms": 6.5, "loop_ms": 1.5, "vs_hf_static_compile": 1.8}  # fmt: skip
    assert "| 6.500 " in hf.table([row])


def test_benchmarks_page_int8_section_from_a_run():
    """bench/make_docs.py's int8 section: each int8 row beside its 16-bit twin and the bar's line."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "make_docs.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("make_docs", path)
    make_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_docs)
    big16 = Config("MHA b16", 16, 32, 32, 128, 8192, "fp16")
    rows = [
        report.summarize(fake_result(big16, 480.0, {"sdpa_cudnn": 470.0}, 460.0), 4000.0),
        report.summarize(fake_result(big16.same_shape("int8"), 300.0, {"sdpa_cudnn": 470.0}, 240.0), 4000.0),
    ]
    data = {
        "header": {"gpu": "NVIDIA H100", "date": "2026-11-27", "torch": "2.11", "cuda": "13.0"},
        "rows": rows,
    }
    text = "\n".join(make_docs.int8_section(data, "h100"))
    assert "| fp16 kv=int8 B=16 Hq=32 Hkv=32 D=128 S=8192 | 2147.5 " in text and "| 0.625 " in text
    assert "int8 bar (`mmha.bench.report.int8_bar`): 1 misses:" in text


def test_ab_table_sets_each_build_beside_the_first(tmp_path):
    """bench/ab_table.py: two runs per build, each build's mean over the first build's, rows every
    build timed twice only, and the ratios' median and range."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "ab_table.py"
    spec = importlib.util.spec_from_file_location("ab_table", path)
    ab_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_table)
    shape = {"dtype": "fp16", "batch": 1, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    times = {"old": [(10.0, 20.0), (10.0, 20.0)], "new": [(9.0, 22.0), (11.0, 22.0)]}
    for name, runs in times.items():
        for run, (short, long) in enumerate(runs, 1):
            rows = [{**shape, "seq_len": 4096, "mmha_decode_us": short},
                    {**shape, "seq_len": 65536, "mmha_decode_us": long},
                    {**shape, "seq_len": 1024, "skipped": "no"}]  # fmt: skip
            if name == "old" and run == 1:
                rows.append({**shape, "seq_len": 512, "mmha_decode_us": 5.0})  # timed once: left out
            (tmp_path / f"{name}_{run}").mkdir()
            (tmp_path / f"{name}_{run}" / "bench.json").write_text(json.dumps({"rows": rows}))
    text = ab_table.table(tmp_path, "caption", [("old", "A"), ("new", "B")])
    lines = text.splitlines()
    assert lines[0] == "caption" and "| A us (2 runs) | B us (2 runs) | B / A |" in lines[1]
    assert "| fp16 | - | 1 | 32 | 8 | 128 | 4096 | 10.0, 10.0 | 9.0, 11.0 | 1.000 |" in lines
    assert "| fp16 | - | 1 | 32 | 8 | 128 | 65536 | 20.0, 20.0 | 22.0, 22.0 | 1.100 |" in lines
    assert not any("| 512 |" in line or "| 1024 |" in line for line in lines)
    assert lines[-1] == "B / A: median 1.050, range 1.000-1.100"


def test_ab_table_reads_tree_runs(tmp_path):
    """bench/ab_table.py over `python -m mmha.bench --tree` runs (bench_tree.json): rows keyed by
    batch, context, nodes and tree shape (with the row's features, such as a qkv bias); each row's
    one-token step on the same caches a row of its own (once, though two shapes carry it)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "ab_table.py"
    spec = importlib.util.spec_from_file_location("ab_table", path)
    ab_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_table)
    shape = {"kv": "", "batch": 1, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "context": 1024}
    for name, us in (("base", 22.0), ("new", 19.8)):
        for run in (1, 2):
            one = {"mmha_single_token_us": us / 2}
            rows = [
                {**shape, "nodes": 4, "shape": "binary", "mmha_decode_us": us + run / 10, **one},
                {**shape, "nodes": 4, "shape": "chain", "mmha_decode_us": us, **one},
                {**shape, "nodes": 4, "shape": "binary", "features": "bias", "mmha_decode_us": 2 * us},
            ]
            (tmp_path / f"{name}_{run}").mkdir()
            (tmp_path / f"{name}_{run}" / "bench_tree.json").write_text(json.dumps({"rows": rows}))
    lines = ab_table.table(tmp_path, "caption", [("base", "base"), ("new", "new")]).splitlines()
    assert "| kv | B | Hq | Hkv | D | context | T | tree |" in lines[1]
    assert "| - | 1 | 32 | 8 | 128 | 1024 | 4 | binary | 22.1, 22.2 | 19.9, 20.0 | 0.901 |" in lines
    assert "| - | 1 | 32 | 8 | 128 | 1024 | 4 | binary +bias | 44.0, 44.0 | 39.6, 39.6 | 0.900 |" in lines
    assert "| - | 1 | 32 | 8 | 128 | 1024 | 1 | one-token | 11.0, 11.0 | 9.9, 9.9 | 0.900 |" in lines
    assert sum("one-token" in line for line in lines) == 1


def test_sweep_extra_plans_parse_and_bad_ones_are_named(capsys):
    """python -m mmha.bench.sweep --plans SxT: (splits, stages) pairs for the canonical rows; a
    malformed or out-of-range one, or --plans with --tree, refused by name before any GPU is looked
    for."""
    from mmha import dispatch
    from mmha.bench import sweep

    assert sweep.parse_plan("4x6") == (4, 6)
    assert sweep.parse_plan("1X2") == (1, 2)
    for bad, says in (("4", "takes SxT"), ("4x", "takes SxT"), ("ax6", "takes SxT"),
                      (f"{dispatch.MAX_SPLITS + 1}x3", "splits in [1, "),
                      (f"2x{dispatch.MAX_STAGES + 1}", "stages in [")):  # fmt: skip
        with pytest.raises(SystemExit):
            sweep.main(["--plans", bad])
        assert says in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        sweep.main(["--tree", "--plans", "4x6"])
    assert "--plans applies to the canonical rows" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--tree", "--int4"])
    assert "--int4 applies to the canonical rows" in capsys.readouterr().err


def test_tree_sweep_plans_and_arguments(capsys):
    """python -m mmha.bench.sweep --tree: the dispatcher's splits at every stage count up to its
    own, then each extra split count at two stages and at the dispatcher's; bad --only / --splits
    refused by name (before any GPU is looked for)."""
    from mmha import dispatch
    from mmha.bench import sweep

    plan = dispatch.Plan("split", 16, 3, 2)
    got = [(p.num_splits, p.stages, p.variant) for p in sweep.tree_plans(plan, (1, 8, 16))]
    assert got == [(16, 2, "split"), (16, 3, "split"), (1, 2, "single_pass"), (1, 3, "single_pass"),
                   (8, 2, "split"), (8, 3, "split")]  # fmt: skip
    with pytest.raises(SystemExit):
        sweep.main(["--tree", "--only", "1,1024"])
    assert "--only takes B,CTX,T" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--tree", "--splits", "0"])
    assert "--splits takes counts in [1, " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--splits", "4"])
    assert "apply to --tree" in capsys.readouterr().err


def test_sweep_int8_rows_take_int8_ring_depths(monkeypatch):
    """python -m mmha.bench.sweep --int8: an int8 row is planned and swept as an int8 cache (its
    stages half the bytes and their token scales, so deeper rings than its fp16 twin's)."""
    import torch

    from mmha import dispatch, ops
    from mmha.bench import sweep
    from mmha.bench.problems import Config

    monkeypatch.setattr(ops, "device_spec", lambda index: dispatch.H100)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    fp16 = Config("MHA b16", 16, 32, 32, 128, 8192, "fp16")
    int8 = fp16.same_shape("int8")
    deepest = {}
    for cfg in (fp16, int8):
        plan = dispatch.choose_variant(cfg.batch, 32, 32, 128, cfg.seq_len, torch.float16, dispatch.H100,
                                       kv_dtype=cfg.kv_torch_dtype)  # fmt: skip
        got = sweep.candidates(cfg, plan)
        assert got[0] == (plan, "auto")
        deepest[cfg.kv] = max(p.stages for p, _ in got)
        ring = dict(act_bytes=2, token_scales=cfg.kv == "int8")
        assert deepest[cfg.kv] == dispatch.max_stages(128, cfg.kv_elem, dispatch.H100, **ring)
        for p, _ in got:  # blocks per SM as the stages of that cache fit
            assert p.blocks_per_sm == plan.blocks_per_sm or p.blocks_per_sm == dispatch.tile_blocks_per_sm(
                128, cfg.kv_elem, p.stages, dispatch.H100, **ring)  # fmt: skip
    assert deepest["int8"] > deepest[""]


def test_tree_rows_plan_at_their_cache_dtype(monkeypatch):
    """An int8 tree row is planned as an int8 cache is (a deeper ring than fp16's at 16K), an fp16
    row as fp16 (the plan the tree benchmark and the sweep report and time)."""
    import torch

    from mmha import dispatch, ops
    from mmha.bench import tree

    monkeypatch.setattr(ops, "device_spec", lambda index: dispatch.H100)
    monkeypatch.setattr(ops, "_device_index", lambda device: 0)
    rows = tree.select(tree.rows(int8=True), ["1,16384,4"])
    assert [r.kv for r in rows] == ["", "int8"]
    assert tree.plan_of(rows[0]).stages < tree.plan_of(rows[1]).stages
    for r in rows:
        kv = torch.int8 if r.kv else torch.float16
        want = dispatch.choose_variant(r.batch, r.num_heads * r.nodes, r.num_kv_heads, r.head_dim,
                                       r.context + r.nodes, torch.float16, dispatch.H100, kv_dtype=kv,
                                       tree=True)  # fmt: skip
        assert tree.plan_of(r) == want


@pytest.mark.parametrize("extra", [[], ["--tree"], ["--mods"], ["--paged"], ["--epilogue"]])
def test_check_args_parses_and_stops(extra, monkeypatch, capsys):
    from mmha.bench.cli import main

    monkeypatch.setenv(CHECK_ARGS, "1")
    with pytest.raises(SystemExit) as ok:
        main([*extra, "--out", "unused"])
    assert ok.value.code == 0 and "arguments ok" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main([*extra, "--no-such-flag"])
    assert bad.value.code == 2


def test_ab_trees_refuses_bad_arguments_before_building(tmp_path):
    root = Path(__file__).parent.parent
    label = f"argcheck{os.getpid()}"
    env = {**os.environ, "OUT": str(tmp_path), "TREES": f"{label}:."}
    run = subprocess.run(["bash", "bench/ab_trees.sh", "--kv-heads", "eight"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "the arguments do not parse" in run.stdout and "invalid int value: 'eight'" in run.stderr
    assert not Path(f"/tmp/ab_{label}").exists() and not list(tmp_path.glob("build_*.log"))


def test_patch_trees_makes_base_and_patched_trees(tmp_path):
    """bench/patch_trees.sh in a clone: .tbase is HEAD's tree (carried: excluded from git), .tLABEL
    HEAD's with the patch applied (its docs/ part left out), the TREES string printed; a patch that
    does not apply, or a malformed argument, stops it with a message and a non-zero status."""
    root = Path(__file__).parent.parent
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True, timeout=120)
    shutil.copy(root / "bench" / "patch_trees.sh", clone / "bench")  # the working tree's, committed or not
    setup = clone / "setup.py"
    patch = tmp_path / "change.diff"
    original = setup.read_text()
    setup.write_text(original + "# a change\n")
    (clone / "docs" / "status.md").write_text("a docs change that the trees leave out\n")
    patch.write_text(
        subprocess.run(["git", "diff", "--", "setup.py", "docs"], cwd=clone, capture_output=True, text=True,
                       check=True).stdout
    )  # fmt: skip
    subprocess.run(["git", "checkout", "-q", "setup.py", "docs"], cwd=clone, check=True)

    def run(*args):
        return subprocess.run(["bash", "bench/patch_trees.sh", *args], cwd=clone, capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    ok = run(f"new:{patch}")
    assert ok.returncode == 0, ok.stderr
    assert 'TREES="base:.tbase new:.tnew"' in ok.stdout and '[".tbase"]' in ok.stdout
    assert (clone / ".tbase" / "setup.py").read_text() == original
    assert (clone / ".tnew" / "setup.py").read_text() == original + "# a change\n"
    assert not (clone / ".tnew" / "docs").exists()
    assert "/.tbase/" in (clone / ".git" / "info" / "exclude").read_text()
    assert run("nolabel").returncode == 2
    assert run(f"base:{patch}").returncode == 2
    # Two patches joined by "+": both applied, in order, to one tree; a missing one stops it.
    project = clone / "pyproject.toml"
    project_text = project.read_text()
    project.write_text(project_text + "# a second change\n")
    second = tmp_path / "second.diff"
    second.write_text(
        subprocess.run(["git", "diff", "--", "pyproject.toml"], cwd=clone, capture_output=True, text=True,
                       check=True).stdout
    )  # fmt: skip
    subprocess.run(["git", "checkout", "-q", "pyproject.toml"], cwd=clone, check=True)
    both = run(f"both:{patch}+{second}")
    assert both.returncode == 0, both.stderr
    assert (clone / ".tboth" / "setup.py").read_text() == original + "# a change\n"
    assert (clone / ".tboth" / "pyproject.toml").read_text() == project_text + "# a second change\n"
    assert run(f"both:{patch}+{tmp_path / 'missing.diff'}").returncode == 2
    setup.write_text("something else entirely\n")
    subprocess.run(["git", "commit", "-qam", "moved"], cwd=clone, check=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})  # fmt: skip
    stale = run(f"new:{patch}")
    assert stale.returncode == 1 and "does not apply to HEAD" in stale.stderr


def test_tree_kernel_times_sums_each_kernels_device_time_per_step():
    """bench/tree_kernel_times.py: a kernel's self device time summed over its entries and divided
    by the steps; host-side entries (no device time) left out; rows parsed as B,context,T, over the
    cache format --kv names."""
    import importlib.util
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[1] / "bench" / "tree_kernel_times.py"
    spec = importlib.util.spec_from_file_location("tree_kernel_times", path)
    ktimes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ktimes)
    entry = lambda key, us: SimpleNamespace(key=key, self_device_time_total=us)  # noqa: E731
    averages = [
        entry("attention", 400.0),
        entry("append", 50.0),
        entry("attention", 100.0),
        entry("aten::empty", 0.0),
    ]
    assert ktimes.per_kernel(averages, 10) == {"attention": 50.0, "append": 5.0}
    row = ktimes.row_of("16,1024,64")
    assert (row.batch, row.num_heads, row.num_kv_heads, row.head_dim, row.context, row.nodes) == (
        16,
        32,
        8,
        128,
        1024,
        64,
    )
    with pytest.raises(SystemExit, match="B,context,T"):
        ktimes.row_of("16,1024")
    assert row.kv == "" and ktimes.row_of("1,1024,16", "int8").kv == "int8"  # --kv int8: the int8 twin


def test_source_stalls_joins_the_source_page_with_the_line_table():
    """bench/source_stalls.py: nvdisasm -gi's runs of comment lines give each instruction its chain
    (innermost first), the source page's absolute addresses are moved onto the listing's offsets
    by the operations they agree on, and samples sum per line (innermost, or N from the body)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "source_stalls.py"
    spec = importlib.util.spec_from_file_location("source_stalls", path)
    ss = importlib.util.module_from_spec(spec)
    sys.modules["source_stalls"] = ss  # its dataclasses look their module up
    spec.loader.exec_module(ss)
    listing = "\n".join(
        [
            ".text._Z5otherv:",
            '\t//## File "/x/other.cuh", line 1',
            "        /*0000*/                   EXIT ;",
            ".text._Z6kernelv:",
            '\t//## File "/x/a.cuh", line 10 inlined at "/x/k.cuh", line 5',
            '\t//## File "/x/k.cuh", line 5',
            "        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;",
            "        /*0010*/                   FADD R3, R2, R2 ;",
            '\t//## File "/x/k.cuh", line 7',
            "        /*0020*/               @P0 BRA `(.L_x_1) ;",
        ]
    )
    table = ss.line_table(listing, "_Z6kernelv")
    assert sorted(table) == [0, 16, 32] and table[16][0].chain == (("/x/a.cuh", 10), ("/x/k.cuh", 5))
    assert table[16][0].label() == "a.cuh:10 (in k.cuh:5)" and table[16][0].label(1) == "k.cuh:5"
    assert ss.line_table(listing)[0][1] == "EXIT"  # the first function without a name
    head = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stalled_long_scoreboard"'
    page = "\n".join(
        [
            '"Kernel","_Z6kernelv"',
            head,
            '"0x7f0000001000","LDG.E R2, desc[UR4][R2.64]","2","10","0"',
            '"0x7f0000001010","FADD R3, R2, R2","6","10","5"',
            '"0x7f0000001020","@P0 BRA `(.L_x_1)","4","1","0"',
        ]
    )
    samples = ss.source_rows(page)
    assert [s.samples for s in samples] == [2, 6, 4] and samples[1].reasons == {"stalled_long_scoreboard": 5}
    offset, agree = ss.align(samples, table)
    assert offset == -0x7F0000001000 and agree == 3
    lines = dict(ss.by_source(samples, table, 0, offset))
    assert lines["a.cuh:10 (in k.cuh:5)"].samples == 8 and lines["k.cuh:7"].samples == 4
    assert lines["a.cuh:10 (in k.cuh:5)"].executed == 20
    assert dict(ss.by_source(samples, table, 1, offset))["k.cuh:5"].samples == 8
    text = ss.report(samples, table, top=5)
    assert "agrees on 3 operations" in text and "long_scoreboard 62%" in text
    with pytest.raises(ValueError, match="Address and Source"):
        ss.source_rows('"a","b"\n"1","2"')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_one_chain_error_needs_a_gpu_and_says_so():
    """bench/one_chain_error.py (the kernels' error over one long item) measures only on a GPU;
    elsewhere it says what it needs and exits 2, its arguments parsed first."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "bench/one_chain_error.py", "--kv", "int4", "--keys", "64"], cwd=root,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "needs a CUDA GPU and the built extension" in run.stdout, run.stdout + run.stderr
    bad = subprocess.run([sys.executable, "bench/one_chain_error.py", "--kv", "int5"], cwd=root,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "--kv" in bad.stderr
