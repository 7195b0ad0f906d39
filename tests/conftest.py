import sys
from pathlib import Path

# Tests import their helpers as a plain module.
sys.path.insert(0, str(Path(__file__).parent))


import os  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (tests/gpu_call.sh runs 12 workers on a 16-core machine) every worker's CPU
# ops (the reference path, the CPU caches the GPU tests compare with) would take every core: 12
# processes of 16 threads each, where a CPU-heavy test then runs many times slower. A worker takes
# its share of the cores instead.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture
def no_reference_warning():
    """Silences KVCache's one-time warning that a CPU cache runs the reference path (modules that
    build CPU caches on purpose use it: ``pytestmark = pytest.mark.usefixtures(...)``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
