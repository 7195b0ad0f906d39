"""The measurement programs under bench/probes build (they run on a GPU machine; see each file's
head for how)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

PROBES = sorted((Path(__file__).resolve().parents[1] / "bench" / "probes").glob("*.cu"))


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else shutil.which("nvcc")


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe_builds_for_sm90(probe, tmp_path):
    cmd = [nvcc(), "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-o", str(tmp_path / "probe"),
           str(probe)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "warning" not in done.stderr.lower(), done.stderr[-2000:]
