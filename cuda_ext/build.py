"""Build the pagedserve kernels as a torch extension (JIT on first use, cached).

`python -m cuda_ext.build` builds (or loads the cached build of) the ops for this
machine; `python -m cuda_ext.build --nvcc-check` compiles the CUDA sources with
nvcc only (no GPU needed) and exits non-zero when they do not compile.

A container image builds the kernels in its build stage (`--library-out PATH` copies
the built library there) and sets PAGEDSERVE_KERNELS_LIB=PATH in its runtime stage,
which then loads that library as it is: no compiler, no staleness check, no writes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cuda_ext.ops import is_built

CSRC = Path(__file__).parent / "csrc"
CPU_SOURCES = ("registration.cpp", "cpu/cache_ops.cpp", "cpu/attention.cpp", "cpu/skinny_gemm.cpp", "cpu/layer_ops.cpp",
               "cpu/argmax.cpp", "cpu/token_bitmask.cpp", "cpu/argmax_screen.cpp", "cpu/argmax_screen_int8.cpp",
               "cpu/decoder_layer.cpp", "cpu/moe.cpp", "cpu/skinny_w4.cpp", "cpu/linear_attention.cpp")
CUDA_SOURCES = ("cuda/bindings.cpp", "cuda/cache_kernels.cu", "cuda/attention_kernels.cu",
                "cuda/attention_split.cu", "cuda/layer_kernels.cu", "cuda/token_bitmask_kernels.cu", "cuda/w4_kernels.cu",
                "cuda/linear_attention_kernels.cu")
EXTENSION_NAME = "pagedserve_kernels"
PREBUILT_ENV = "PAGEDSERVE_KERNELS_LIB"


def build_directory(with_cuda: bool) -> Path:
    """Cache folder of the build: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"{python}_torch{torch.__version__}" / f"{EXTENSION_NAME}_{'cuda' if with_cuda else 'cpu'}"


def cpu_capability_flags() -> list[str]:
    # ATen's Vectorized picks its SIMD width from these macros; match what torch runs with.
    capability = torch.backends.cpu.get_cpu_capability()
    flags = [f"-DCPU_CAPABILITY={capability}"]
    if capability in ("AVX2", "AVX512"):
        flags.append(f"-DCPU_CAPABILITY_{capability}")
    return flags


def wants_cuda() -> bool:
    # An image build has no GPU: PAGEDSERVE_BUILD_CUDA=1 builds the CUDA variant anyway.
    return torch.cuda.is_available() or os.environ.get("PAGEDSERVE_BUILD_CUDA") == "1"


def builds_cuda() -> bool:
    """Whether ``build`` compiles the CUDA variant: wanted, and a toolkit to compile it with."""
    from torch.utils.cpp_extension import CUDA_HOME

    return wants_cuda() and CUDA_HOME is not None


def require_toolchain() -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"pagedserve kernels need a C++ compiler, and {compiler!r} was not found: install one "
            "(Debian: sudo apt-get install build-essential) or set CXX, "
            "or run with attention_backend='torch' (pure-torch reference, slower)."
        )
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise RuntimeError("pagedserve kernels need ninja to build: pip install ninja")


def _is_stale(build_dir: Path, sources: list[Path]) -> bool:
    library = build_dir / f"{EXTENSION_NAME}.so"
    if not library.exists():
        return True
    newest = max(p.stat().st_mtime for p in [*sources, *CSRC.rglob("*.h"), *CSRC.rglob("*.cuh")])
    return library.stat().st_mtime < newest


def build(verbose: bool = False) -> None:
    """Compile (if needed) and load the ops into torch.ops.pagedserve (idempotent)."""
    if is_built():
        return
    if prebuilt := os.environ.get(PREBUILT_ENV):
        load_prebuilt(Path(prebuilt))
        return
    require_toolchain()
    from torch.utils.cpp_extension import load

    with_cuda = builds_cuda()
    if wants_cuda() and not with_cuda:
        print("pagedserve: CUDA kernels wanted but no CUDA toolkit (CUDA_HOME) was found: building the CPU "
              "kernels only; use attention_backend='torch' on the GPU", file=sys.stderr)
    sources = [CSRC / s for s in CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())]
    build_dir = build_directory(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    if _is_stale(build_dir, sources):
        print(f"building pagedserve kernels ({'CPU+CUDA' if with_cuda else 'CPU'}) in {build_dir}, "
              "on first use or after a source change (about a minute)...", file=sys.stderr, flush=True)
    load(
        name=EXTENSION_NAME,
        sources=[str(s) for s in sources],
        # PAGEDSERVE_CPU_ARCH lets an image target a CPU family other than the build host's.
        extra_cflags=["-O3", f"-march={os.environ.get('PAGEDSERVE_CPU_ARCH', 'native')}", "-fopenmp", *cpu_capability_flags()],
        extra_cuda_cflags=["-O3"] if with_cuda else None,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=verbose,
    )


def load_prebuilt(library: Path) -> None:
    """Loads a library built elsewhere (an image's build stage) for this torch and Python."""
    if not library.is_file():
        raise RuntimeError(f"{PREBUILT_ENV}={library} is not a file: build the kernels with "
                           "`python -m cuda_ext.build --library-out PATH`, or unset it to build them here")
    torch.ops.load_library(str(library))


def built_library(with_cuda: bool) -> Path:
    return build_directory(with_cuda) / f"{EXTENSION_NAME}.so"


def _cuda_include_dir(nvcc: str, cuda_home: str | None) -> Path:
    # nvcc may be a wrapper script on PATH, so also try the usual toolkit roots.
    roots = [cuda_home, os.environ.get("CUDA_PATH"), "/usr/local/cuda", Path(nvcc).resolve().parent.parent]
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_runtime_api.h").exists():
            return Path(root) / "include"
    raise RuntimeError("found nvcc but no CUDA toolkit include folder; set CUDA_HOME")


def _check_commands(nvcc: str, cuda_include: Path, out_dir: str) -> dict[str, list[str]]:
    """Per source, the command that checks it: nvcc for kernels, the host compiler for bindings."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    arches = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
    commands = {
        source: [nvcc, "-c", str(CSRC / source), "-o", str(Path(out_dir) / "kernel.o"), "-std=c++17", "-O3",
                 *arches, *COMMON_NVCC_FLAGS]
        for source in CUDA_SOURCES if source.endswith(".cu")
    }
    commands["cuda/bindings.cpp"] = [os.environ.get("CXX", "c++"), "-fsyntax-only", "-std=c++20",
                                     str(CSRC / "cuda" / "bindings.cpp"), f"-I{cuda_include}",
                                     *(f"-I{p}" for p in include_paths())]
    return commands


def nvcc_check() -> int:
    """Compile the CUDA kernels with nvcc and syntax-check their torch bindings (no GPU
    needed); 0 on success or when nvcc is absent."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = shutil.which("nvcc") or (CUDA_HOME and shutil.which(str(Path(CUDA_HOME) / "bin" / "nvcc")))
    if not nvcc:
        print("nvcc not found: skipping the CUDA compile check")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for source, cmd in _check_commands(nvcc, _cuda_include_dir(nvcc, CUDA_HOME), tmp).items():
            print(f"checking {source} with {Path(cmd[0]).name}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                print(f"CUDA compile check FAILED on {source}: {' '.join(cmd)}", file=sys.stderr)
                return 1
    print("CUDA compile check passed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuda_ext.build", description=__doc__)
    parser.add_argument("--nvcc-check", action="store_true", help="compile the CUDA sources with nvcc only")
    parser.add_argument("--library-out", metavar="PATH",
                        help=f"copy the built library to PATH (for {PREBUILT_ENV} in a runtime image)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.nvcc_check:
        return nvcc_check()
    build(verbose=args.verbose)
    print(f"pagedserve kernels ready in torch.ops.pagedserve ({build_directory(builds_cuda())})")
    if args.library_out:
        Path(args.library_out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built_library(builds_cuda()), args.library_out)
        print(f"copied to {args.library_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
