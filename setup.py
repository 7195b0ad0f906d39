"""Build of mmha: one CUDA extension (mmha._C) holding the decode kernels and torch operators.

Environment:
  TORCH_CUDA_ARCH_LIST  target architectures (default "8.0;8.6;8.9;9.0a": Ampere, Ada, Hopper); a
                        plain 9.0 is built as 9.0a (sm_90a: the tree kernel's wgmma products)
  CUDA_HOME             CUDA toolkit root (default: CUDA_PATH, then nvcc on PATH, then /usr/local/cuda)
  MMHA_SKIP_CUDA=1      build a pure-Python install (reference path only)
  MAX_JOBS              parallel compile jobs (ninja)
  MMHA_TIMELINE=1       a diagnostic build whose tile loop stamps per-block events (bench/timeline.py;
                        csrc/kernels/timeline.cuh); the kernels are otherwise unchanged
  MMHA_BUILD_CHECK=1    a build check for machines without a GPU (CI): every kernel through the
                        compiler's front end to unoptimised PTX for each architecture, no SASS, the
                        host code whole; its operators refuse to launch kernels (.ci/ptxas_check
                        assembles representative instantiations fully)
  MMHA_KERNELS=SETS     a diagnostic build with only these kernel sets (comma-separated, of
                        KERNEL_SETS: activations, then the cache type where it differs, e.g.
                        "fp16" or "fp16,fp16_e4m3"): a fraction of the full build's time for A/B
                        timing; a step of another set is refused by name
No GPU is needed to build: nothing here asks torch.cuda.is_available().
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
DEFAULT_ARCHS = "8.0;8.6;8.9;9.0a"
# The decode kernels' sets: qkv type, then the cache type where it is not the same (the names of
# csrc/kernels/instantiations/decode[_wide]_<set>_hd<D>.cu; decode_dispatch.cu's kCompiled).
KERNEL_SETS = ("fp16", "bf16", "fp32", "fp16_e4m3", "bf16_e4m3", "fp16_s8", "bf16_s8", "fp16_u4", "bf16_u4")


def kernel_set_of(path: Path) -> str:
    """The kernel set of an instantiation file: decode_fp16_e4m3_hd128.cu -> "fp16_e4m3"."""
    return path.stem.removeprefix("decode_").removeprefix("wide_").rsplit("_hd", 1)[0]


def chosen_kernel_sets(value: str) -> tuple[str, ...]:
    """The sets MMHA_KERNELS names (all of them when it is empty)."""
    chosen = tuple(k.strip() for k in value.split(",") if k.strip())
    unknown = [k for k in chosen if k not in KERNEL_SETS]
    if unknown:
        raise ValueError(f"MMHA_KERNELS: unknown kernel sets {unknown}; choose from {', '.join(KERNEL_SETS)}")
    return chosen or KERNEL_SETS


def find_cuda_home() -> str | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").exists():
            return c
    return None


def extension_modules() -> tuple[list, dict]:
    if os.environ.get("MMHA_SKIP_CUDA", "0") == "1":
        print("[mmha] MMHA_SKIP_CUDA=1: building the pure-Python package (reference path only)")
        return [], {}
    cuda_home = find_cuda_home()
    if cuda_home is None:
        raise RuntimeError(
            "[mmha] CUDA toolkit not found: set CUDA_HOME to the toolkit root (it must contain "
            "bin/nvcc), or set MMHA_SKIP_CUDA=1 for a pure-Python install."
        )
    # torch.utils.cpp_extension resolves CUDA_HOME when imported: set it first.
    os.environ["CUDA_HOME"] = cuda_home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    # Hopper's cubin as sm_90a: the wide tree items multiply with wgmma there (an sm_90 build
    # takes their mma.sync path). sm_90a code runs on sm 9.0 GPUs only, as sm_90 code does.
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(",", ";").replace(" ", ";").split(";")
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join("9.0a" if a == "9.0" else a for a in archs if a)
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    if torch.version.cuda is None:
        raise RuntimeError(
            f"[mmha] torch {torch.__version__} is a CPU-only build; install a CUDA build of torch "
            "or set MMHA_SKIP_CUDA=1."
        )
    print(
        f"[mmha] building with TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']} "
        f"CUDA_HOME={cuda_home} torch={torch.__version__} torch CUDA={torch.version.cuda}",
        flush=True,
    )
    sources = [
        "csrc/bindings.cpp", "csrc/decode_op.cpp", "csrc/decode_params.cpp", "csrc/shard_ops.cpp",
        "csrc/norm_ops.cpp", "csrc/tma_maps.cpp", "csrc/kernels/decode_dispatch.cu",
        "csrc/kernels/shard_merge.cu", "csrc/kernels/row_norm.cu",
    ]  # fmt: skip
    kernel_sets = chosen_kernel_sets(os.environ.get("MMHA_KERNELS", ""))
    instantiations = sorted((ROOT / "csrc/kernels/instantiations").glob("*.cu"))
    sources += [str(p.relative_to(ROOT)) for p in instantiations if kernel_set_of(p) in kernel_sets]
    # decode_dispatch.cu and decode_op.cpp leave out the sets not built (MMHA_WITHOUT_<SET>).
    without = [f"-DMMHA_WITHOUT_{k.upper()}" for k in KERNEL_SETS if k not in kernel_sets]
    if without:
        print(f"[mmha] MMHA_KERNELS: only the kernel sets {', '.join(kernel_sets)} (a diagnostic build)")
    timeline = ["-DMMHA_TIMELINE"] if os.environ.get("MMHA_TIMELINE", "0") == "1" else []
    check = []
    if os.environ.get("MMHA_BUILD_CHECK", "0") == "1":
        # PTX only (torch adds no arch flags where these are given), unoptimised: about a fifth of
        # the full build's time. The extension's host code refuses to launch such kernels.
        archs = os.environ["TORCH_CUDA_ARCH_LIST"].split(";")
        codes = [a.replace(".", "").replace("+PTX", "") for a in archs]
        check = [
            "-DMMHA_BUILD_CHECK",
            "-Xcicc",
            "-O0",
            *(f"-gencode=arch=compute_{c},code=compute_{c}" for c in codes),
        ]
        print(
            f"[mmha] MMHA_BUILD_CHECK=1: a build check (PTX of {', '.join(codes)}), not for running kernels"
        )
    ext = CUDAExtension(
        name="mmha._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={
            "cxx": ["-O3", *timeline, *check[:1], *without],
            # No --use_fast_math: rotary angles need accurate sincosf/powf to match the reference.
            # A build check launches nothing: its nvcc units' host side unoptimised (about 1 s a
            # unit less on two cores; the same semantics).
            "nvcc": [
                "-O0" if check else "-O3", "-lineinfo", "--expt-relaxed-constexpr",
                *timeline, *check, *without,
            ],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_modules()

setup(
    name="mmha",
    version="0.1.0",
    description="Fused append + masked multi-head attention for the decode step of transformer inference",
    packages=find_packages(include=["mmha", "mmha.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "tabulate"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
if ext_modules and "-q" not in sys.argv:
    print("[mmha] CUDA extension built", flush=True)
