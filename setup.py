"""Builds vflow and its C++/CUDA extension ``vflow._C``.

The CUDA kernels are compiled when the *toolchain* supports them (a CUDA build of
PyTorch and an nvcc that cpp_extension can find), never based on whether a GPU is
visible: wheels are often built on machines without one. ``VFLOW_CUDA`` overrides
the decision (``0`` forces a CPU-only build, ``1`` fails loudly if CUDA is missing).
Before compiling CUDA it stops, naming the releases and the ways out, when nvcc cannot
build against the installed torch's CUDA and headers (Note [nvcc, torch's CUDA and the
headers]).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - exercised only on a broken install
    sys.exit(
        "vflow: building the extension needs PyTorch importable at build time.\n"
        "Install torch first, then build against it with: pip install --no-build-isolation ."
    )

ROOT = Path(__file__).resolve().parent
# Without a visible GPU, cpp_extension would compile for every architecture the
# toolkit knows (minutes per architecture); these cover Ampere, Hopper and newer.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0+PTX"


def _cuda_decision() -> tuple[bool, str]:
    override = os.environ.get("VFLOW_CUDA", "auto").strip().lower()
    has_toolchain = torch.version.cuda is not None and CUDA_HOME is not None
    why = f"torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}"
    if override in ("0", "off", "false", "no"):
        return False, f"disabled by VFLOW_CUDA={override}"
    if override in ("1", "on", "true", "yes"):
        if not has_toolchain:
            sys.exit(f"vflow: VFLOW_CUDA={override} but no CUDA toolchain is usable ({why})")
        return True, f"forced by VFLOW_CUDA={override} ({why})"
    if override != "auto":
        sys.exit(f"vflow: VFLOW_CUDA must be auto, 0 or 1, got {override!r}")
    return has_toolchain, f"auto: {why}"


def _nvidia_wheel_includes() -> list[str]:
    """Header folders of NVIDIA's pip wheels (cuBLAS, cuSPARSE, ...).

    Torch's CUDA headers include cublas_v2.h and cusparse.h; a bare toolkit may lack
    them while the CUDA build of torch ships them as ``nvidia-*`` wheels.
    """
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return []
    found = []
    for base in map(Path, nvidia.__path__):
        found += [str(p) for p in sorted(base.glob("*/include")) if p.is_dir()]
    return found


def nvcc_release(version_text: str) -> tuple[int, int] | None:
    """The CUDA release in ``nvcc --version``'s output ("... release 13.0, V13.0.88")."""
    match = re.search(r"release (\d+)\.(\d+)", version_text)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def cudart_release(header_text: str) -> tuple[int, int] | None:
    """The CUDA release of a cuda_runtime_api.h (``#define CUDART_VERSION 13020``)."""
    match = re.search(r"^\s*#\s*define\s+CUDART_VERSION\s+(\d+)", header_text, re.MULTILINE)
    if match is None:
        return None
    number = int(match.group(1))
    return number // 1000, number % 1000 // 10


def _release(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


# Note [nvcc, torch's CUDA and the headers]
# A CUDA build involves three CUDA releases: nvcc's, the one torch was built with
# (torch.version.cuda), and the one of the cuda_runtime_api.h first on the include path,
# which is the CUDA build of torch's own nvidia wheels when they have one (setup.py puts
# them first, for the cuBLAS and cuSPARSE headers a bare toolkit may lack), else nvcc's.
# * nvcc and torch of different majors: cpp_extension refuses them too, as the build
#   starts, naming no way out.
# * nvcc and the headers of different releases: CCCL (cuda/std/__cccl/cuda_toolkit.h,
#   which torch's CUDA headers include) stops with "CUDA compiler and CUDA toolkit
#   headers are incompatible" unless nvcc's major.minor equals CUDART_VERSION's, older
#   or newer alike, and only when the first .cu file compiles: minutes in on 2 cores.
# * nvcc and torch of one major, different minors, with nvcc's own headers: cpp_extension
#   warns and the build works.
def cuda_mismatch(
    nvcc: tuple[int, int],
    torch_cuda: str,
    torch_version: str,
    headers: tuple[int, int] | None,
    headers_dir: str | None,
) -> str | None:
    """Why nvcc cannot build against this torch and these headers, or None when it can.

    ``headers``: the release of the wheel headers put first on the include path
    (``headers_dir``), None when the build would use nvcc's own.
    """
    if nvcc[0] != int(torch_cuda.split(".")[0]):
        problem = (
            f"nvcc is CUDA {_release(nvcc)} but torch {torch_version} was built with CUDA "
            f"{torch_cuda}: a CUDA extension needs both of one major release"
        )
    elif headers is not None and headers != nvcc:
        problem = (
            f"nvcc is CUDA {_release(nvcc)} but the CUDA headers this build puts first on the "
            f"include path are CUDA {_release(headers)} ({headers_dir}, from the nvidia wheels "
            f"of torch {torch_version}, built with CUDA {torch_cuda}): CCCL, which torch's CUDA "
            "headers include, refuses every CUDA file unless nvcc's release is the headers' "
            '("CUDA compiler and CUDA toolkit headers are incompatible")'
        )
    else:
        return None
    wanted = _release(headers) if headers is not None else torch_cuda
    return (
        f"vflow: {problem}.\nWays out:\n"
        "  * a CPU-only build (no CUDA kernels): VFLOW_CUDA=0 pip install --no-build-isolation .\n"
        f"  * a CUDA {wanted} toolkit: CUDA_HOME=/path/to/cuda-{wanted} (its bin/nvcc)\n"
        f"  * a torch built for nvcc's CUDA {_release(nvcc)} (torch.version.cuda == "
        f"'{_release(nvcc)}'), then build again"
    )


def _check_cuda_toolchain(include_dirs: list[str]) -> None:
    """Stops before any compiling when nvcc, torch and the headers cannot work together
    (Note [nvcc, torch's CUDA and the headers])."""
    assert CUDA_HOME is not None and torch.version.cuda is not None
    nvcc_path = Path(CUDA_HOME) / "bin" / "nvcc"
    try:
        out = subprocess.run(
            [str(nvcc_path), "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"vflow: cannot run {nvcc_path} --version ({exc}); set CUDA_HOME to a toolkit")
    nvcc = nvcc_release(out)
    if nvcc is None:
        sys.exit(f"vflow: {nvcc_path} --version names no CUDA release:\n{out}")
    headers, headers_dir = None, None
    for folder in include_dirs:
        header = Path(folder) / "cuda_runtime_api.h"
        if header.is_file():
            headers, headers_dir = cudart_release(header.read_text(errors="replace")), folder
            break
    if headers_dir is None:
        where = "nvcc's own"
    elif headers is None:  # no CUDART_VERSION to compare: left to the compiler
        where = f"of no release CUDART_VERSION names, in {headers_dir}"
    else:
        where = f"CUDA {_release(headers)} in {headers_dir}"
    print(
        f"vflow: nvcc CUDA {_release(nvcc)} ({nvcc_path}), torch CUDA {torch.version.cuda}, "
        f"headers {where}",
        flush=True,
    )
    problem = cuda_mismatch(nvcc, torch.version.cuda, torch.__version__, headers, headers_dir)
    if problem is not None:
        sys.exit(problem)


def _extension():
    use_cuda, reason = _cuda_decision()
    print(f"vflow: CUDA kernels {'ON' if use_cuda else 'OFF'} ({reason})", flush=True)
    sources = [
        "csrc/bindings.cpp",
        "csrc/collectives.cpp",
        "csrc/comm.cpp",
        "csrc/ops.cpp",
        "csrc/exact.cpp",
        "csrc/grad_buffer.cpp",
        "csrc/grad_store.cpp",
        "csrc/interrupt.cpp",
        "csrc/reducer.cpp",
        "csrc/reduction/reduction.cpp",
        "csrc/reduction/all_reduce.cpp",
        "csrc/reduction/ordered.cpp",
        "csrc/reduction/exact_sum.cpp",
        "csrc/torch_ops.cpp",
        "csrc/cpu/accumulate_cpu.cpp",
        "csrc/cpu/exact_cpu.cpp",
    ]
    cxx = ["-O3", f'-DVFLOW_TORCH_VERSION="{torch.__version__}"']
    link: list[str] = []
    if torch._C.has_openmp and sys.platform.startswith("linux"):
        # at::parallel_for is inline: without -fopenmp it silently runs on one thread.
        # The libgomp.so.1 this links to is the one torch already loaded (same soname),
        # so the extension shares torch's OpenMP thread pool and thread count.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    print(f"vflow: CPU kernels {'with' if link else 'without'} OpenMP threads", flush=True)
    if not use_cuda:
        return CppExtension(
            "vflow._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link
        )
    include_dirs = _nvidia_wheel_includes()
    _check_cuda_toolchain(include_dirs)
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    print(f"vflow: TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(visible GPUs)')}")
    nvcc = ["-O3", "-lineinfo", "-DVFLOW_WITH_CUDA"]
    if os.environ.get("VFLOW_PTXAS_VERBOSE") == "1":
        nvcc.append("-Xptxas=-v")
    return CUDAExtension(
        "vflow._C",
        [*sources, "csrc/cuda/accumulate_cuda.cu", "csrc/cuda/exact_cuda.cu"],
        include_dirs=include_dirs,
        extra_compile_args={"cxx": [*cxx, "-DVFLOW_WITH_CUDA"], "nvcc": nvcc},
    )


def _version() -> str:
    # Read as text: importing vflow would need torch and the extension this builds.
    text = (ROOT / "vflow" / "_version.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if match is None:
        sys.exit('vflow: vflow/_version.py has no line __version__ = "..."')
    return match.group(1)


def _environment_torch(target_dirs: list[Path]) -> str | None:
    """The version of the torch installed in the environment being installed into."""
    for dist in importlib.metadata.distributions(path=[str(d) for d in target_dirs]):
        if (dist.metadata["Name"] or "").lower() == "torch":
            return dist.version
    return None


def check_build_torch(torch_file: str, torch_version: str, target_dirs: list[Path]) -> None:
    """Refuses an isolated build that would replace the environment's own torch.

    Plain ``pip install .`` builds in an isolated environment against the torch that
    pyproject.toml pins (the CPU build), and the wheel then requires exactly that torch
    (the extension's ABI is tied to it): in an environment that has another torch — a
    CUDA build, another release — pip would silently replace it, or leave a CPU-only
    vflow beside a CUDA torch. Building against the environment's own torch is what
    ``pip install --no-build-isolation .`` does, the convention of CUDA extensions.
    """
    building_with = Path(torch_file).resolve()
    if any(d.resolve() in building_with.parents for d in target_dirs):
        return  # the environment's own torch: --no-build-isolation, or make
    theirs = _environment_torch(target_dirs)
    if theirs is None or theirs == torch_version:
        return  # nothing to replace
    sys.exit(
        f"vflow: this environment has torch {theirs}, but pip is building vflow in an isolated "
        f"environment against torch {torch_version} (pyproject.toml's pin); installing the "
        f"result would replace your torch with {torch_version.split('+')[0]} or leave vflow "
        "without the kernels your torch needs.\nBuild against the torch you have instead:\n"
        "    pip install --no-build-isolation .\n(with setuptools, wheel and ninja installed)"
    )


def _torch_requirement() -> str:
    # The extension's ABI is tied to the torch it was compiled against: pin that release.
    public_version = torch.__version__.split("+")[0]
    return f"torch=={public_version}"


# setuptools runs this file as __main__; tests load it under another name to call the
# checks above on their own.
if __name__ == "__main__":
    paths = sysconfig.get_paths()
    check_build_torch(
        torch.__file__, torch.__version__, sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    )
    setup(
        name="vflow",
        version=_version(),
        description=(
            "Virtual node processing for PyTorch: hardware-independent batch size and results"
        ),
        long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
        long_description_content_type="text/markdown",
        python_requires=">=3.10",
        packages=find_packages(include=["vflow", "vflow.*"]),
        install_requires=[_torch_requirement(), "numpy"],
        ext_modules=[_extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )
