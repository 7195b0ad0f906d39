"""tests/gpu_call.sh's orchestration, with stand-ins for nvidia-smi and compute-sanitizer: a build
whose sources did not change is reused, the sanitizers' summary lines and pytest's outcome reach
the summary, a sanitizer run past the call's deadline is stopped (its processes too), the logs
are packed either way, and the tests a deadline cut off are listed (tests/unreached.py) and run
by the next call with REST=1."""

import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.skipif(shutil.which("md5sum") is None or shutil.which("setsid") is None,
                                reason="needs md5sum and setsid")  # fmt: skip


# gpu_call.sh's own knobs: a suite run under REST=1, SAN=0 or a short CALL_BUDGET must not pass
# them on to the stand-in calls below.
_KNOBS = {"MMHA_KERNELS", "REST", "SAN", "TESTS", "TIER", "CASES", "CALL_BUDGET", "WORKERS", "WORK", "OUT"}


def _stamp(kernels: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MMHA_KERNELS"}
    if kernels is not None:
        env["MMHA_KERNELS"] = kernels
    run = subprocess.run(
        ["bash", "tests/gpu_call.sh", "--stamp"], cwd=ROOT, capture_output=True, text=True, env=env
    )
    return run.stdout.strip()


def _call(
    tmp_path: Path, sanitizer_sleep: int, budget: int, rest: list[str] | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    """One call on test_layout.py (serial: WORKERS=0); ``rest``: node ids a former call on this
    machine left in its logs' unrun.txt, run with REST=1."""
    bin_dir, work, out = tmp_path / "bin", tmp_path / "work", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'Stand-in GPU, 0, 0 MiB'\n")
    (bin_dir / "compute-sanitizer").write_text(
        f"#!/bin/sh\nsleep {sanitizer_sleep}\necho '========= ERROR SUMMARY: 0 errors'\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    work.mkdir()
    (work / ".built").write_text(_stamp() + "\n")  # as if this machine had built these sources
    base = {k: v for k, v in os.environ.items() if k not in _KNOBS}  # as _stamp() stamped it
    env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "WORK": str(work), "OUT": str(out),
           "CALL_BUDGET": str(budget), "WORKERS": "0"}  # fmt: skip
    if rest is not None:
        logs = Path(f"{work}_logs")
        logs.mkdir()
        (logs / "unrun.txt").write_text("".join(f"{t}\n" for t in rest))
        env["REST"] = "1"
    run = subprocess.run(
        ["bash", "tests/gpu_call.sh", "tests/test_layout.py"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=budget + 60,
    )  # fmt: skip
    return run, out / "gpu_call.tgz"


def _members(tgz: Path) -> set[str]:
    with tarfile.open(tgz) as t:
        return {m.name.lstrip("./") for m in t.getmembers()}


def test_a_reused_build_runs_tests_and_sanitizers(tmp_path):
    run, tgz = _call(tmp_path, 0, 120)
    assert "build: reused" in run.stdout
    assert "sanitizer memcheck: rc=0" in run.stdout and "suite: passed" in run.stdout
    assert "pytest: rc=0" in run.stdout and "pytest: 10 passed" in run.stdout
    assert "pytest: 0 of 10 collected tests not reached" in run.stdout
    assert {"summary.txt", "pytest.log", "san/summary.txt", "unrun.txt"} <= _members(tgz)


def test_rest_runs_the_tests_the_last_call_left(tmp_path):
    left = ["tests/test_layout.py::test_write_k_and_v_touch_only_their_slots",
            "tests/test_layout.py::test_pack_rejects_too_long_sequences"]  # fmt: skip
    run, _ = _call(tmp_path, 0, 120, rest=left)
    assert "pytest: REST=1, 2 tests left by the last call" in run.stdout
    assert "pytest: 2 passed" in run.stdout and "pytest: 0 of 2 collected tests not reached" in run.stdout
    (tmp_path / "again").mkdir()
    run, _ = _call(tmp_path / "again", 0, 120, rest=[])
    assert "pytest: nothing to run" in run.stdout and "pytest: rc=" not in run.stdout


def test_unreached_lists_the_collected_tests_without_an_outcome():
    from unreached import unreached

    collected = "\n".join([
        "tests/test_a.py::test_one",
        "tests/test_a.py::test_two[single_pass-(8, 8)]",
        "tests/test_b.py::test_three",
        "tests/test_b.py::test_four",
        "",
        "4 tests collected in 1.00s",
    ])  # fmt: skip
    xdist = "\n".join([
        "[gw0] [ 25%] PASSED tests/test_a.py::test_one ",
        "[gw1] [ 50%] FAILED tests/test_a.py::test_two[single_pass-(8, 8)] ",
        "FAILED tests/test_b.py::test_four - AssertionError",  # a summary line is no outcome
    ])  # fmt: skip
    assert unreached(collected, xdist) == ["tests/test_b.py::test_three", "tests/test_b.py::test_four"]
    serial = "tests/test_b.py::test_three SKIPPED (no GPU)                      [ 75%]\n"
    serial += "tests/test_a.py::test_two[single_pass-(8, 8)] PASSED            [ 50%]\n"
    assert unreached(collected, serial) == ["tests/test_a.py::test_one", "tests/test_b.py::test_four"]


def test_sanitizers_past_the_deadline_are_stopped(tmp_path):
    start = time.time()
    run, tgz = _call(tmp_path, 600, 25)
    assert time.time() - start < 120
    assert "sanitizers: cut off" in run.stdout
    assert "summary.txt" in _members(tgz)
    busy = subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True, text=True).stdout.split()
    assert not busy, "a stand-in sanitizer outlived the call"


def test_a_build_of_other_kernel_sets_is_not_reused():
    """The stamp covers MMHA_KERNELS: a slim build is never taken for a whole one, nor one slim
    build for another."""
    whole, fp16, both = _stamp(), _stamp("fp16"), _stamp("fp16,fp16_s8")
    assert len({whole, fp16, both}) == 3 and all(len(s) == 32 for s in (whole, fp16, both))
    assert _stamp("fp16") == fp16


def test_the_kernel_tier_leaves_out_existing_end_to_end_files_and_a_bad_tier_stops_first(tmp_path):
    """TIER=kernels leaves out the files of tests/end_to_end.txt, each of which exists and is not
    a kernel test file; any other TIER stops the call before its build, naming the knob."""
    listed = [
        s for s in (ROOT / "tests/end_to_end.txt").read_text().splitlines() if s and not s.startswith("#")
    ]
    assert listed and all((ROOT / f).is_file() for f in listed)
    assert not {"tests/test_ops_gpu.py", "tests/test_tree_gpu.py", "tests/test_paging_gpu.py"} & set(listed)
    env = {**{k: v for k, v in os.environ.items() if k not in _KNOBS}, "TIER": "fast", "OUT": str(tmp_path)}
    run = subprocess.run(["bash", "tests/gpu_call.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 2 and "TIER must be all or kernels, got fast" in run.stderr
    assert not (tmp_path / "gpu_call.tgz").exists()
