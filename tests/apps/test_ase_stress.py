"""Stress of periodic systems: the patched model through TorchANI's ASE calculator.

'scaling' differentiates the energy with respect to a strain of the cell and the
positions, so it needs gradients through ``images @ cell``; 'fdotr' needs the AEV
to be differentiable with respect to the neighbour list's diff vectors. Both must
equal TorchANI (all_pairs, which is right for every case here), a central
finite difference of the energy with respect to strain, and must not change when
atoms are moved by lattice vectors (TorchANI's cell_list gets 'scaling' wrong
then, because it wraps the positions with a detached cell).
"""
import copy

import ase
import ase.units
import numpy as np
import pytest
import torch
import torchani.ase

import torchani_fast

from support import read_molecule, reference_model

KINDS = ["scaling", "fdotr"]
# Benzene's stress is ~1e-3 eV/Å^3; float64 agreement is ~1e-13.
ATOL_EXACT = 1e-11
# Central differences, h = 1e-5: truncation ~1e-11, rounding ~1e-10 (eV/Å^3).
ATOL_FD = 2e-8


@pytest.fixture(scope="module")
def models():
    ref = reference_model("ANI2x", torch.float64)
    return ref, torchani_fast.patch(copy.deepcopy(ref))


def translated(atoms, seed, low=-3, high=4):
    """The same periodic system with every atom moved by a random lattice vector."""
    moved = atoms.copy()
    k = np.random.default_rng(seed).integers(low, high, size=(len(atoms), 3))
    moved.positions = atoms.positions + k @ atoms.cell.array
    return moved


def triclinic_water():
    atoms = read_molecule("water-0.8nm.xyz")
    frac = atoms.get_scaled_positions(wrap=False)
    atoms.set_cell([[8.0, 0.0, 0.0], [1.6, 7.7, 0.0], [-1.2, 0.9, 7.6]])
    atoms.set_scaled_positions(frac)
    return atoms


def water_box_270():
    # 270 atoms: above CELL_LIST_MIN_ATOMS, so "auto" bins the atoms.
    atoms = read_molecule("water-0.8nm.xyz").repeat((3, 3, 1))
    atoms.rattle(0.05, seed=11)
    return atoms


def ase_stress(model, atoms, kind, properties=("stress",)):
    calc = torchani.ase.Calculator(model, stress_kind=kind)
    calc.calculate(atoms.copy(), list(properties))
    return calc.results["stress"]


def fd_stress(model, atoms, h=1e-5):
    """(1/V) dE/d(strain) by central differences, positions and cell strained together."""
    species = torch.tensor(atoms.numbers).unsqueeze(0)
    coords = torch.tensor(atoms.positions, dtype=torch.float64).unsqueeze(0)
    cell = torch.tensor(atoms.cell.array, dtype=torch.float64)
    pbc = torch.tensor(atoms.pbc)

    def energy(a, b, s):
        deform = torch.eye(3, dtype=torch.float64)
        deform[a, b] += s / 2
        deform[b, a] += s / 2
        with torch.no_grad():
            e = model((species, coords @ deform), cell=cell @ deform, pbc=pbc).energies
        return e.item() * ase.units.Hartree

    virial = np.zeros((3, 3))
    for a in range(3):
        for b in range(a, 3):
            virial[a, b] = virial[b, a] = (energy(a, b, h) - energy(a, b, -h)) / (2 * h)
    return virial / abs(np.linalg.det(atoms.cell.array))


@pytest.fixture(scope="module")
def benzene_reference(models):
    """TorchANI's stress of the benzene crystal, both kinds (computed once)."""
    ref, _ = models
    atoms = read_molecule("benzene.xyz")
    return {kind: ase_stress(ref, atoms, kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_benzene_stress_matches_torchani(models, benzene_reference, kind):
    _, fast = models
    got = ase_stress(fast, read_molecule("benzene.xyz"), kind)
    np.testing.assert_allclose(got, benzene_reference[kind], rtol=0, atol=ATOL_EXACT)


def test_benzene_stress_matches_finite_difference(models, benzene_reference):
    # The patched model's strain derivative; with the test above, both kinds of
    # both models equal it.
    _, fast = models
    expected = fd_stress(fast, read_molecule("benzene.xyz"))
    for kind in KINDS:
        np.testing.assert_allclose(benzene_reference[kind], expected, rtol=0, atol=ATOL_FD)


@pytest.mark.parametrize("strategy", ["all_pairs", "cell_list"])
def test_stress_unchanged_by_lattice_translations(models, benzene_reference, strategy):
    # Atoms far outside the cell must be wrapped; the stress is that of the same
    # crystal. (TorchANI's cell_list gives a wrong 'scaling' stress here.)
    _, fast = models
    far = translated(read_molecule("benzene.xyz"), 2, -50, 51)
    fast.neighborlist.set_strategy(strategy)
    try:
        for kind in KINDS:
            np.testing.assert_allclose(ase_stress(fast, far, kind), benzene_reference[kind],
                                       rtol=0, atol=ATOL_EXACT)
    finally:
        fast.neighborlist.set_strategy("auto")


def test_triclinic_small_cell_translated(models):
    # Several images per pair, atoms out of the cell: finite differences for both
    # kinds, and TorchANI for forces + stress in one calculate() ('fdotr' then
    # marks diff vectors that already require grad through the coordinates).
    ref, fast = models
    atoms = translated(triclinic_water(), 1)
    expected = fd_stress(fast, atoms)
    for kind in KINDS:
        np.testing.assert_allclose(ase_stress(fast, atoms, kind), expected, rtol=0, atol=ATOL_FD)
    props = ["energy", "forces", "stress"]
    got = torchani.ase.Calculator(fast, stress_kind="fdotr")
    want = torchani.ase.Calculator(ref, stress_kind="fdotr")
    got.calculate(atoms.copy(), props)
    want.calculate(atoms.copy(), props)
    np.testing.assert_allclose(got.results["stress"], want.results["stress"], rtol=0,
                               atol=ATOL_EXACT)
    np.testing.assert_allclose(got.results["forces"], want.results["forces"], rtol=0,
                               atol=1e-9 * ase.units.Hartree)


def test_stress_binned_box_with_atoms_outside(models):
    # The cell-list path (auto, 270 atoms) with atoms out of the cell, against
    # TorchANI's all_pairs ('scaling') and its own 'fdotr'.
    ref, fast = models
    atoms = translated(water_box_270(), 3)
    assert len(atoms) >= torchani_fast.aev.CELL_LIST_MIN_ATOMS
    got = ase_stress(fast, atoms, "scaling")
    np.testing.assert_allclose(got, ase_stress(ref, atoms, "scaling"), rtol=0, atol=ATOL_EXACT)
    np.testing.assert_allclose(got, ase_stress(fast, atoms, "fdotr"), rtol=0, atol=ATOL_EXACT)
