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
No GPU is needed to build: nothing here asks torch.cuda.is_available().
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
DEFAULT_ARCHS = "8.0;8.6;8.9;9.0a"


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
    sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc/kernels/instantiations").glob("*.cu"))
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
            "cxx": ["-O3", *timeline, *check[:1]],
            # No --use_fast_math: rotary angles need accurate sincosf/powf to match the reference.
            "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr", *timeline, *check],
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
