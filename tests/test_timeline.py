"""The per-block timeline (mmha.bench.timeline, csrc/kernels/timeline.cuh): its summary of event
buffers, the refusal of builds without the events, and the diagnostic build's device code."""

import os
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from mmha._ext import _C
from mmha.bench import timeline as tl

ROOT = Path(__file__).resolve().parents[1]


def events(rows: list[dict]) -> torch.Tensor:
    """An event buffer: one row per block, ns, zeros where not given (and spare rows)."""
    buf = torch.zeros(len(rows) + 2, len(tl.EVENTS), dtype=torch.int64)
    for i, r in enumerate(rows):
        for name, t in r.items():
            buf[i, tl.EVENTS.index(name)] = t
    return buf


def block(t0: int, **later: int) -> dict:
    """A block that starts at t0 and stamps every event at t0 + the given offsets (ns)."""
    steps = dict(decided=600, first_issued=1000, first_landed=3000, last_landed=43000, last_attended=43500,
                 combined=44000, out_stored=44700, appended=45000, item_done=45200, consumers_done=45300,
                 producer_done=44000)  # fmt: skip
    steps.update(later)
    return {"start": t0, **{k: t0 + v for k, v in steps.items()}}


def test_launch_summary_phases():
    b0 = block(10_000)
    b1 = block(10_100, last_landed=47000, last_attended=47500, combined=48000, out_stored=48700, appended=49000,
               item_done=49200, consumers_done=49300)  # fmt: skip
    idle = {
        "start": 10_200,
        "consumers_done": 10_200 + 500,
        "producer_done": 10_200 + 600,
    }  # first item: nothing to read
    s = tl.launch_summary(events([b0, b1, idle]))
    assert s["blocks"] == 3
    assert s["start_ns"] == 10_000
    assert s["end_ns"] == 10_100 + 49300
    assert s["span_us"] == pytest.approx(49.4)
    assert s["end_spread_us"] == pytest.approx((10_100 + 49300 - (10_200 + 600)) / 1e3)
    p = s["phases"]
    assert p["start after the launch's first block"] == (pytest.approx(0.1), pytest.approx(0.2), 3)
    assert "entered -> first item decided" not in p  # no block stamped its first instruction
    assert p["start -> first copies issued"] == (
        pytest.approx(1.0),
        pytest.approx(1.0),
        2,
    )  # not the idle one
    assert p["first -> last tile landed"][0] == pytest.approx(42.0)  # median of 40 and 44
    assert p["first -> last tile landed"][1] == pytest.approx(44.0)
    assert p["combined -> out stored"] == (pytest.approx(0.7), pytest.approx(0.7), 2)
    assert p["out stored -> token appended"] == (pytest.approx(0.3), pytest.approx(0.3), 2)
    assert p["appended -> item done (merge)"][0] == pytest.approx(0.2)


def test_the_second_item_has_phases_of_its_own():
    # Block 0 runs two items, the second's events at kTlSecond + e; block 1 one item: the second
    # item's phases come from block 0 alone, and the first item's are as before.
    t0 = 10_000
    second = dict(second_first_issued=44_000, second_header_seen=45_300, second_q_built=45_800,
                  second_first_landed=46_500, second_last_landed=49_000, second_last_attended=49_400,
                  second_combined=49_600, second_out_stored=50_200, second_appended=50_400,
                  second_item_done=50_500)  # fmt: skip
    b0 = {**block(t0, consumers_done=50_600), **{k: t0 + v for k, v in second.items()}}
    b1 = block(t0 + 100)
    p = tl.launch_summary(events([b0, b1]))["phases"]
    assert p["first item done -> second header seen"] == (pytest.approx(0.1), pytest.approx(0.1), 1)
    assert p["second: issued -> first tile landed"] == (pytest.approx(2.5), pytest.approx(2.5), 1)
    assert p["  second: header -> q built"][0] == pytest.approx(0.5)
    assert p["  second: q built -> first tile landed"][0] == pytest.approx(0.7)
    assert p["second: first -> last tile landed"][0] == pytest.approx(2.5)
    assert p["second: combined -> out stored"][0] == pytest.approx(0.6)
    assert p["second: appended -> item done"][0] == pytest.approx(0.1)
    assert p["first -> last tile landed"] == (pytest.approx(40.0), pytest.approx(40.0), 2)
    assert len(tl.EVENTS) == 2 * len(tl.FIRST_EVENTS)


def test_the_first_tile_wait_split_by_the_consumers_events():
    # Consumers see the header 0.6 us after the first copies, have q 0.8 us later, the tile 0.6 after.
    b0 = block(10_000, header_seen=1600, q_built=2400)
    wide = block(10_050)  # wide items stamp neither event: left out of those phases
    p = tl.launch_summary(events([b0, wide]))["phases"]
    assert p["issued -> first tile landed"][2] == 2
    assert p["  issued -> consumers see the header"] == (pytest.approx(0.6), pytest.approx(0.6), 1)
    assert p["  header -> q (and tree nodes) built"] == (pytest.approx(0.8), pytest.approx(0.8), 1)
    assert p["  q built -> first tile landed"] == (pytest.approx(0.6), pytest.approx(0.6), 1)


def role(split: int, owner: bool = False, merged: bool = False, grains: int = 1) -> int:
    """timeline_role (csrc/kernels/timeline.cuh): the "role" event's value."""
    return 1 | split << 1 | int(owner) << 8 | int(merged) << 9 | grains << 10


def test_roles_split_owners_from_the_rest_and_the_merge_phases():
    # Two splits end at 45.2 us; the owner (split 2, one grain) ends at 49.2 us after merging:
    # counted 0.6 us after its append, weights 0.8 later, its first sums 1.2 after that.
    rest = [{**block(10_000), "role": role(s, grains=2)} for s in (0, 1)]  # a value, not a time
    owner = {**block(10_000, item_done=49_200, counted=45_600, weighed=46_400, summed=47_600),
             "role": role(2, owner=True, merged=True)}  # fmt: skip
    s = tl.launch_summary(events([*rest, owner]))
    roles = s["roles"]
    assert roles["owner"]["blocks"] == 1 and roles["owner"]["split"] == 2 and roles["owner"]["grains"] == 1
    assert roles["owner"]["done_us"] == (pytest.approx(49.2), pytest.approx(49.2))
    assert roles["other"]["blocks"] == 2 and roles["other"]["grains"] == 2
    assert roles["other"]["done_us"] == (pytest.approx(45.2), pytest.approx(45.2))
    assert roles["merged"]["split"] == 2
    p = s["phases"]
    assert p["  appended -> arrival counted"] == (pytest.approx(0.6), pytest.approx(0.6), 1)
    assert p["    counted -> weights (merging block)"] == (pytest.approx(0.8), pytest.approx(0.8), 1)
    assert p["    weights -> first sums"] == (pytest.approx(1.2), pytest.approx(1.2), 1)
    text = tl.format_row("tree 1,1024,4", "16x2", 17.6, tl.row_summary([s, s]))
    assert "owner items done after the start" in text and "(1 blocks, 1 grains, split 2)" in text


def test_owner_items_have_phases_of_their_own():
    # Two other blocks land their first tile 2 us after issuing it; the owner 3.5 us after (its
    # nodes built first): the medians over all three blocks and over the owner alone.
    rest = [{**block(10_000), "role": role(s, grains=2)} for s in (0, 1)]
    owner = {**block(10_000, first_landed=4_500), "role": role(2, owner=True)}
    s = tl.launch_summary(events([*rest, owner]))
    assert s["roles"]["owner"]["phases"]["issued -> first tile landed"] == (
        pytest.approx(3.5), pytest.approx(3.5), 1)  # fmt: skip
    row = tl.row_summary([s, s])["phases"]["issued -> first tile landed"]
    assert row == {
        "median_us": pytest.approx(2.0),
        "max_us": pytest.approx(3.5),
        "owners_us": pytest.approx(3.5),
    }
    text = tl.format_row("tree 1,1024,4", "9x2", 12.3, tl.row_summary([s, s]))
    assert "owners us" in text
    # One-token rows have no owner items: no column.
    plain = tl.launch_summary(events(rest))
    assert "owners_us" not in tl.row_summary([plain])["phases"]["issued -> first tile landed"]
    assert "owners us" not in tl.format_row("16,32,8,128,2048", "1x2", 20.0, tl.row_summary([plain]))


def test_main_needs_rows_or_tree_rows():
    with pytest.raises(SystemExit):
        tl.main([])


def test_launch_summary_refuses_an_empty_buffer():
    with pytest.raises(ValueError, match="MMHA_TIMELINE=1"):
        tl.launch_summary(torch.zeros(4, len(tl.EVENTS), dtype=torch.int64))


def test_row_summary_gaps_and_medians():
    first = tl.launch_summary(events([block(1), block(101)]))
    second = tl.launch_summary(events([block(47_000), block(47_050)]))
    third = tl.launch_summary(events([block(94_000), block(94_000)]))
    s = tl.row_summary([first, second, third])
    assert s["launches"] == 3
    assert s["gap_us"] == pytest.approx(statistics.median([(47_000 - 45_401) / 1e3, (94_000 - 92_350) / 1e3]))
    assert s["phases"]["issued -> first tile landed"]["median_us"] == pytest.approx(2.0)
    text = tl.format_row("16,32,8,128,2048", "1x3", 52.5, s)
    assert "gap to the next launch" in text and "issued -> first tile landed" in text
    assert "outside them" not in text


def test_replay_summary_time_outside_the_blocks():
    first = tl.launch_summary(events([block(1_000), block(1_100)]))
    second = tl.launch_summary(events([block(47_000)]))
    r = tl.replay_summary([first, second], replay_us=100.0)
    assert r["blocks_us"] == pytest.approx((47_000 + 45_300 - 1_000) / 1e3)
    assert r["outside_us"] == pytest.approx(100.0 - r["blocks_us"])
    s = tl.row_summary([first, second])
    s.update(replay=r, replay_median_us=101.0)
    assert "outside them" in tl.format_row("1,32,8,128,4096", "16x3", 14.0, s)


@pytest.mark.skipif(_C is None, reason="extension not built")
def test_a_build_without_events_refuses_a_buffer():
    if _C.timeline_built():
        pytest.skip("this is a timeline build")
    assert _C.TIMELINE_EVENTS == len(tl.EVENTS)
    with pytest.raises(RuntimeError, match="MMHA_TIMELINE=1"):
        _C.set_timeline(torch.zeros(8, len(tl.EVENTS), dtype=torch.int64))
    _C.set_timeline(None)  # stopping is always fine
    assert tl.main(["1,32,8,128,4096"]) == 2  # says how to build one, runs nothing
    assert tl.main(["--tree", "1,1024,4"]) == 2


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else shutil.which("nvcc")


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
@pytest.mark.parametrize("timeline", [False, True], ids=["default", "MMHA_TIMELINE"])
@pytest.mark.parametrize("unit", ["decode_fp16_hd32", "decode_wide_fp16_hd32"], ids=["narrow", "wide"])
def test_device_code_has_events_only_in_the_diagnostic_build(timeline, unit, tmp_path):
    """Both kinds of kernel unit (narrow items, and tree steps' wide items) have events only in the
    diagnostic build. Unoptimised PTX (-Xcicc -O0, a third of -O3's time): code the optimiser would
    drop still shows, so the default build's check is the stricter for it."""
    from torch.utils.cpp_extension import include_paths

    src = ROOT / "csrc" / "kernels" / "instantiations" / f"{unit}.cu"
    cmd = [nvcc(), "-Xcicc", "-O0", "--expt-relaxed-constexpr", "-std=c++17",
           *(f"-I{p}" for p in include_paths()), f"-I{ROOT / 'csrc'}", "-gencode",
           "arch=compute_90a,code=compute_90a", "-ptx", str(src), "-o", str(tmp_path / "k.ptx"),
           *(["-DMMHA_TIMELINE"] if timeline else [])]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ptx = (tmp_path / "k.ptx").read_text()
    assert ("%globaltimer" in ptx) == timeline


def test_the_node_build_the_patch_and_the_merges_put_off_have_phases():
    # An owner: its nodes built 0.9 us after the header (its q 1.2), its one tile's nodes patched
    # 0.3 us after the tile landed and attended 0.5 after that; the merges it put off begin after
    # its item and end with its consumers. A block that stamps none of them adds nothing.
    owner = {**block(10_000, header_seen=1_500, nodes_built=2_400, q_built=2_700, last_landed=43_000,
                     patched=43_300, last_attended=43_800, merges_begin=45_250, consumers_done=47_250),
             "role": role(2, owner=True)}  # fmt: skip
    other = {**block(10_000), "role": role(0, grains=2)}
    p = tl.launch_summary(events([owner, other]))["phases"]
    assert p["    header -> nodes built (owners, thread 0)"] == (pytest.approx(0.9), pytest.approx(0.9), 1)
    assert p["  last tile landed -> new slots patched"] == (pytest.approx(0.3), pytest.approx(0.3), 1)
    assert p["  patched -> attended"] == (pytest.approx(0.5), pytest.approx(0.5), 1)
    assert p["  merges put off: begin -> consumers done"] == (pytest.approx(2.0), pytest.approx(2.0), 1)


def test_an_earlier_replays_stamp_is_not_a_phase():
    # The buffer is zeroed once before the replays: a block that merged in an earlier replay and
    # not in the last one still holds that replay's merges_begin, ~2 ms before its start.
    merged = {**block(5_000_000, merges_begin=45_250, consumers_done=47_250), "role": role(2)}
    stale = {**block(5_000_000), "merges_begin": 3_000_000, "weighed": 3_000_100, "role": role(2)}
    s = tl.launch_summary(events([merged, stale]))
    assert s["phases"]["  merges put off: begin -> consumers done"] == (pytest.approx(2.0), pytest.approx(2.0), 1)
    assert "    counted -> weights (merging block)" not in s["phases"]
    assert s["roles"]["other"]["blocks"] == 2  # the role bits are kept as they are
