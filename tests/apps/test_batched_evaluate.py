"""torchani_fast.batched.pack / pad / energies_forces: many molecules in one padded call.

Every molecule's energy and forces must equal that molecule evaluated alone,
by the patched model and by stock TorchANI in this process (float64, 1e-10
relative), whatever sizes, elements and cells share the call.
"""
import copy

import numpy as np
import pytest
import torch

import torchani_fast
from torchani_fast import batched
from support import read_molecule as _read



@pytest.fixture(scope="module")
def models():
    import torchani

    stock = torchani.models.ANI2x().double()
    return stock, torchani_fast.patch(copy.deepcopy(stock))


def _alone(model, atoms):
    """(energy Ha, forces Ha/Å) of one structure through the model's own call."""
    species = torch.tensor(atoms.numbers).unsqueeze(0)
    x = torch.tensor(atoms.positions, dtype=torch.float64).unsqueeze(0).requires_grad_(True)
    cell = pbc = None
    if atoms.pbc.any():
        cell = torch.tensor(atoms.cell.array, dtype=torch.float64)
        pbc = torch.tensor(atoms.pbc)
    e = model((species, x), cell=cell, pbc=pbc).energies
    (g,) = torch.autograd.grad(e.sum(), x)
    return e.detach()[0], -g[0]


def _mixed():
    """Molecules of 5 to 46 atoms, of H C N O (and S/Cl where the ligands have them), shuffled."""
    rng = np.random.default_rng(3)
    lig = _read("2iuz_ligand.xyz")
    small = _read("3lka_ligand.xyz")
    ch4 = _read("CH4-5.xyz", ":3")
    out = [lig, ch4[0], small, ch4[1], lig.copy(), small.copy(), ch4[2]]
    for a in out:
        a.positions = a.positions + rng.normal(scale=0.05, size=a.positions.shape)
    return out


def test_pack_pad_round_trip():
    structures = _mixed()
    packed = batched.pack(structures)
    species, coords, column = batched.pad(packed.numbers, packed.positions, packed.system_idx)
    assert species.shape == (len(structures), max(len(a) for a in structures))
    for k, a in enumerate(structures):
        assert species[k, :len(a)].tolist() == a.numbers.tolist()
        assert bool((species[k, len(a):] == -1).all())
        assert torch.equal(coords[k, :len(a)], torch.from_numpy(a.positions))
    assert torch.equal(species[packed.system_idx, column], packed.numbers)


@pytest.mark.usefixtures("weights")
def test_mixed_molecules_equal_each_alone(models):
    stock, patched = models
    structures = _mixed()
    p = batched.pack(structures)
    e, f = batched.energies_forces(patched, p.numbers, p.positions, p.system_idx)
    assert e.shape == (len(structures),) and f.shape == (p.numbers.shape[0], 3)
    for k, atoms in enumerate(structures):
        rows = p.system_idx == k
        for model in (patched, stock):
            e1, f1 = _alone(model, atoms)
            torch.testing.assert_close(e[k], e1, rtol=1e-10, atol=0)
            torch.testing.assert_close(f[rows], f1, rtol=1e-10, atol=1e-10)


@pytest.mark.usefixtures("weights")
def test_cells_and_vacuum_in_one_packed_call(models):
    """Two periodic boxes with different cells and molecules in vacuum: each
    group gets its own model call, and every molecule equals itself alone."""
    stock, patched = models
    water = _read("water-0.8nm.xyz")
    benzene = _read("benzene.xyz")
    structures = [water, _read("CH4-5.xyz", 0), benzene, water.copy(), _read("3lka_ligand.xyz")]
    structures[3].positions += 0.03
    p = batched.pack(structures)
    assert p.cell is not None and p.pbc.shape == (5, 3)
    e, f = batched.energies_forces(patched, p.numbers, p.positions, p.system_idx, p.cell, p.pbc)
    for k, atoms in enumerate(structures):
        e1, f1 = _alone(stock, atoms)
        torch.testing.assert_close(e[k], e1, rtol=1e-10, atol=0)
        torch.testing.assert_close(f[p.system_idx == k], f1, rtol=1e-10, atol=1e-10)


def test_bad_layouts_are_named():
    numbers = torch.tensor([6, 1, 1])
    with pytest.raises(ValueError, match="system_idx must be ascending"):
        batched.pad(numbers, torch.zeros(3, 3), torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="must agree"):
        batched.energies_forces(torch.nn.Linear(1, 1), numbers, torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="positions must be a torch.Tensor"):
        batched.energies_forces(torch.nn.Linear(1, 1), numbers, np.zeros((3, 3)), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="structures is empty"):
        batched.pack([])
