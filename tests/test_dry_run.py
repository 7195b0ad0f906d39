"""tests/dry_run.py keeps working: a GPU test module's own code passes on the CPU with the
reference standing in for the kernel, and a test that needs the kernel fails there."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _dry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "dry_run.py"), *args], cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def test_a_gpu_module_runs_on_the_cpu():
    run = _dry("tests/test_int8_gpu.py", "-k", "kernel_matches_int8_reference and -64- and dtype0", "-rA")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count("PASSED") == 2  # splits 1 and 3


def test_what_needs_the_kernel_fails_there():
    run = _dry("tests/test_int8_gpu.py", "-k", "non_finite_new_token and nan-k")
    assert run.returncode == 1, run.stdout[-2000:]
