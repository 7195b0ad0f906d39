"""The SASS of kernel instantiation units, built and read on a machine without a GPU.

Each unit (a file of csrc/kernels/instantiations, by name or path) is compiled for sm_90a as
setup.py compiles it (``-O3 -lineinfo --expt-relaxed-constexpr``, torch's and csrc's includes),
to a cubin with ptxas's report, then disassembled; one row per kernel: its registers and spill
bytes (ptxas), its instructions, and the counts of the opcodes that mark a tile loop's cost (HGMMA
/ HMMA products, LDL / STL local-memory traffic, R2UR moves into uniform registers, S2R reads of
the cluster CTA id that each generic -> shared address conversion costs). ``--tree DIR`` reads
another source tree (e.g. one of bench/patch_trees.sh's .t* trees, or ``git archive REV csrc``
unpacked), so two forms of a change compare without a device; ``--listing DIR`` keeps each unit's
disassembly there. "LDS after STS" counts the shared-memory loads that come after a shared-memory
store with no branch, label or barrier between and whose result is used within ``--near``
instructions: loads the compiler would not move above the store (the same array, for all it
knows), so each waits its latency in turn (the int8 widening's eight 16-byte reads a tile were
such, 2026-12-04); ``--chains`` prints the source lines of those loads per kernel.

The disassembler: ``$NVDISASM``, else ``nvdisasm`` on PATH or in the toolkit's bin/. A toolkit
without it can take the one of the ``nvidia-cuda-nvdisasm`` wheel (``pip download --no-deps
nvidia-cuda-nvdisasm -d DIR``, unzip it, ``NVDISASM=DIR/nvidia/cu13/bin/nvdisasm``); any release
as new as the compiler reads its cubins.

Usage: python bench/sass_local.py decode_wide_fp16_hd128 [--tree .tbase] [--kernel TileSourceE2] [--chains]
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


_LINE = re.compile(r'## File "(?:.*/)?([^/"]+)", line (\d+)')  # -g's source comments
_REG = re.compile(r"\bR(\d+)\b")
_SHARED_LOAD = ("LDS", "LDSM")
_STRAIGHT_LINE_ENDS = ("BAR", "BRA", "SYNCS", "WARPSYNC", "RET", "EXIT", "CALL")


def _load_destination(instruction: str) -> set[str]:
    """The registers a shared load writes: its first operand, as wide as its modifiers say."""
    ops = operation(instruction)
    first = instruction.split(ops, 1)[1].split(",")[0] if ops in instruction else ""
    m = _REG.search(first)
    if not m:
        return set()
    mods = ops.split(".")[1:]  # LDS.128 / LDS.64 by bits, LDSM.16.M88.4 by matrices
    width = 4 if ("128" in mods or mods[-1:] == ["4"]) else 2 if ("64" in mods or mods[-1:] == ["2"]) else 1
    return {str(int(m.group(1)) + k) for k in range(width)}


def store_load_waits(text: str, near: int = 6) -> dict[str, Counter]:
    """Per kernel, by source line ("file:line" from -g's comments, else "?"), the shared loads
    issued after a shared store in the same straight-line stretch whose result an instruction within
    ``near`` reads (the module's head says why they matter)."""
    out: dict[str, Counter] = {}
    current, where, stored = None, "?", False
    ins: list[tuple[str, str]] = []  # (source, instruction or "" for a label) of the kernel

    def scan() -> None:
        nonlocal stored
        stored = False
        for i, (src, text_i) in enumerate(ins):
            op = operation(text_i).split(".")[0] if text_i else ""
            if not text_i or op in _STRAIGHT_LINE_ENDS or op.startswith("SYNCS"):
                stored = False
            elif op.startswith("STS"):
                stored = True
            elif op in _SHARED_LOAD and stored:
                dst = _load_destination(text_i)
                for _, later in ins[i + 1 : i + 1 + near]:
                    if not later:
                        break
                    sources = later.split(",", 1)[1] if "," in later else ""
                    if dst & set(_REG.findall(sources)):
                        out[current][src] += 1
                        break

    for line in text.splitlines():
        if m := _FUNC.match(line.strip()):
            if current is not None:
                scan()
            current, where, ins = m.group(1), "?", []
            out[current] = Counter()
        elif current is None:
            continue
        elif m := _LINE.search(line):
            where = f"{m.group(1)}:{m.group(2)}"
        elif line.strip().startswith(".L"):
            ins.append((where, ""))
        elif m := _ADDR.search(line):
            ins.append((where, m.group(2)))
    if current is not None:
        scan()
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


def table(
    ptxas: dict[str, dict[str, int]], listing: dict[str, Counter], pattern: str, waits: dict[str, Counter] | None = None
) -> list[str]:
    head = ["kernel", "regs", "spill st/ld", "instructions", *MARKS, "S2R cga", "LDS after STS"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, counts in listing.items():
        if pattern and not re.search(pattern, name):
            continue
        p = ptxas.get(name, {})
        spill = f"{p.get('spill_stores', '-')}/{p.get('spill_loads', '-')}"
        cells = [name, str(p.get("registers", "-")), spill, str(counts["instructions"]),
                 *(str(counts[m]) for m in MARKS), str(counts["S2R_CGA"]),
                 str(sum((waits or {}).get(name, Counter()).values()))]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("units", nargs="+", help="instantiation units (decode_wide_fp16_hd128, or a .cu path)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the source tree (default: this one)")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name matches this regex")
    ap.add_argument("--listing", type=Path, default=None, help="keep each unit's disassembly in this folder")
    ap.add_argument("--chains", action="store_true", help="the source lines of each kernel's LDS after STS")
    ap.add_argument("--near", type=int, default=6, help="LDS after STS: its result read within this many instructions")
    args = ap.parse_args()
    tree = args.tree.resolve()
    disassembler = find_disassembler()
    with tempfile.TemporaryDirectory() as tmp:
        for unit in args.units:
            path = unit_path(tree, unit)
            cubin, report = build_unit(tree, path, Path(tmp))
            text = subprocess.run([disassembler, "-c", "-g", str(cubin)], capture_output=True, text=True, check=True).stdout
            if args.listing:
                args.listing.mkdir(parents=True, exist_ok=True)
                (args.listing / (path.stem + ".sass")).write_text(text)
            print(f"{path.relative_to(tree) if path.is_relative_to(tree) else path} ({tree.name or tree}):")
            waits = store_load_waits(text, args.near)
            print("\n".join(table(parse_ptxas(report), parse_listing(text), args.kernel, waits)))
            print()
            for name, lines in waits.items() if args.chains else ():
                if lines and (not args.kernel or re.search(args.kernel, name)):
                    print(f"{name}: " + ", ".join(f"{where} x{n}" for where, n in lines.most_common()))


if __name__ == "__main__":
    main()
