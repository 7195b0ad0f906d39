"""Where one kernel's warps spend their samples, by CUDA source line: Nsight Compute's warp
sampling per SASS instruction (the source page as CSV) joined with the kernel's line table
(``nvdisasm --print-line-info-inline`` of the same cubin) by address. bench/source_stalls.sh makes
both files on the device; this script also runs anywhere on the files it brought back.

Each line of the report: samples (and their share), the instructions' executions, the largest
stall reasons, and the source line as ``file:line`` with the line it was inlined at; with
``--depth N`` the lines N calls deep from the kernel's body instead (2: the body's callees' lines).

Usage: python bench/source_stalls.py source.csv kernel.sass [--function MANGLED] [--top 40] [--depth N]
"""

from __future__ import annotations

import argparse
import csv
import io
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

Table = dict[int, tuple["Where", str]]  # address -> (source, instruction)
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_FUNC = re.compile(r"^\.text\.(\S+):$")


@dataclass(frozen=True)
class Where:
    """A SASS instruction's source: its chain of (file, line), innermost first, the last the
    kernel's own body (each inlined at the next)."""

    chain: tuple[tuple[str, int], ...]

    def label(self, depth: int = 0) -> str:
        """``file:line`` of the innermost (depth 0) with the line it was inlined at, or of the
        ``depth``-th counted from the kernel's body (1: the body's line) where the chain is that
        long."""
        name = lambda fl: f"{Path(fl[0]).name}:{fl[1]}"  # noqa: E731
        if depth > 0:
            return name(self.chain[-min(depth, len(self.chain))])
        inner = name(self.chain[0])
        return f"{inner} (in {name(self.chain[1])})" if len(self.chain) > 1 else inner


@dataclass
class Sample:
    """One SASS instruction's row of the source page."""

    address: int
    text: str
    samples: float
    executed: float
    reasons: dict[str, float] = field(default_factory=dict)


def line_table(sass: str, function: str | None = None) -> Table:
    """Address -> (source, instruction) of each instruction of ``function`` (mangled; the first
    function of the disassembly without one) in an ``nvdisasm --print-line-info-inline`` listing,
    where each instruction whose source changes follows a run of comment lines, the innermost
    first ("line L inlined at ..."), then each line it was inlined at, out to the kernel's body."""
    table: Table = {}
    current: str | None = None
    where: Where | None = None
    pending: list[tuple[str, int]] = []
    for raw in sass.splitlines():
        m = _FUNC.match(raw.strip())
        if m:
            if current is not None and table and (function is None or current == function):
                break
            current, where, pending = m.group(1), None, []
            continue
        if current is None or (function is not None and current != function):
            continue
        m = _LINE.search(raw)
        if m:
            pending.append((m.group(1), int(m.group(2))))
            continue
        m = _ADDR.search(raw)
        if m:
            if pending:
                where, pending = Where(tuple(pending)), []
            if where is not None:
                table[int(m.group(1), 16)] = (where, m.group(2))
    return table


def _number(s: str) -> float:
    s = s.strip().replace(",", "")
    try:
        return float(s)
    except ValueError:
        return 0.0


def source_rows(text: str) -> list[Sample]:
    """The SASS rows of ``ncu --page source --csv --print-source sass``: its header is the first
    row with an "Address" and a "Source" column; samples from the "Warp Stall Sampling (All
    Samples)" column, executions from "Instructions Executed", and each column that names a stall
    reason (a name with "stall" in it, other than the two sampling totals) as a reason."""
    rows = list(csv.reader(io.StringIO(text)))
    head = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if head is None:
        raise ValueError("no header row with Address and Source columns: not a source page CSV")
    names = rows[head]
    col = {n: i for i, n in enumerate(names)}
    total = next((i for n, i in col.items() if n.startswith("Warp Stall Sampling (All")), None)
    if total is None:
        raise ValueError("no 'Warp Stall Sampling (All Samples)' column: was warp sampling collected?")
    executed = col.get("Instructions Executed")
    reasons = {
        n: i for n, i in col.items() if "stall" in n.lower() and not n.startswith("Warp Stall Sampling")
    }
    out = []
    for r in rows[head + 1 :]:
        if len(r) < len(names) or not r[col["Address"]].strip():
            continue
        try:
            addr = int(r[col["Address"]].strip(), 16)
        except ValueError:
            continue
        out.append(
            Sample(
                addr,
                r[col["Source"]].strip(),
                _number(r[total]),
                _number(r[executed]) if executed is not None else 0.0,
                {n: _number(r[i]) for n, i in reasons.items() if _number(r[i])},
            )
        )
    return out


def opcode(text: str) -> str:
    """An instruction's operation without its predicate: '@!P0 BRA `(.L_x_2)' -> 'BRA'."""
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def align(samples: list[Sample], table: Table) -> tuple[int, int]:
    """The offset to add to the page's addresses (0, or minus the first one where the page gives
    absolute addresses), chosen by how many operations then agree with the listing; returns
    (offset, instructions that agree)."""
    best = (0, -1)
    if not samples:
        return 0, 0
    for off in (0, -min(s.address for s in samples)):
        agree = sum(1 for s in samples if opcode(table.get(s.address + off, (None, ""))[1]) == opcode(s.text))
        if agree > best[1]:
            best = (off, agree)
    return best


def by_source(
    samples: list[Sample], table: Table, depth: int = 0, offset: int = 0
) -> list[tuple[str, Sample]]:
    """Samples, executions and reasons summed per source label, most samples first (instructions
    the table lacks under "?")."""
    sums: dict[str, Sample] = {}
    for s in samples:
        entry = table.get(s.address + offset)
        label = entry[0].label(depth) if entry else "?"
        acc = sums.setdefault(label, Sample(s.address, s.text, 0.0, 0.0, defaultdict(float)))
        acc.samples += s.samples
        acc.executed += s.executed
        for k, v in s.reasons.items():
            acc.reasons[k] += v
    return sorted(sums.items(), key=lambda kv: -kv[1].samples)


def report(samples: list[Sample], table: Table, top: int = 40, depth: int = 0) -> str:
    total = sum(s.samples for s in samples) or 1.0
    offset, agree = align(samples, table)
    lines = [
        f"{len(samples)} instructions, {total:.0f} samples; the line table agrees on {agree} operations",
        f"by source line ({f'{depth} from the kernel body' if depth else 'innermost'}), the {top} with most",
    ]
    lines.append(f"{'samples':>8} {'share':>6} {'executed':>10}  reasons (largest three)  source")
    for label, s in by_source(samples, table, depth, offset)[:top]:
        big = sorted(s.reasons.items(), key=lambda kv: -kv[1])[:3]
        why = ", ".join(f"{_short(k)} {v / max(s.samples, 1):.0%}" for k, v in big) or "-"
        lines.append(f"{s.samples:8.0f} {s.samples / total:6.1%} {s.executed:10.0f}  {why:<40} {label}")
    return "\n".join(lines)


def _short(name: str) -> str:
    """A stall column's reason: 'smsp__pcsamp_warps_issue_stalled_long_scoreboard' -> 'long_scoreboard'."""
    m = re.search(r"stalled_([a-z_]+?)(?:_not_issued)?$", name)
    return m.group(1) if m else name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass")
    ap.add_argument("sass", type=Path, help="nvdisasm --print-line-info-inline of the kernel's cubin")
    ap.add_argument("--function", default=None, help="the kernel's mangled name in the listing")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument(
        "--depth", type=int, default=0, help="0: innermost lines; N: the N-th from the kernel body"
    )
    args = ap.parse_args()
    table = line_table(args.sass.read_text(), args.function)
    print(report(source_rows(args.csv.read_text()), table, args.top, args.depth))


if __name__ == "__main__":
    main()
