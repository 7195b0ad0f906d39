"""Slim a copy of a source tree for a quick diagnostic build: the kernel instantiations of the sets
not kept (and, with --head-dims, of the head dims not kept) become stubs, so the build compiles
only the kept kernels (an A/B of fp16 rows builds a fifth of the kernels; of fp16 rows at head dim
128, 3 of the 17 fp16 files). Works on trees from before setup.py's MMHA_KERNELS (bench/ab.sh
slims its BASE copy this way, bench/ab_trees.sh every tree; the working tree uses MMHA_KERNELS).

A stub file defines each explicit instantiation it replaces as an explicit specialization that
launches nothing: ``launch_decode_attention`` returns cudaErrorNotSupported and
``decode_attention_blocks_per_sm`` 0, so the dispatch links and a step of a left-out set fails
with "operation not supported". Only for throwaway copies: the files are rewritten in place.

Usage: python bench/slim_tree.py TREE [--keep fp16 [fp16_e4m3 ...]] [--head-dims 128 ...]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# One explicit instantiation line of a generated file (csrc/kernels/generate.py).
INSTANTIATION = re.compile(r"^template (cudaError_t|int) (\w+)<(.+)>\((.*)\);$")
STUB_HEAD = """// A stub of bench/slim_tree.py (a diagnostic build leaves this kernel set out).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../decode_launch.h"
#include "../vec.cuh"

namespace mmha {
"""


def kernel_set_of(path: Path) -> str:
    """An instantiation file's kernel set, as setup.py names it: decode_wide_fp16_e4m3_hd64 -> fp16_e4m3."""
    return path.stem.removeprefix("decode_").removeprefix("wide_").rsplit("_hd", 1)[0]


def head_dim_of(path: Path) -> int:
    """An instantiation file's head dim: decode_fp16_hd128_lean -> 128, decode_wide_bf16_s8_hd64 -> 64."""
    return int(path.stem.rsplit("_hd", 1)[1].split("_")[0])


def stub_of(text: str) -> str:
    """The stub that replaces one generated instantiation file's text."""
    body = []
    for line in text.splitlines():
        m = INSTANTIATION.match(line.strip())
        if not m:
            continue
        ret, name, args, params = m.groups()
        value = "cudaErrorNotSupported" if ret == "cudaError_t" else "0"
        body.append(f"template <>\n{ret} {name}<{args}>({params}) {{\n  return {value};\n}}")
    if not body:
        raise ValueError("no explicit instantiations found")
    return STUB_HEAD + "\n".join(body) + "\n}  // namespace mmha\n"


def slim(tree: Path, keep: list[str] | None, head_dims: list[int] | None = None) -> list[Path]:
    """Rewrite the instantiation files of ``tree`` whose set is not in ``keep`` (None: every set)
    or (given ``head_dims``) whose head dim is not in it; returns them."""
    files = sorted((tree / "csrc" / "kernels" / "instantiations").glob("*.cu"))
    if not files:
        raise FileNotFoundError(f"{tree}: no csrc/kernels/instantiations/*.cu")
    sets = {kernel_set_of(p) for p in files}
    keep = sorted(sets) if keep is None else keep
    unknown = sorted(set(keep) - sets)
    if unknown:
        raise ValueError(f"--keep: no kernel sets {unknown} in {tree} (it has {', '.join(sorted(sets))})")
    dims = {head_dim_of(p) for p in files}
    unknown_dims = sorted(set(head_dims or []) - dims)
    if unknown_dims:
        raise ValueError(f"--head-dims: no head dims {unknown_dims} in {tree} (it has {sorted(dims)})")

    def kept(p: Path) -> bool:
        return kernel_set_of(p) in keep and (not head_dims or head_dim_of(p) in head_dims)

    stubbed = [p for p in files if not kept(p)]
    for p in stubbed:
        p.write_text(stub_of(p.read_text()))
    return stubbed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path)
    ap.add_argument("--keep", nargs="+", help="kernel sets to build (fp16, bf16_e4m3, ...; default: all)")
    ap.add_argument("--head-dims", nargs="+", type=int, help="head dims to build (default: all)")
    args = ap.parse_args(argv)
    stubbed = slim(args.tree, args.keep, args.head_dims)
    sets = ", ".join(args.keep) if args.keep else "every kernel set"
    dims = f" at head dims {', '.join(map(str, args.head_dims))}" if args.head_dims else ""
    print(f"slim_tree: {len(stubbed)} instantiation files stubbed, kept {sets}{dims}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
