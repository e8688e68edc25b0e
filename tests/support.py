"""What the tests share besides fixtures: molecules, TorchANI reference models,
tolerances and small systems (conftest.py holds the fixtures).

TorchANI is the reference for every test and runs in the same process.
Molecules ship in tests/data. Published weights are read only from
``$TORCHANI_DATA_DIR`` (never downloaded, never copied): when they are there,
``reference_model`` loads them; when they are not, it builds the same
architecture with seeded random weights, so every exactness test (which only
compares against TorchANI) still runs. Tests that need the published values
themselves use the ``weights`` fixture and skip, saying how to enable them.
"""
import copy
import os
from pathlib import Path

import torch
import torchani

import torchani_fast
from torchani_fast.testing import random_model

MOLECULES = Path(__file__).resolve().parent / "data"
DEADLINE_S = 120  # the ``deadline`` fixture's limit, seconds


WEIGHTS_HINT = ("needs TorchANI's published weights: set TORCHANI_DATA_DIR to a folder with "
                "StateDicts/ani2x_state_dict.pt (and ani1x, ani1ccx)")


def has_weights(name="ANI2x"):
    """Whether ``$TORCHANI_DATA_DIR`` holds the published weights of model ``name``."""
    root = os.environ.get("TORCHANI_DATA_DIR")
    return bool(root) and (Path(root) / "StateDicts" / f"{name.lower()}_state_dict.pt").is_file()


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
    """A fresh TorchANI model (built once per process, then deep-copied).

    The published weights when ``$TORCHANI_DATA_DIR`` has them, else seeded
    random weights of the same architecture (see the module docstring).
    """
    if name not in _MODELS:
        if has_weights(name):
            _MODELS[name] = getattr(torchani.models, name)()
        else:
            _MODELS[name] = random_model(name)
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


# Molecules of tests/data that the model-level tests run, with and without a cell.
NONPERIODIC = ["2iuz_ligand.xyz", "3lka_ligand.xyz", "3hkw_ligand.xyz", "3o99_ligand.xyz",
               "1hvj_ligand.xyz", "small.xyz", "1hz5.xyz"]
PERIODIC = ["benzene.xyz", "tight_cell.xyz", "water-0.8nm.xyz"]

# A rough CH3Cl geometry: only needed to have a Cl atom (no Cl in tests/data).
CHLOROMETHANE = ([6, 17, 1, 1, 1],
                 [[0.0, 0.0, 0.0], [0.0, 0.0, 1.78], [1.03, 0.0, -0.36], [-0.52, 0.89, -0.36],
                  [-0.52, -0.89, -0.36]])


def chloromethane(dtype=torch.float64):
    """(species (1, 5), coords (1, 5, 3)) of CHLOROMETHANE."""
    z, xyz = CHLOROMETHANE
    return torch.tensor([z]), torch.tensor([xyz], dtype=dtype)


def molecule_lists(name):
    """(atomic numbers, positions) of a test molecule or "CH3Cl"; water-0.8nm.xyz
    gives its first water molecule, without the cell."""
    if name == "CH3Cl":
        return CHLOROMETHANE
    atoms = read_molecule(name)
    if name == "water-0.8nm.xyz":
        atoms = atoms[:3]
    return atoms.numbers.tolist(), atoms.positions.tolist()


def padded_batch(names, dtype, empty_row=True):
    """(species, coords): molecules padded with -1 (and an all-padding row)."""
    mols = [molecule_lists(n) for n in names]
    width = max(len(z) for z, _ in mols)
    rows = len(mols) + int(empty_row)
    species = torch.full((rows, width), -1, dtype=torch.long)
    coords = torch.zeros((rows, width, 3), dtype=dtype)
    for i, (z, xyz) in enumerate(mols):
        species[i, : len(z)] = torch.tensor(z)
        coords[i, : len(z)] = torch.tensor(xyz, dtype=dtype)
    return species, coords


BATCHES = {
    # H C N O S F Cl across molecules: every element network and many column blocks.
    "ANI2x": ["3lka_ligand.xyz", "3hkw_ligand.xyz", "CH3Cl"],
    "ANI1x": ["2iuz_ligand.xyz", "CH4-5.xyz", "water-0.8nm.xyz"],
    "small": ["3lka_ligand.xyz", "CH3Cl"],  # H C N O S Cl, 21 atoms wide
}


def assert_energies(actual, expected, dtype):
    """float64: 1e-10; float32: a few ulps of the largest total energy."""
    if dtype == torch.float64:
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    else:
        atol = 8 * torch.finfo(torch.float32).eps * expected.abs().max().item()
        torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


def assert_forces(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-9 if dtype == torch.float64 else 5e-5)


def with_threads(n, fn):
    """fn() with torch's intra-op thread count set to n, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def aev_args(aev_computer, dtype, device="cpu"):
    """The AEV ops' constant arguments (etas, shifts, zetas, sections, cutoffs,
    number of species) of a TorchANI AEVComputer, in dtype on device."""
    r, a = aev_computer.radial, aev_computer.angular
    consts = [t.to(device, dtype) for t in (r.eta, r.shifts, a.eta, a.zeta, a.shifts, a.sections)]
    return consts + [float(r.cutoff), float(a.cutoff), aev_computer.num_species]


TINY_LEN = 2 * 4 + 3 * 2 * 2  # AEV length for tiny_consts


def tiny_consts(dtype=torch.float64):
    """AEV constants with few features (2 species, 4 radial, 2x2 angular), so that
    numerical checks are quick. Non-integer zeta and per-shift etas exercise the
    general formulas."""
    t = lambda *v: torch.tensor(v, dtype=dtype)  # noqa: E731
    return [t(4.0, 3.0, 5.0, 4.5), t(0.8, 1.4, 2.0, 2.6), t(3.0), t(5.5, 7.0), t(0.9, 1.7),
            t(0.4, 2.0), 3.0, 2.6, 2]


def tiny_periodic_system(dtype=torch.float64, seed=0):
    """(species, pairs, diff) of 5 atoms + 1 padding atom: all pairs, an atom paired
    with its own image and a pair present twice through two different images (what
    a small cell gives)."""
    g = torch.Generator().manual_seed(seed)
    species = torch.tensor([[0, 1, 1, 0, 1, -1]])
    x = torch.rand(6, 3, generator=g, dtype=dtype) * 2.2
    i, j = torch.triu_indices(6, 6, 1)
    diff = x[i] - x[j]
    # Atom 0 with its own image, and the pair (1, 2) a second time through another image.
    extra = torch.tensor([[2.5, 0.0, 0.0], [0.3, -1.9, 0.7]], dtype=dtype)
    i = torch.cat([i, torch.tensor([0, 1])])
    j = torch.cat([j, torch.tensor([0, 2])])
    return species, torch.stack([i, j]), torch.cat([diff, extra])


devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ISA_LEVELS = ("none", "avx2", "avx512")  # lowest first
