"""What csrc/kernels/table.py defines is generated, not copied: csrc/kernels/constants.h,
mmha/_constants.py and the kernel instantiations are what csrc/kernels/generate.py writes from it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from mmha import _constants, dispatch, tree

ROOT = Path(__file__).parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "csrc" / "kernels" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_up_to_date():
    gen = _generator()
    files = gen.render()
    stale = [str(p.relative_to(ROOT)) for p, text in files.items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run `python csrc/kernels/generate.py`: stale {stale}"
    written = set(files)
    extra = [p for p in (ROOT / "csrc" / "kernels" / "instantiations").glob("*.cu") if p not in written]
    assert not extra, f"instantiations the table does not name: {extra}"
    assert gen.main(["--check"]) == 0


def test_the_package_reads_the_generated_constants():
    assert dispatch.SUPPORTED_HEAD_DIMS == _constants.SUPPORTED_HEAD_DIMS
    assert dispatch.TILE_KEYS == 16 * _constants.CONSUMER_WARPS
    assert tree.MAX_NODES == _constants.MAX_TREE_NODES
    # The workspace layout: a one-token step's counters end where the tree step's masks begin.
    assert _constants.tree_anc(3, 1, 8) >= _constants.work_counter(3, 1, 8) + 2
    assert _constants.workspace_counters(2, 4, 8) == _constants.tree_rows(2, 4, 8) + 2


def test_formulas_read_the_same_in_both_languages():
    """Each formula's C++ text is the Python expression's own tree (operators, constants, calls)."""
    header = (ROOT / "csrc" / "kernels" / "constants.h").read_text()
    assert "constexpr int tile_stage_bytes(int head_dim, int elem_bytes, bool token_scales)" in header
    assert "constexpr int64_t tree_anc(int64_t batch, int64_t nodes, int64_t heads)" in header
    assert "#define MMHA_FOR_EACH_HEAD_DIM(X) X(32) X(64) X(80) X(96) X(128) X(256)" in header
    assert _constants.tile_stage_bytes(128, 2, False) == 32 * 1024  # K and V of 64 keys of 128 fp16 values
    assert _constants.tile_stage_bytes(80, 2, False) == 21 * 1024  # V rows padded by 16 bytes, then aligned


def _setup_names():
    """setup.py's KERNEL_SETS, kernel_set_of and chosen_kernel_sets (its module level runs setup(),
    so they are taken out of its source)."""
    tree_ = ast.parse((ROOT / "setup.py").read_text())
    keep = [
        n
        for n in tree_.body
        if (isinstance(n, ast.FunctionDef) and n.name in ("kernel_set_of", "chosen_kernel_sets"))
        or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "KERNEL_SETS")
    ]
    names: dict = {"Path": Path}
    exec(compile(ast.Module(keep, []), "setup.py", "exec"), names)
    return names


def test_kernel_sets_name_the_instantiations_and_the_dispatch():
    """MMHA_KERNELS's sets: every instantiation file belongs to one, every set has files, and the
    dispatch can leave out each of them (an MMHA_WITHOUT_<SET> in decode_dispatch.cu)."""
    s = _setup_names()
    files = list((ROOT / "csrc" / "kernels" / "instantiations").glob("*.cu"))
    of_files = {s["kernel_set_of"](p) for p in files}
    assert of_files == set(s["KERNEL_SETS"])
    dispatch_src = (ROOT / "csrc" / "kernels" / "decode_dispatch.cu").read_text()
    for k in s["KERNEL_SETS"]:
        assert f"#ifdef MMHA_WITHOUT_{k.upper()}\n" in dispatch_src, k


def test_kernel_sets_choice():
    s = _setup_names()
    assert s["chosen_kernel_sets"]("") == s["KERNEL_SETS"]
    assert s["chosen_kernel_sets"]("fp16, fp16_e4m3") == ("fp16", "fp16_e4m3")
    with pytest.raises(ValueError, match="MMHA_KERNELS: unknown kernel sets"):
        s["chosen_kernel_sets"]("fp16,int4")


def _slim_tree():
    spec = importlib.util.spec_from_file_location("slim_tree", ROOT / "bench" / "slim_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slim_tree_stubs_the_sets_left_out(tmp_path):
    """bench/slim_tree.py (quick diagnostic builds of any tree): each left-out file's explicit
    instantiations become specializations that launch nothing; kept files stay as they are."""
    slim, s = _slim_tree(), _setup_names()
    src = ROOT / "csrc" / "kernels" / "instantiations"
    dst = tmp_path / "csrc" / "kernels" / "instantiations"
    dst.mkdir(parents=True)
    for p in src.glob("*.cu"):
        assert slim.kernel_set_of(p) == s["kernel_set_of"](p)
        (dst / p.name).write_text(p.read_text())
    stubbed = slim.slim(tmp_path, ["fp16", "fp16_e4m3"])
    assert {p.name for p in stubbed} == {
        p.name for p in src.glob("*.cu") if s["kernel_set_of"](p) not in ("fp16", "fp16_e4m3")
    }
    for p in dst.glob("*.cu"):
        text, original = p.read_text(), (src / p.name).read_text()
        if p not in stubbed:
            assert text == original
            continue
        wanted = [line for line in original.splitlines() if line.startswith("template ")]
        assert text.count("template <>\n") == len(wanted) > 0
        assert text.count("return cudaErrorNotSupported;") == sum("cudaError_t" in w for w in wanted)
        assert text.count("return 0;") == sum(w.startswith("template int ") for w in wanted)
    with pytest.raises(ValueError, match="--keep: no kernel sets"):
        slim.slim(tmp_path, ["fp8"])


def test_slim_tree_keeps_only_the_head_dims_given(tmp_path):
    """bench/slim_tree.py --head-dims (bench/ab_trees.sh's MMHA_HEAD_DIMS): of the kept sets only
    the files of those head dims stay (one-token, lean and wide units alike); every set without
    --keep."""
    slim = _slim_tree()
    src = ROOT / "csrc" / "kernels" / "instantiations"
    dst = tmp_path / "csrc" / "kernels" / "instantiations"
    dst.mkdir(parents=True)
    for p in src.glob("*.cu"):
        (dst / p.name).write_text(p.read_text())
    assert slim.head_dim_of(Path("decode_fp16_hd128_lean.cu")) == 128
    assert slim.head_dim_of(Path("decode_wide_bf16_s8_hd64.cu")) == 64
    stubbed = slim.slim(tmp_path, ["fp16"], [128])
    kept = sorted(p.name for p in dst.glob("*.cu") if p not in stubbed)
    assert kept == ["decode_fp16_hd128.cu", "decode_fp16_hd128_lean.cu", "decode_wide_fp16_hd128.cu"]
    for name in kept:
        assert (dst / name).read_text() == (src / name).read_text()
    with pytest.raises(ValueError, match="--head-dims: no head dims"):
        slim.slim(tmp_path, None, [48])
    fresh = tmp_path / "fresh"
    (fresh / "csrc" / "kernels" / "instantiations").mkdir(parents=True)
    for p in src.glob("*.cu"):
        (fresh / "csrc" / "kernels" / "instantiations" / p.name).write_text(p.read_text())
    stubbed = slim.slim(fresh, None, [64])
    assert {p.name for p in stubbed} == {p.name for p in src.glob("*.cu") if slim.head_dim_of(p) != 64}
