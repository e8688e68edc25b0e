"""Build torchani_fast and its compiled ops (torchani_fast._C).

Environment switches:
  TORCHANI_FAST_CUDA=0|1  build the CUDA kernels (default: 1 when torch was built
                          with CUDA and CUDA_HOME is found, no GPU needed)
  TORCH_CUDA_ARCH_LIST    GPU architectures (default: torch's own, plus PTX)
  DEBUG=1                 -O0 -g
"""
import atexit
import glob
import os
import shutil
import sys
import tempfile

from setuptools import find_packages, setup
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def _use_cuda() -> bool:
    import torch

    flag = os.environ.get("TORCHANI_FAST_CUDA")
    if flag is not None and flag.strip().lower() in ("1", "true", "yes", "on"):
        if torch.version.cuda is None:
            raise RuntimeError(f"TORCHANI_FAST_CUDA={flag} but torch {torch.__version__} has no CUDA: "
                               "install a CUDA build of torch, or build the CPU extension")
        return True
    if flag is not None:
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


# Toolchains that link libstdc++ statically into shared objects (the GPU
# machines' /opt/gcc does) put a second copy of it into _C.so. Its symbols must
# stay private to _C.so: exported, some of them bind to the process's own
# libstdc++ and others do not, and formatting a number into an error message
# then crashes (std::locale facet ids of one copy used with the other's locale).
# With a shared libstdc++, as usual, this flag changes nothing.
LINK_ARGS = ["-fopenmp"] + (["-Wl,--exclude-libs,ALL"] if sys.platform.startswith("linux") else [])


def _extension():
    debug = os.environ.get("DEBUG", "0") == "1"
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    cxx += ["-fopenmp"]
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    include_dirs = [os.path.join(HERE, "csrc")]  # includes are relative to csrc/
    if not _use_cuda():
        return cpp_extension.CppExtension(
            "torchani_fast._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx},
            extra_link_args=LINK_ARGS,
        )
    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        import torch

        archs = [a for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
        # Some torch versions list no architectures when no GPU is visible; torch's
        # own fallback then needs a GPU, so fall back to the common data-centre ones.
        vers = [f"{a[3:-1]}.{a[-1]}" for a in archs] or ["7.5", "8.0", "8.6", "9.0"]
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(vers[:-1] + [vers[-1] + "+PTX"])
    nvcc = ["-O0", "-g", "-lineinfo"] if debug else ["-O3"]
    nvcc += ["-DTORCHANI_FAST_CUDA"]
    return cpp_extension.CUDAExtension(
        "torchani_fast._C",
        sources + sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + ["-DTORCHANI_FAST_CUDA"], "nvcc": nvcc},
        extra_link_args=LINK_ARGS,
    )


def _wheel_build_options() -> dict:
    """Build a wheel (``pip install .``, ``python -m build``) in a temporary folder.

    setuptools would otherwise leave ``build/lib*/torchani_fast`` (the Python
    files and ``_C*.so`` of that build) and ``build/temp*`` in the checkout, and
    a later wheel copies whatever is still there: a module deleted since, or
    objects compiled against another torch. The folder is removed when the
    build process exits. ``setup.py build_ext --inplace`` and editable installs
    keep ``build/temp*``, so their rebuilds stay incremental.
    """
    if "bdist_wheel" not in sys.argv:
        return {}
    base = tempfile.mkdtemp(prefix="torchani_fast-build-")
    atexit.register(shutil.rmtree, base, True)
    return {"build": {"build_base": base}, "egg_info": {"egg_base": base}}


def _entry_points() -> dict:
    """The console script and openmm-ml's potentials, one per model that the
    registry (torchani_fast/registry.py, pure Python) offers to OpenMM."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_registry", os.path.join(HERE, "torchani_fast", "registry.py"))
    registry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registry)
    factory = "torchani_fast.apps.openmm.mlpotential:ANIFastPotentialImplFactory"
    return {
        "console_scripts": ["torchani-fast = torchani_fast.apps.cli:main"],
        # MLPotential("ani2x-fast") etc.: not openmm-ml's own names, which entry
        # points of the same name would overwrite (torchani_fast/apps/openmm/).
        "openmmml.potentials": [f"{name} = {factory}" for name in registry.openmm_names()],
    }


setup(
    packages=find_packages(include=["torchani_fast", "torchani_fast.*"]),
    entry_points=_entry_points(),
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options=_wheel_build_options(),
)
