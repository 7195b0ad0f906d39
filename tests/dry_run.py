"""A GPU test module's own code, run on a machine without a GPU: "cuda" devices become the CPU,
``mmha.ops.decode_attention`` / ``decode_tree`` are ``mmha.reference``'s steps (fp32; the
scheduling arguments ignored), ``KVCache(..., "cuda")`` a CPU cache, and the ``gpu`` mark is lifted.
What it finds: mistakes in a test's own Python (arguments, shapes, tolerances against the
reference), before a device call is spent on them. What it cannot: anything of the kernel, or of
the device-side guard (a test that expects a status flag fails here, as it should).

Usage: python tests/dry_run.py tests/test_int8_tree_gpu.py [-k EXPR] [more pytest args]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))


def _cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaAsCpu(TorchFunctionMode):
    """Every torch call's ``device=`` and ``.to("cuda")`` / ``.cuda()`` go to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


_SCHEDULE = ("variant", "num_splits", "stages", "tile_source", "max_len", "workspace", "validate_lengths",
             "validate")  # fmt: skip


def _counts(node_counts):
    return node_counts.tolist() if isinstance(node_counts, torch.Tensor) else node_counts


def install() -> None:
    """Patches mmha and the test helpers (before the test module is imported)."""
    from mmha import cache, ops, reference
    from mmha._constants import ROW_STEP

    def decode_attention(qkv, k, v, lengths, *, return_lse=False, block_tables=None, **kw):
        kw = {n: x for n, x in kw.items() if n not in _SCHEDULE}
        if block_tables is not None:
            out = reference.decode_step_paged(qkv, k, v, block_tables, lengths, return_lse=True, **kw)
        else:
            out = reference.decode_step(qkv, k, v, lengths, return_lse=True, **kw)
        return out if return_lse else out[0]

    def decode_tree(
        qkv, k, v, lengths, parents, *, node_counts=None, return_lse=False, block_tables=None, **kw
    ):
        kw = {n: x for n, x in kw.items() if n not in _SCHEDULE}
        modes = kw.pop("row_active", None)  # every row's mode ROW_STEP is the same step; others: not here
        if modes is not None and not bool((modes == ROW_STEP).all()):
            raise NotImplementedError("dry run: a tree step's row modes other than ROW_STEP")
        kw.update(node_counts=_counts(node_counts), return_lse=True)
        if block_tables is not None:
            out = reference.decode_tree_paged(qkv, k, v, block_tables, lengths, parents, **kw)
        else:
            out = reference.decode_tree(qkv, k, v, lengths, parents, **kw)
        return out if return_lse else out[0]

    ops.decode_attention, ops.decode_tree = decode_attention, decode_tree
    base = cache.KVCache

    class KVCache(base):
        def __init__(self, *args, **kw):
            super().__init__(*(_cpu(a) for a in args), **{n: _cpu(x) for n, x in kw.items()})

    cache.KVCache = KVCache
    torch.cuda.synchronize = lambda *a, **k: None
    import helpers

    make_case = helpers.make_case

    def cpu_case(*args, **kw):
        kw["device"] = "cpu"
        return make_case(*args, **kw)

    helpers.make_case = cpu_case
    helpers.gpu = pytest.mark.dry_run


class _Plugin:
    """Holds the device mode around each test's call and silences the reference path's warning."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        with CudaAsCpu(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return (yield)


def main(argv: list[str]) -> int:
    install()
    return pytest.main(["-p", "no:cacheprovider", "-q", *argv], plugins=[_Plugin()])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
