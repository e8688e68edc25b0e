"""Shared test set-up: offline TorchANI weights, molecules, reference models.

TorchANI 2.9 is the reference for every test and runs in the same process.
Weights come from ../shared/torchani-data (never downloaded, never copied).
"""
import copy
import os
from pathlib import Path

SHARED = Path(os.environ.get("TORCHANI_FAST_SHARED", Path(__file__).resolve().parents[1] / ".." / "shared")).resolve()
os.environ.setdefault("TORCHANI_DATA_DIR", str(SHARED / "torchani-data"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torchani  # noqa: E402

import torchani_fast  # noqa: E402

MOLECULES = SHARED / "molecules"

torch.set_num_threads(2)


def read_molecule(name, index=None):
    import ase.io

    return ase.io.read(MOLECULES / name, index=index) if index is not None else ase.io.read(MOLECULES / name)


def atoms_to_tensors(atoms, dtype=torch.float64, device="cpu"):
    """(species (1, N) atomic numbers, coords (1, N, 3), cell or None, pbc or None)."""
    species = torch.tensor(atoms.numbers, dtype=torch.long, device=device).unsqueeze(0)
    coords = torch.tensor(atoms.positions, dtype=dtype, device=device).unsqueeze(0)
    if atoms.pbc.any():
        cell = torch.tensor(atoms.cell.array, dtype=dtype, device=device)
        pbc = torch.tensor(atoms.pbc, device=device)
    else:
        cell = pbc = None
    return species, coords, cell, pbc


_MODELS = {}


def reference_model(name="ANI2x", dtype=torch.float64):
    """A fresh TorchANI model (loaded once per process, then deep-copied)."""
    if name not in _MODELS:
        _MODELS[name] = getattr(torchani.models, name)()
    return copy.deepcopy(_MODELS[name]).to(dtype)


def model_pair(name="ANI2x", dtype=torch.float64):
    """(TorchANI reference, patched copy) with identical weights."""
    ref = reference_model(name, dtype)
    return ref, torchani_fast.patch(copy.deepcopy(ref))


def energy_forces(model, species, coords, cell=None, pbc=None):
    x = coords.detach().clone().requires_grad_(True)
    e = model((species, x), cell=cell, pbc=pbc).energies
    (g,) = torch.autograd.grad(e.sum(), x)
    return e.detach(), -g


devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=devices)
def device(request):
    return request.param
