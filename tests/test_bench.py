"""The benchmark's bookkeeping (mmha/bench.py summarize/table, bench/make_docs.py verdicts), on
synthetic results: no GPU needed. The timing itself only runs on a device."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from mmha.bench import Config, Result, summarize, table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
make_docs = pytest.importorskip("make_docs")

CEILING = 4000.0  # GB/s


def result(cfg: Config, mmha_us: float, peer_us: float, floor: dict | None = None) -> Result:
    res = Result(cfg)
    res.times_us = {"mmha": mmha_us, "sdpa_cudnn": peer_us, "eager": 10 * peer_us}
    res.graph_us = {"mmha": 0.8 * mmha_us, "sdpa_cudnn": 0.8 * peer_us}
    res.plan = "split/4"
    res.floor = floor or {}
    return res


def test_summarize_reports_the_read_floor_against_the_same_ceiling():
    cfg = Config("t", 64, 32, 8, 128, 1024, "fp16")  # 268 MB of K/V
    row = summarize(result(cfg, 80.0, 76.0, {"us": 71.5, "graph_us": 61.5, "shape": "x"}), CEILING)
    assert row["best_peer"] == "sdpa_cudnn"
    assert row["speedup"] == pytest.approx(76.0 / 80.0)
    assert row["read_floor_us"] == 71.5
    assert row["read_floor_graph_us"] == 61.5
    kv_gbs = cfg.kv_bytes / 71.5e-6 / 1e9
    assert row["pct_ceiling_floor"] == pytest.approx(100 * kv_gbs / CEILING)
    assert row["pct_ceiling_floor_graph"] == pytest.approx(100 * cfg.kv_bytes / 61.5e-6 / 1e9 / CEILING)
    assert row["pct_ceiling"] == pytest.approx(100 * cfg.step_bytes / 80e-6 / 1e9 / CEILING)


def test_summarize_without_a_floor_leaves_it_unknown():
    row = summarize(result(Config("t", 1, 32, 32, 128, 1024, "fp16"), 16.0, 16.4), CEILING)
    assert math.isnan(row["read_floor_us"]) and math.isnan(row["pct_ceiling_floor"])


def test_table_has_the_floor_columns():
    cfg = Config("t", 64, 32, 8, 128, 1024, "fp16")
    rows = [summarize(result(cfg, 80.0, 76.0, {"us": 71.5, "graph_us": 61.5, "shape": "x"}), CEILING)]
    header = {"gpu": "G", "torch": "t", "cuda": "c", "ceiling_gbs": CEILING, "ceiling_how": "h"}
    text = table(rows, header)
    head, sep, body = text.split("\n")[2:5]
    cols = [c.strip() for c in head.strip("|").split("|")]
    vals = [c.strip() for c in body.strip("|").split("|")]
    assert vals[cols.index("read floor")] == "71.5"
    assert vals[cols.index("floor graph")] == "61.5"
    # A JSON row from before the floor existed still renders.
    old = {k: v for k, v in rows[0].items() if "floor" not in k}
    assert "| -" in table([old], header).split("\n")[-1]


def row_for(cfg: Config, mmha_us: float, peer_us: float, floor_us: float, floor_graph_us: float) -> dict:
    floor = {"us": floor_us, "graph_us": floor_graph_us, "shape": "x"}
    return summarize(result(cfg, mmha_us, peer_us, floor), CEILING)


def test_verdict_says_when_a_ceiling_target_is_beyond_a_pure_read():
    cfg = Config("t", 64, 32, 8, 128, 1024, "fp16")  # 268 MB: >= 92 % of the ceiling asked
    ideal_us = cfg.kv_bytes / (CEILING * 1e3)
    below = row_for(cfg, ideal_us / 0.75, ideal_us / 0.74, ideal_us / 0.83, ideal_us / 0.96)
    (line,) = make_docs.verdicts([below])
    assert "< 92% of ceiling (a pure read of these bytes reaches 83%: beyond any kernel" in line
    above = row_for(cfg, ideal_us / 0.75, ideal_us / 0.74, ideal_us / 0.95, ideal_us / 0.97)
    (line,) = make_docs.verdicts([above])
    assert "(a pure read reaches 95%)" in line and "beyond" not in line


def test_verdict_on_small_rows_names_the_target_and_the_floor():
    cfg = Config("t", 1, 32, 32, 128, 1024, "fp16")  # 16.8 MB: <= 0.7x the best peer asked
    (line,) = make_docs.verdicts([row_for(cfg, 16.0, 16.0, 9.3, 3.6)])
    assert "needs <= 0.7x best peer, is 1.00x (0.7x is 11.2 us; a pure read of these bytes takes 9.3)" in line


def test_verdict_met_and_old_rows():
    cfg = Config("t", 16, 32, 32, 128, 8192, "fp16")  # 2.1 GB
    ideal_us = cfg.kv_bytes / (CEILING * 1e3)
    row = row_for(cfg, ideal_us / 0.95, ideal_us / 0.94, ideal_us / 0.99, ideal_us / 0.995)
    assert make_docs.verdicts([row]) == ["| fp16 B16 Hq32 Hkv32 D128 S8192 | met |"]
    old = {k: v for k, v in row.items() if "floor" not in k}
    old["pct_ceiling"] = 90.0
    (line,) = make_docs.verdicts([old])
    assert line.endswith("90.0% < 92% of ceiling |")


def test_floor_sentence_comes_from_the_run():
    cfg = Config("t", 64, 32, 8, 128, 1024, "fp16")
    ideal_us = cfg.kv_bytes / (CEILING * 1e3)
    row = row_for(cfg, 80.0, 76.0, ideal_us / 0.83, ideal_us / 0.963)
    text = make_docs.floor_sentence([row])
    assert text.startswith("In this run a pure read of 268 MB reached 83.0 % of the ceiling cold and 96.3 %")
    assert make_docs.floor_sentence([]) == ""
