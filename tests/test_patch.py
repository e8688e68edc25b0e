"""A patched model against TorchANI 2.9: energies, forces and every entry point."""
import copy

import pytest
import torch

import torchani_fast

from support import (NONPERIODIC, PERIODIC, atoms_to_tensors, chloromethane, energy_forces, model_pair,
                      read_molecule, reference_model)


def assert_energy_close(got, expected, dtype):
    if dtype == torch.float64:
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
    else:  # a few ulps of the total energy
        ulp = torch.finfo(torch.float32).eps * expected.abs().max()
        assert (got - expected).abs().max() <= 8 * ulp, (got, expected)


def assert_forces_close(got, expected, dtype):
    atol = 1e-9 if dtype == torch.float64 else 5e-5
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NONPERIODIC + PERIODIC)
def test_energy_forces_match_torchani(name, dtype):
    ref, fast = model_pair("ANI2x", dtype)
    species, coords, cell, pbc = atoms_to_tensors(read_molecule(name), dtype)
    e_ref, f_ref = energy_forces(ref, species, coords, cell, pbc)
    e, f = energy_forces(fast, species, coords, cell, pbc)
    assert e.dtype == dtype and f.dtype == dtype
    assert_energy_close(e, e_ref, dtype)
    assert_forces_close(f, f_ref, dtype)


@pytest.mark.parametrize("name", ["ANI1x", "ANI1ccx"])
def test_other_models(name):
    ref, fast = model_pair(name, torch.float64)
    species, coords, _, _ = atoms_to_tensors(read_molecule("1hvj_ligand.xyz"))
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energy_close(e, e_ref, torch.float64)
    assert_forces_close(f, f_ref, torch.float64)


def padded_batch(names, dtype=torch.float64):
    mols = [read_molecule(n) for n in names]
    n = max(len(m) for m in mols)
    species = torch.full((len(mols), n), -1, dtype=torch.long)
    coords = torch.zeros(len(mols), n, 3, dtype=dtype)
    for i, m in enumerate(mols):
        species[i, : len(m)] = torch.tensor(m.numbers)
        coords[i, : len(m)] = torch.tensor(m.positions, dtype=dtype)
    return species, coords


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padded_batch_of_different_molecules(dtype):
    ref, fast = model_pair("ANI2x", dtype)
    species, coords = padded_batch(["3lka_ligand.xyz", "2iuz_ligand.xyz", "3hky_ligand.xyz"], dtype)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energy_close(e, e_ref, dtype)
    assert_forces_close(f, f_ref, dtype)
    assert (f[species < 0] == 0).all()


def test_chlorine():
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords = chloromethane()
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energy_close(e, e_ref, torch.float64)
    assert_forces_close(f, f_ref, torch.float64)


@pytest.fixture(scope="module")
def pair64():
    return model_pair("ANI2x", torch.float64)


@pytest.fixture(scope="module")
def batch64():
    return padded_batch(["3lka_ligand.xyz", "2iuz_ligand.xyz"])


def test_entry_points(pair64, batch64):
    ref, fast = pair64
    species, coords = batch64
    assert fast.cutoff == ref.cutoff
    assert fast.neighborlist is fast.potentials["nnp"].aev_computer.neighborlist
    assert len(fast) == len(ref) == 8
    torch.testing.assert_close(fast.atomic_energies((species, coords)).energies,
                               ref.atomic_energies((species, coords)).energies, rtol=1e-10, atol=1e-12)
    for atomic in (False, True):
        got = fast((species, coords), atomic=atomic, ensemble_values=True).energies
        exp = ref((species, coords), atomic=atomic, ensemble_values=True).energies
        assert got.shape == exp.shape
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)
    q_got, q_exp = fast.energies_qbcs((species, coords)), ref.energies_qbcs((species, coords))
    for a, b in zip(q_got, q_exp):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    fast.set_strategy("pyaev")  # accepted: a patched model always uses torchani_fast
    fast.set_strategy("auto")


def test_members_and_active_subsets(batch64):
    ref, fast = model_pair("ANI2x", torch.float64)
    species, coords = batch64
    for i in (0, 5):
        torch.testing.assert_close(fast[i]((species, coords)).energies,
                                   ref[i]((species, coords)).energies, rtol=1e-10, atol=0)
    ref.set_active_members([1, 4, 6])
    fast.set_active_members([1, 4, 6])
    assert len(fast) == 3
    torch.testing.assert_close(fast((species, coords)).energies,
                               ref((species, coords)).energies, rtol=1e-10, atol=0)


def test_model_index_and_float64_model():
    ref = reference_model("ANI2x", torch.float64)[3]
    fast = torchani_fast.patch(copy.deepcopy(ref))
    species, coords, _, _ = atoms_to_tensors(read_molecule("3lka_ligand.xyz"))
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_energy_close(e, e_ref, torch.float64)
    assert_forces_close(f, f_ref, torch.float64)


def test_to_before_and_after_patching():
    ref = reference_model("ANI2x", torch.float32)
    species, coords, _, _ = atoms_to_tensors(read_molecule("3lka_ligand.xyz"), torch.float64)
    e_ref, f_ref = energy_forces(ref.double(), species, coords)
    after = torchani_fast.patch(reference_model("ANI2x", torch.float32)).double()
    before = torchani_fast.patch(reference_model("ANI2x", torch.float32).double())
    for m in (after, before):
        e, f = energy_forces(m, species, coords)
        assert_energy_close(e, e_ref, torch.float64)
        assert_forces_close(f, f_ref, torch.float64)


def test_patch_twice_and_strict_state_dict(pair64, batch64):
    ref, fast = pair64
    species, coords = batch64
    again = torchani_fast.patch(fast)
    assert again is fast and torchani_fast.is_patched(fast)
    assert set(fast.state_dict()) == set(ref.state_dict())
    fresh = torchani_fast.patch(reference_model("ANI2x", torch.float32)).double()
    fresh.load_state_dict(ref.state_dict(), strict=True)
    torch.testing.assert_close(fresh((species, coords)).energies, ref((species, coords)).energies,
                               rtol=1e-10, atol=0)


def test_compute_from_neighbors_and_external(pair64):
    ref, fast = pair64
    species, coords, cell, pbc = atoms_to_tensors(read_molecule("benzene.xyz"))
    elem = ref.species_converter(species)
    neighbors = ref.neighborlist(ref.cutoff, elem, coords, cell, pbc)
    x = coords.clone().requires_grad_(True)
    diff = neighbors.diff_vectors.clone().requires_grad_(True)
    nb = type(neighbors)(neighbors.indices, diff.norm(2, -1), diff)
    e_ref = ref.compute_from_neighbors(elem, coords, nb).energies
    g_ref, = torch.autograd.grad(e_ref.sum(), diff)
    diff2 = neighbors.diff_vectors.clone().requires_grad_(True)
    nb2 = type(neighbors)(neighbors.indices, diff2.norm(2, -1), diff2)
    e = fast.compute_from_neighbors(elem, x, nb2).energies
    g, = torch.autograd.grad(e.sum(), diff2)
    torch.testing.assert_close(e, e_ref, rtol=1e-10, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-9)
    # External neighbours: coords in the central cell, pairs and shifts given.
    mol = read_molecule("water-0.8nm.xyz")
    mol.wrap()
    species, coords, cell, pbc = atoms_to_tensors(mol)
    elem = ref.species_converter(species)
    nbr = ref.neighborlist(ref.cutoff, elem, coords, cell, pbc)
    shifts = nbr.diff_vectors - (coords[0][nbr.indices[0]] - coords[0][nbr.indices[1]])
    args = (species, coords, nbr.indices, shifts)
    torch.testing.assert_close(fast.compute_from_external_neighbors(*args).energies,
                               ref.compute_from_external_neighbors(*args).energies, rtol=1e-10, atol=0)


def test_ase_entry_point(pair64):
    ref, fast = pair64
    atoms = read_molecule("benzene.xyz")
    results = []
    for m in (ref, fast):
        a = atoms.copy()
        a.calc = m.ase()
        results.append((a.get_potential_energy(), a.get_forces(), a.get_stress()))
    assert abs(results[0][0] - results[1][0]) <= 1e-9 * abs(results[0][0])
    torch.testing.assert_close(torch.tensor(results[1][1]), torch.tensor(results[0][1]), rtol=0, atol=1e-8)
    torch.testing.assert_close(torch.tensor(results[1][2]), torch.tensor(results[0][2]), rtol=0, atol=1e-9)


def test_unsupported_model_is_named():
    with pytest.raises(TypeError, match="ANI model"):
        torchani_fast.patch(torch.nn.Linear(2, 2))
    model = reference_model("ANI2x")
    aevc = model.potentials["nnp"].aev_computer
    from torchani.cutoffs import CutoffBiweight

    aevc.radial.cutoff_fn = aevc.angular.cutoff_fn = CutoffBiweight()
    ref = copy.deepcopy(model)
    # A featurizer torchani_fast does not reproduce stays TorchANI's, with a warning
    # naming it (tests/test_model_variants.py tests the newer models).
    with pytest.warns(UserWarning, match="keeps TorchANI's AEV computer.*CutoffBiweight"):
        torchani_fast.patch(model)
    assert model.potentials["nnp"].aev_computer is aevc
    species, coords, _, _ = atoms_to_tensors(read_molecule("2iuz_ligand.xyz"))
    torch.testing.assert_close(energy_forces(model, species, coords)[1],
                               energy_forces(ref, species, coords)[1], rtol=0, atol=1e-9)
