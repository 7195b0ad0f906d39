"""Argument parsing for ``python -m mmha.bench``'s entry points: with ``MMHA_BENCH_CHECK_ARGS=1`` a
run parses its arguments and stops there (no GPU needed), so a device script (``bench/ab.sh``,
``bench/ab_trees.sh``) finds a bad argument before it builds anything."""

from __future__ import annotations

import argparse
import os

CHECK_ARGS = "MMHA_BENCH_CHECK_ARGS"


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``ap.parse_args(argv)``; under ``MMHA_BENCH_CHECK_ARGS=1``, exit 0 once they parse."""
    args = ap.parse_args(argv)
    if os.environ.get(CHECK_ARGS) == "1":
        print(f"{ap.prog}: arguments ok")
        raise SystemExit(0)
    return args
