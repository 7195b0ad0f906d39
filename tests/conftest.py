import sys
from pathlib import Path

# Tests import their helpers as a plain module.
sys.path.insert(0, str(Path(__file__).parent))


import warnings  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def no_reference_warning():
    """Silences KVCache's one-time warning that a CPU cache runs the reference path (modules that
    build CPU caches on purpose use it: ``pytestmark = pytest.mark.usefixtures(...)``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
