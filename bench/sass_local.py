"""The SASS of kernel instantiation units, built and read on a machine without a GPU.

Each unit (a file of csrc/kernels/instantiations, by name or path) is compiled for sm_90a as
setup.py compiles it (``-O3 -lineinfo --expt-relaxed-constexpr``, torch's and csrc's includes),
to a cubin with ptxas's report, then disassembled; one row per kernel: its registers and spill
bytes (ptxas), its instructions, and the counts of the opcodes that mark a tile loop's cost (HGMMA
/ HMMA products, LDL / STL local-memory traffic, R2UR moves into uniform registers, S2R reads of
the cluster CTA id that each generic -> shared address conversion costs). ``--tree DIR`` reads
another source tree (e.g. one of bench/patch_trees.sh's .t* trees, or ``git archive REV csrc``
unpacked), so two forms of a change compare without a device; ``--listing DIR`` keeps each unit's
disassembly there.

The disassembler: ``$NVDISASM``, else ``nvdisasm`` on PATH or in the toolkit's bin/. A toolkit
without it can take the one of the ``nvidia-cuda-nvdisasm`` wheel (``pip download --no-deps
nvidia-cuda-nvdisasm -d DIR``, unzip it, ``NVDISASM=DIR/nvidia/cu13/bin/nvdisasm``); any release
as new as the compiler reads its cubins.

Usage: python bench/sass_local.py decode_wide_fp16_hd128 [--tree .tbase] [--kernel TileSourceE2]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from source_stalls import _ADDR, _FUNC  # nvdisasm's listing: a function's section, an instruction
from source_stalls import opcode as operation

ROOT = Path(__file__).resolve().parents[1]
MARKS = ("HGMMA", "HMMA", "LDL", "STL", "R2UR")  # opcodes counted per kernel (S2R of SR_CgaCtaId apart)
PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
PTXAS_PROPERTIES = re.compile(r"Function properties for (\w+)")
PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """ptxas -v's report: per entry function, registers and spill store / load bytes."""
    out: dict[str, dict[str, int]] = {}
    entry = props = None  # the entry being compiled; the function whose properties follow
    for line in text.splitlines():
        if m := PTXAS_ENTRY.search(line):
            entry = m.group(1)
            out[entry] = {}
        elif m := PTXAS_PROPERTIES.search(line):
            props = m.group(1)
        elif (m := PTXAS_SPILL.search(line)) and props in out:
            out[props]["spill_stores"], out[props]["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif (m := PTXAS_REGS.search(line)) and entry is not None:
            out[entry]["registers"] = int(m.group(1))
    return out


def opcode(instruction: str) -> str:
    """The opcode of one SASS instruction, without its predicate and modifiers."""
    return operation(instruction).split(".")[0]


def parse_listing(text: str) -> dict[str, Counter]:
    """nvdisasm's listing: per kernel (its .text.NAME section), opcode counts; "S2R_CGA" counts
    the reads of SR_CgaCtaId (S2R and S2UR) and "instructions" the kernel's instructions."""
    out: dict[str, Counter] = {}
    current = None
    for line in text.splitlines():
        if m := _FUNC.match(line.strip()):
            current = m.group(1)
            out[current] = Counter()
            continue
        m = _ADDR.search(line)
        if current is None or not m:
            continue
        ins = m.group(2)
        counts = out[current]
        counts["instructions"] += 1
        counts[opcode(ins)] += 1
        if "SR_CgaCtaId" in ins:
            counts["S2R_CGA"] += 1
    return out


def find_disassembler() -> str:
    for candidate in (os.environ.get("NVDISASM"), shutil.which("nvdisasm")):
        if candidate and Path(candidate).exists():
            return candidate
    nvcc = shutil.which("nvcc")
    if nvcc and (Path(nvcc).parent / "nvdisasm").exists():
        return str(Path(nvcc).parent / "nvdisasm")
    sys.exit("sass_local.py: no nvdisasm (set NVDISASM; this file's head says where to get one)")


def unit_path(tree: Path, unit: str) -> Path:
    p = Path(unit)
    if p.suffix == ".cu" and p.exists():
        return p.resolve()
    name = p.name if p.suffix == ".cu" else p.name + ".cu"
    found = tree / "csrc/kernels/instantiations" / name
    if not found.exists():
        sys.exit(f"sass_local.py: no unit {name} under {tree}/csrc/kernels/instantiations")
    return found


def build_unit(tree: Path, unit: Path, out_dir: Path) -> tuple[Path, str]:
    """The unit's sm_90a cubin and ptxas's report."""
    from torch.utils.cpp_extension import include_paths  # the includes setup.py's build uses

    cubin = out_dir / (unit.stem + ".cubin")
    cmd = ["nvcc", "-O3", "-lineinfo", "--expt-relaxed-constexpr", "-std=c++17",
           "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v",
           f"-I{tree / 'csrc'}", *(f"-I{p}" for p in include_paths()), "-o", str(cubin), str(unit)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"sass_local.py: {unit.name} did not compile:\n{run.stderr[-3000:]}")
    return cubin, run.stderr


def table(ptxas: dict[str, dict[str, int]], listing: dict[str, Counter], pattern: str) -> list[str]:
    head = ["kernel", "regs", "spill st/ld", "instructions", *MARKS, "S2R cga"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, counts in listing.items():
        if pattern and not re.search(pattern, name):
            continue
        p = ptxas.get(name, {})
        spill = f"{p.get('spill_stores', '-')}/{p.get('spill_loads', '-')}"
        cells = [name, str(p.get("registers", "-")), spill, str(counts["instructions"]),
                 *(str(counts[m]) for m in MARKS), str(counts["S2R_CGA"])]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("units", nargs="+", help="instantiation units (decode_wide_fp16_hd128, or a .cu path)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the source tree (default: this one)")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name matches this regex")
    ap.add_argument("--listing", type=Path, default=None, help="keep each unit's disassembly in this folder")
    args = ap.parse_args()
    tree = args.tree.resolve()
    disassembler = find_disassembler()
    with tempfile.TemporaryDirectory() as tmp:
        for unit in args.units:
            path = unit_path(tree, unit)
            cubin, report = build_unit(tree, path, Path(tmp))
            text = subprocess.run([disassembler, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            if args.listing:
                args.listing.mkdir(parents=True, exist_ok=True)
                (args.listing / (path.stem + ".sass")).write_text(text)
            print(f"{path.relative_to(tree) if path.is_relative_to(tree) else path} ({tree.name or tree}):")
            print("\n".join(table(parse_ptxas(report), parse_listing(text), args.kernel)))
            print()


if __name__ == "__main__":
    main()
