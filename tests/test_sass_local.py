"""bench/sass_local.py's readers of ptxas's report and nvdisasm's listing (no compiler run here)."""

import importlib.util
import sys
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "bench" / "sass_local.py"


def load():
    sys.path.insert(0, str(PATH.parent))  # it reads listings with bench/source_stalls.py's parts
    spec = importlib.util.spec_from_file_location("sass_local", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sass_local"] = module
    spec.loader.exec_module(module)
    return module


REPORT = """ptxas info    : 24 bytes gmem
ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'
ptxas info    : Function properties for _Z1kv
    112 bytes stack frame, 84 bytes spill stores, 88 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 112 bytes cumulative stack size, 18688 bytes smem
ptxas info    : Function properties for _ZN8internal4helperEv
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function '_Z1jv' for 'sm_90a'
ptxas info    : Function properties for _Z1jv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 1072 bytes smem
"""

LISTING = """\t.text._Z1kv:
.text._Z1kv:
        /*0000*/                   S2R R95, SR_CgaCtaId ;
        /*0010*/                   R2UR UR8, R88 ;
        /*0020*/                   HGMMA.64x64x16.F32 R88, gdesc[UR8], RZ, !UPT ;
        /*0030*/              @!P0 LDL.LU R132, [R1+0x2c] ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
.L_x_1:
        /*0050*/                   S2UR UR5, SR_CgaCtaId ;
.text._Z1jv:
        /*0000*/                   HMMA.16816.F32 R36, R40, R98, RZ ;
        /*0010*/                   EXIT ;
"""


def test_ptxas_report_per_entry_function():
    """Spills belong to the function whose properties they follow (a helper's are not the entry's);
    registers to the entry being compiled."""
    sl = load()
    got = sl.parse_ptxas(REPORT)
    assert got == {
        "_Z1kv": {"spill_stores": 84, "spill_loads": 88, "registers": 168},
        "_Z1jv": {"spill_stores": 0, "spill_loads": 0, "registers": 64},
    }


def test_listing_counts_opcodes_per_kernel():
    """Opcodes without predicates or modifiers; S2R and S2UR of the cluster CTA id both counted."""
    sl = load()
    got = sl.parse_listing(LISTING)
    assert set(got) == {"_Z1kv", "_Z1jv"}
    k = got["_Z1kv"]
    assert k["instructions"] == 6 and k["HGMMA"] == 1 and k["LDL"] == 1 and k["R2UR"] == 1 and k["S2R_CGA"] == 2
    assert got["_Z1jv"]["HMMA"] == 1 and got["_Z1jv"]["instructions"] == 2
    rows = sl.table(sl.parse_ptxas(REPORT), got, "_Z1k")
    assert len(rows) == 3 and rows[2] == "| _Z1kv | 168 | 84/88 | 6 | 1 | 0 | 1 | 0 | 1 | 2 | 0 |"


def test_opcode_drops_predicate_and_modifiers():
    sl = load()
    assert sl.opcode("@!P0 BRA `(.L_x_2)") == "BRA"
    assert sl.opcode("HGMMA.64x128x16.F32 R24, R88, gdesc[UR4].tnspB, R24") == "HGMMA"
    assert sl.opcode("") == ""


CHAINS = """.text._Z1wv:
	//## File "/src/csrc/kernels/attend_wide.cuh", line 630
        /*0000*/                   LDS.128 R88, [R101] ;
        /*0010*/                   LOP3.LUT R93, R89, 0x80808080, RZ, 0x3c, !PT ;
        /*0020*/                   STS.128 [R102], R92 ;
	//## File "/src/csrc/kernels/attend_wide.cuh", line 631
        /*0030*/                   LDS.128 R88, [R101+0x800] ;
        /*0040*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0050*/                   LOP3.LUT R105, R91, 0x80808080, RZ, 0x3c, !PT ;
        /*0060*/                   LDS R12, [R100] ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/                   LDS R13, [R100+0x4] ;
        /*0090*/                   FADD R14, R13, R13 ;
        /*00a0*/                   STS [R100], R14 ;
.L_x_3:
        /*00b0*/                   LDS R15, [R100+0x8] ;
        /*00c0*/                   FADD R16, R15, R15 ;
        /*00d0*/                   STS [R100], R16 ;
        /*00e0*/                   LDSM.16.M88.4 R20, [R30] ;
        /*00f0*/                   HMMA.16816.F32 R36, R22, R40, RZ ;
"""


def test_store_load_waits_by_source_line():
    """A shared load after a shared store, its result read soon, counts at its source line (the
    128-bit load's four registers, an ldmatrix's four); a load before any store, one whose result is
    not read within `near`, and loads after a barrier or a label (a new straight-line stretch) do
    not."""
    sl = load()
    got = sl.store_load_waits(CHAINS, near=4)
    assert got == {"_Z1wv": {"attend_wide.cuh:631": 2}}
    assert sl.store_load_waits(CHAINS, near=1) == {"_Z1wv": {"attend_wide.cuh:631": 1}}
    rows = sl.table({}, sl.parse_listing(CHAINS), "", got)
    assert rows[2].endswith("| 2 |")
