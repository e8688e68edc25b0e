"""TorchANI 2.9's newer models patched: repulsion, dispersion, charges, fallbacks.

Every ``torchani.models`` factory is built with its exact architecture and
seeded random weights (``torchani_fast.testing.random_model``: the published
weights cannot be downloaded) and compared, patched against stock, in the same
process: energies, forces, stress, Hessians, charges, float32 and float64,
padded batches, small triclinic cells, partial pbc, every element, atoms just
inside and outside each cutoff, TorchScript. Parts torchani_fast cannot yet
reproduce (the smooth-cutoff AEV, GELU/SingleNN networks) must stay
TorchANI's, with one warning per model.
"""
import contextlib
import copy
import inspect
import json
import math
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
import torchani
import torchani.grad
from torchani.neighbors import Neighbors, discard_outside_cutoff
from torchani.potentials import TwoBodyDispersionD3

import torchani_fast
import torchani_fast.models
from torchani_fast import cli, models
from torchani_fast.ase import Calculator
from torchani_fast.patch import kept_parts
from torchani_fast.potentials import FastDispersionD3, FastRepulsionXTB, UnboundedNeighborList

from support import energy_forces, read_molecule
from support_models import assert_close, molecule, numbers_of, pair, stock

FACTORIES = ["ANI1x", "ANI2x", "ANI1ccx", "ANI1xnr", "ANI2xr", "ANI2dr", "ANImbis", "ANIr2s",
             "ANIr2s_water", "ANIr2s_ch3cn", "ANIr2s_chcl3", "SnnANI2xr"]
# One of each architecture for the slower checks.
KINDS = ["ANI2xr", "ANI2dr", "ANImbis", "ANIr2s", "SnnANI2xr", "ANI1xnr"]
PERIODIC_OK = [n for n in FACTORIES if not n.startswith("ANIr2s")]  # ANIr2s: repulsion without cutoff

def triclinic_water(dtype=torch.float64):
    atoms = read_molecule("water-0.8nm.xyz")
    frac = atoms.get_scaled_positions(wrap=False)
    atoms.set_cell([[8.0, 0.0, 0.0], [1.6, 7.7, 0.0], [-1.2, 0.9, 7.6]])
    atoms.set_scaled_positions(frac)
    return atoms


# -- patch() on every factory ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", FACTORIES)
def test_energies_forces_every_element(name, dtype):
    ref, fast = pair(name, dtype)
    species, coords = molecule(ref, dtype=dtype)
    assert set(species.view(-1).tolist()) == set(numbers_of(ref))
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert e.dtype == dtype
    assert_close(e, e_ref, dtype)
    assert_close(f, f_ref, dtype, "forces")
    # The pair potentials are torchani_fast's, the neighbour list is ours.
    assert isinstance(fast.neighborlist, torchani_fast.aev.NeighborList)
    for key, pot in fast.potentials.items():
        if key != "nnp":
            assert type(pot) in (FastRepulsionXTB, FastDispersionD3)


@pytest.mark.parametrize("name", KINDS)
def test_padded_batch(name):
    ref, fast = pair(name)
    s1, x1 = molecule(ref, 20, seed=1)
    s2, x2 = molecule(ref, 13, seed=2)
    species = torch.full((2, 20), -1, dtype=torch.long)
    coords = torch.zeros(2, 20, 3, dtype=torch.float64)
    species[0], coords[0] = s1[0], x1[0]
    species[1, :13], coords[1, :13] = s2[0], x2[0] + 0.3
    coords[1, 13:] = 1e3  # padding coordinates are ignored
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_close(e, e_ref, torch.float64)
    assert_close(f, f_ref, torch.float64, "forces")
    assert (f[1, 13:] == 0).all()
    for k, (s, x) in enumerate([(s1, x1), (s2, x2[0:1] + 0.3)]):
        e_one, _ = energy_forces(fast, s, x)
        assert_close(e[k:k + 1], e_one, torch.float64)


@pytest.mark.parametrize("pbc", [[True, True, True], [True, False, True]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", PERIODIC_OK)
def test_small_triclinic_cell_and_partial_pbc(name, dtype, pbc):
    # The cell (~8 Å) is smaller than twice every cutoff (5.1-8.0 Å): atoms see
    # several images of one another. Partial pbc on the orthorhombic cell: TorchANI
    # maps positions to the central cell wrongly for aperiodic axes of a triclinic
    # one (tests/test_neighbors.py::test_per_axis_pbc checks ours there with an oracle).
    ref, fast = pair(name, dtype)
    atoms = triclinic_water() if all(pbc) else read_molecule("water-0.8nm.xyz")
    species = torch.tensor(atoms.numbers).unsqueeze(0)
    coords = torch.tensor(atoms.positions, dtype=dtype).unsqueeze(0)
    cell = torch.tensor(atoms.cell.array, dtype=dtype)
    pbc = torch.tensor(pbc)
    e_ref, f_ref = energy_forces(ref, species, coords, cell, pbc)
    e, f = energy_forces(fast, species, coords, cell, pbc)
    assert_close(e, e_ref, dtype)
    assert_close(f, f_ref, dtype, "forces")


def _dimers(distances, dtype=torch.float64):
    """C-H dimers at the given separations, 40 Å apart from one another (beyond every cutoff)."""
    zs, xs = [], []
    for k, d in enumerate(distances):
        zs += [6, 1]
        xs += [[40.0 * k, 0.0, 0.0], [40.0 * k + d, 0.0, 0.0]]
    return torch.tensor([zs]), torch.tensor([xs], dtype=dtype)


@pytest.mark.parametrize("name", ["ANI2xr", "ANI2dr", "ANImbis", "ANIr2s", "SnnANI2xr"])
def test_atoms_at_every_cutoff(name):
    ref, fast = pair(name)
    cutoffs = {float(ref.potentials["nnp"].aev_computer.radial.cutoff),
               float(ref.potentials["nnp"].aev_computer.angular.cutoff)}
    cutoffs |= {p.cutoff for k, p in ref.potentials.items() if k != "nnp" and math.isfinite(p.cutoff)}
    distances = [c + s for c in sorted(cutoffs) for s in (-9e-5, -1e-5, 1e-5, 9e-5)]
    species, coords = _dimers(distances)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_close(e, e_ref, torch.float64)
    assert_close(f, f_ref, torch.float64, "forces")
    # Each dimer alone gives the same: the 40 Å gaps contribute nothing (finite cutoffs).
    if math.isfinite(ref.cutoff):
        parts = sum(energy_forces(fast, species[:, 2 * k:2 * k + 2], coords[:, 2 * k:2 * k + 2])[0]
                    for k in range(len(distances)))
        assert_close(e, parts, torch.float64)


def test_repulsion_and_dispersion_pairs_just_inside_their_cutoffs_count():
    """An oracle independent of TorchANI's pipeline: the pair terms of one C-H
    dimer at 8.0 - 1e-5 Å (inside the dispersion cutoff only) and at 5.2 - 1e-5 Å
    (inside both), summed by hand from the TorchANI modules' pair_energies."""
    ref, fast = pair("ANI2dr")
    for d in (8.0 - 1e-5, 5.2 - 1e-5, 5.2 + 1e-5):
        species, coords = _dimers([d])
        elem = fast.species_converter(species)
        total = 0.0
        for key in ("repulsion_xtb", "dispersion_d3"):
            pot = ref.potentials[key]
            dist = torch.tensor([d], dtype=torch.float64)
            nb = Neighbors(torch.tensor([[0], [1]]), dist, coords[0, :1] - coords[0, 1:])
            if d <= pot.cutoff:
                total += float(pot._pair_energies_wrapper(elem, nb)[0])
        whole = fast.compute_from_neighbors(elem, coords, fast.neighborlist(fast.cutoff, elem, coords))
        nnp_only = fast.potentials["nnp"].compute_from_neighbors(
            elem, coords, discard_outside_cutoff(fast.neighborlist(fast.cutoff, elem, coords),
                                                 fast.potentials["nnp"].cutoff)).energies
        shift = fast.energy_shifter(elem)
        torch.testing.assert_close(whole.energies, nnp_only + shift + total, rtol=1e-12, atol=1e-14)


# -- the fallbacks and their warning ------------------------------------------------------------


def test_fallback_warns_once_and_names_the_part():
    # SnnANI2xr's members are one network with an element embedding: TorchANI's stay.
    model = stock("SnnANI2xr")
    with pytest.warns(UserWarning, match="keeps TorchANI's neural networks for this model"):
        torchani_fast.patch(model)
    assert set(kept_parts(model)) == {"neural networks"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchani_fast.patch(model)  # a second call does not warn again
        torchani_fast.patch(model, neighborlist="cell_list")
    assert model.neighborlist.strategy == "cell_list"
    # Another model warns again (once per model).
    with pytest.warns(UserWarning, match="keeps TorchANI's"):
        torchani_fast.patch(stock("SnnANI2xr"))


def test_a_kept_aev_computer_searches_with_our_neighbour_list():
    from torchani.cutoffs import CutoffBiweight

    model = stock("ANI2x")
    aevc = model.potentials["nnp"].aev_computer
    aevc.radial.cutoff_fn = aevc.angular.cutoff_fn = CutoffBiweight()
    with pytest.warns(UserWarning, match="keeps TorchANI's AEV computer for this model: .*CutoffBiweight"):
        torchani_fast.patch(model)
    assert set(kept_parts(model)) == {"AEV computer"}
    assert model.potentials["nnp"].aev_computer is aevc
    assert aevc.neighborlist is model.neighborlist


@pytest.mark.parametrize("name", ["ANI2x", "ANI1x", "ANI1xnr", "ANImbis", "ANI2xr", "ANI2dr", "ANIr2s"])
def test_fully_supported_models_do_not_warn(name):
    model = stock(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchani_fast.patch(model)
    assert kept_parts(model) == {}
    assert isinstance(model.potentials["nnp"].aev_computer, torchani_fast.AEVComputer)


def test_state_dict_unchanged():
    ref, fast = pair("ANI2dr")
    a, b = ref.state_dict(), fast.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Loading a state dict into the patched model reaches the (same) buffers.
    other = stock("ANI2dr")
    other.potentials["repulsion_xtb"].y_ab.mul_(2.0)
    fast.load_state_dict(other.state_dict())
    species, coords = molecule(ref)
    torch.testing.assert_close(energy_forces(fast, species, coords)[0],
                               energy_forces(other, species, coords)[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["ANImbis", "ANI2dr"])
def test_aev_ignores_pairs_beyond_its_cutoff(name):
    # The model's one list has the largest cutoff (8 Å with dispersion); the AEV
    # op given it directly must give the AEV of the list narrowed to its cutoff.
    ref, fast = pair(name)
    species, coords = molecule(ref, 30)
    coords = coords * 2.0  # 2.8 Å apart: pairs from 2 to 12 Å
    elem = fast.species_converter(species)
    wide = fast.neighborlist(8.0, elem, coords)
    aev_fast = fast.potentials["nnp"].aev_computer
    cutoff = float(aev_fast.radial.cutoff)
    narrow = discard_outside_cutoff(wide, cutoff)
    assert wide.indices.shape[1] > narrow.indices.shape[1]
    expected = ref.potentials["nnp"].aev_computer.compute_from_neighbors(elem, coords, narrow)
    got_wide = aev_fast.compute_from_neighbors(elem, coords, wide)
    got_narrow = aev_fast.compute_from_neighbors(elem, coords, narrow)
    torch.testing.assert_close(got_wide, got_narrow, rtol=0, atol=1e-14)
    torch.testing.assert_close(got_wide, expected, rtol=0, atol=1e-12)


# -- the pair potentials alone ----------------------------------------------------------------


def _potentials(name="ANI2dr"):
    ref, fast = pair(name)
    return [(ref.potentials[k], fast.potentials[k]) for k in ("repulsion_xtb", "dispersion_d3")
            if k in ref.potentials]


@pytest.mark.parametrize("atomic", [False, True])
def test_pair_potentials_match_torchani_on_one_list(atomic):
    ref, fast = pair("ANI2dr")
    species, coords = molecule(ref, 20)
    species = torch.cat([species, species], 0)
    coords = torch.cat([coords, coords.flip(1)], 0)
    species[1, -3:] = -1
    elem = fast.species_converter(species)
    wide = fast.neighborlist(fast.cutoff, elem, coords)
    ghosts = torch.zeros_like(species, dtype=torch.bool)
    ghosts[0, :4] = True
    for slow, quick in _potentials():
        assert isinstance(quick, type(slow).__mro__[0]) and type(quick) is not type(slow)
        nb = discard_outside_cutoff(wide, slow.cutoff)
        for flags in (None, ghosts):
            a = slow.compute_from_neighbors(elem, coords, nb, atomic=atomic, ghost_flags=flags).energies
            b = quick.compute_from_neighbors(elem, coords, nb, atomic=atomic, ghost_flags=flags).energies
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-16)


def _pure_neighbors(coords, idx):
    diff = coords.view(-1, 3)[idx[0]] - coords.view(-1, 3)[idx[1]]
    return Neighbors(idx, diff.norm(dim=-1), diff)


def test_pair_potentials_gradcheck_gradgradcheck():
    ref, fast = pair("ANI2dr")
    species, coords = molecule(ref, 7, seed=3)
    elem = fast.species_converter(species)
    idx = fast.neighborlist(fast.cutoff, elem, coords).indices
    for _, quick in _potentials():
        def f(x):
            return quick.compute_from_neighbors(elem, x, _pure_neighbors(x, idx), atomic=True).energies

        x = coords.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(f, (x,))
        assert torch.autograd.gradgradcheck(f, (x,))


def test_d3_grid_check_refuses_a_non_product_grid():
    from torchani_fast.potentials import d3_unsupported_reason, fast_unsupported_reason

    ref = stock("ANI2dr")
    pot = ref.potentials["dispersion_d3"]
    assert d3_unsupported_reason(pot) is None
    pot.precalc_coordnums_a[0, 1, 0, 0] += 0.5  # no longer the same for every partner
    assert "product grid" in d3_unsupported_reason(pot)
    assert "product grid" in fast_unsupported_reason(pot)
    assert type(pot) is TwoBodyDispersionD3
    with pytest.warns(UserWarning, match="TwoBodyDispersionD3 potential 'dispersion_d3'"):
        torchani_fast.patch(ref)
    assert type(ref.potentials["dispersion_d3"]) is TwoBodyDispersionD3
    assert type(ref.potentials["repulsion_xtb"]) is FastRepulsionXTB
    # The kept TorchANI module gives TorchANI's numbers for the modified table.
    modified = stock("ANI2dr")
    modified.potentials["dispersion_d3"].precalc_coordnums_a[0, 1, 0, 0] += 0.5
    species, coords = molecule(modified)
    assert_close(energy_forces(ref, species, coords)[0], energy_forces(modified, species, coords)[0],
                 torch.float64)


# -- charges ----------------------------------------------------------------------------------


def test_animbis_charges_and_energies():
    ref, fast = pair("ANImbis")
    species, coords = molecule(ref, 20)
    species = torch.cat([species, species], 0)
    coords = torch.cat([coords, coords * 1.05], 0)
    species[1, -2:] = -1
    out_ref = ref((species, coords))
    out = fast((species, coords))
    assert type(out).__name__ == type(out_ref).__name__ == "SpeciesEnergiesAtomicCharges"
    torch.testing.assert_close(out.energies, out_ref.energies, rtol=1e-10, atol=0)
    torch.testing.assert_close(out.atomic_charges, out_ref.atomic_charges, rtol=0, atol=1e-12)
    # The normaliser makes every molecule neutral (TorchANI's, kept exactly).
    torch.testing.assert_close(out.atomic_charges.sum(1), torch.zeros(2, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert (out.atomic_charges[1, -2:] == 0).all()
    # Charges are differentiable like TorchANI's.
    x = coords.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fast((species, x)).atomic_charges[:, 0].sum(), x)
    x2 = coords.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(ref((species, x2)).atomic_charges[:, 0].sum(), x2)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10)


def test_animbis_ensemble_and_periodic():
    ref, fast = pair("ANImbis", model_index=None)
    atoms = triclinic_water()
    species = torch.tensor(atoms.numbers).unsqueeze(0)
    coords = torch.tensor(atoms.positions).unsqueeze(0)
    cell, pbc = torch.tensor(atoms.cell.array), torch.tensor([True, True, True])
    a, b = ref((species, coords), cell, pbc), fast((species, coords), cell, pbc)
    torch.testing.assert_close(b.energies, a.energies, rtol=1e-10, atol=0)
    torch.testing.assert_close(b.atomic_charges, a.atomic_charges, rtol=0, atol=1e-12)


# -- ANIr2s: no repulsion cutoff ------------------------------------------------------------------


def test_anir2s_all_pairs_and_refuses_periodic():
    ref, fast = pair("ANIr2s")
    assert math.isinf(fast.cutoff) and isinstance(fast.neighborlist, UnboundedNeighborList)
    species, coords = _dimers([3.0, 12.0])  # the 40+ Å pairs still repel (no cutoff)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_close(e, e_ref, torch.float64)
    assert_close(f, f_ref, torch.float64, "forces")
    atoms = triclinic_water()
    species = torch.tensor(atoms.numbers).unsqueeze(0)
    coords = torch.tensor(atoms.positions).unsqueeze(0)
    with pytest.raises(ValueError, match="cutoff=inf.*pbc"):
        fast((species, coords), torch.tensor(atoms.cell.array), torch.tensor([True, False, False]))


# -- entry points: ensemble, TorchScript, ASE, Hessians, step, factories, CLI --------------------------


def test_ensemble_entry_points():
    ref, fast = pair("ANI2dr", model_index=None)
    species, coords = molecule(ref, 16)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(fast, species, coords)
    assert_close(e, e_ref, torch.float64)
    assert_close(f, f_ref, torch.float64, "forces")
    torch.testing.assert_close(fast.atomic_energies((species, coords)).energies,
                               ref.atomic_energies((species, coords)).energies, rtol=0, atol=1e-10)
    q, q_ref = fast.energies_qbcs((species, coords)), ref.energies_qbcs((species, coords))
    torch.testing.assert_close(q.qbcs, q_ref.qbcs, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(fast[3]((species, coords)).energies, ref[3]((species, coords)).energies,
                               rtol=1e-10, atol=0)


_SCRIPT_CHECK = """
import sys, warnings, torch
warnings.simplefilter("ignore")
sys.path.insert(0, {tests!r})
from support_models import pair, molecule, assert_close
from support import energy_forces
ref, fast = pair({name!r})
species, coords = molecule(ref, 14)
scripted = torch.jit.script(fast)
torch.jit.save(scripted, {path!r})
loaded = torch.jit.load({path!r})
e_ref, f_ref = energy_forces(ref, species, coords)
for m in (scripted, loaded):
    e, f = energy_forces(m, species, coords)
    assert_close(e, e_ref, torch.float64)
    assert_close(f, f_ref, torch.float64, "forces")
print("OK")
"""


@pytest.mark.parametrize("name", ["ANI2dr", "ANImbis", "ANIr2s"])
def test_torchscript_save_load(name, tmp_path):
    # Each model in a fresh process: in one process, scripting an ANI-2dr and then
    # an ANIr2s (or the reverse) gives the second scripted model a wrong energy
    # (~0.01 Ha), for stock TorchANI models as for patched ones, although each of
    # its potentials, scripted, gives the eager value (a TorchScript/TorchANI
    # issue; see the pairpot report).
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = _SCRIPT_CHECK.format(tests=str(Path(__file__).parent), name=name, path=str(tmp_path / "m.pt"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


@pytest.mark.parametrize("kind", ["scaling", "fdotr"])
@pytest.mark.parametrize("name", ["ANI2dr", "ANI2xr", "ANImbis"])
def test_ase_energy_forces_stress(name, kind):
    ref, fast = pair(name)
    atoms = triclinic_water()
    atoms.calc = torchani.ase.Calculator(ref)
    e_ref, f_ref, s_ref = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    mine = atoms.copy()
    mine.calc = Calculator(fast, stress_kind=kind)
    np.testing.assert_allclose(mine.get_potential_energy(), e_ref, rtol=1e-10, atol=0)
    np.testing.assert_allclose(mine.get_forces(), f_ref, rtol=0, atol=1e-8)
    np.testing.assert_allclose(mine.get_stress(), s_ref, rtol=0, atol=1e-10)


def test_d3_coordination_numbers_jump_at_the_cutoff_as_in_torchani():
    """TorchANI's D3 counts neighbours for the coordination numbers without an
    envelope, up to the dispersion cutoff: a third atom crossing 8 Å changes the
    C6 of the other pairs by a step (so the energy is not continuous there, and
    finite differences across such a crossing do not match the forces). The
    patched model reproduces the step exactly; the smooth envelope of the pair
    energies themselves makes no step."""
    ref, fast = pair("ANI2dr")
    steps = []
    for model in (ref, fast):
        e = []
        for d in (8.0 - 1e-7, 8.0 + 1e-7):
            species = torch.tensor([[6, 6, 1]])
            coords = torch.tensor([[[0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [-d, 0.0, 0.0]]], dtype=torch.float64)
            e.append(model.potentials["dispersion_d3"].compute_from_neighbors(
                model.species_converter(species), coords,
                discard_outside_cutoff(fast.neighborlist(8.0, fast.species_converter(species), coords), 8.0),
            ).energies)
        steps.append(float(e[0] - e[1]))
    assert abs(steps[0]) > 1e-12  # a step, not a 1e-7 Å slope
    assert steps[1] == pytest.approx(steps[0], rel=1e-9)


def test_stress_against_finite_differences():
    """Stress of ANI-2xr (repulsion at 5.2 Å in an 8 Å cell) against central
    differences of E(strain). (ANI-2dr: see the test above; its stress is
    compared with TorchANI's in test_ase_energy_forces_stress.)"""
    _, fast = pair("ANI2xr")
    atoms = triclinic_water()
    atoms.calc = Calculator(fast, stress_kind="scaling")
    stress = atoms.get_stress(voigt=False)
    h = 1e-5
    fd = np.zeros((3, 3))
    cell0, pos0 = atoms.cell.array.copy(), atoms.positions.copy()
    for i in range(3):
        for j in range(3):
            es = []
            for sign in (1, -1):
                eps = np.zeros((3, 3))
                eps[i, j] = eps[j, i] = sign * h / 2 if i != j else sign * h
                probe = atoms.copy()
                probe.calc = Calculator(fast)
                probe.set_cell(cell0 @ (np.eye(3) + eps), scale_atoms=False)
                probe.positions = pos0 @ (np.eye(3) + eps)
                es.append(probe.get_potential_energy())
            fd[i, j] = (es[0] - es[1]) / (2 * h) / atoms.get_volume()
    np.testing.assert_allclose(stress, fd, rtol=0, atol=2e-8)


@pytest.mark.parametrize("name", ["ANI2dr", "ANI2xr", "ANImbis", "ANIr2s"])
def test_hessians(name):
    ref, fast = pair(name)
    species, coords = molecule(ref, 6, seed=5)
    expected = torchani.grad.energies_forces_and_hessians(ref, species, coords.clone())
    got = torchani_fast.models.energies_forces_hessians(fast, species, coords)
    torch.testing.assert_close(got.energies, expected.energies.detach(), rtol=1e-10, atol=0)
    torch.testing.assert_close(got.forces, expected.forces.detach(), rtol=0, atol=1e-9)
    torch.testing.assert_close(got.hessians, expected.hessians.detach(), rtol=0, atol=1e-8)
    # and against a finite difference of the forces (independent of autograd)
    h = 1e-5
    k = 4  # x of atom 1
    x = coords.clone().view(1, -1)
    xp, xm = x.clone(), x.clone()
    xp[0, k] += h
    xm[0, k] -= h
    fp = torchani_fast.models.energies_forces(fast, species, xp.view_as(coords)).forces.view(-1)
    fm = torchani_fast.models.energies_forces(fast, species, xm.view_as(coords)).forces.view(-1)
    torch.testing.assert_close(got.hessians[0, k], -(fp - fm) / (2 * h), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["ANI2xr", "ANI2dr", "ANIr2s", "ANImbis"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_energy_forces_step_with_pair_potentials(name, dtype):
    # The step evaluates repulsion and dispersion from its one fixed-capacity list
    # (at the model's cutoff: 8 Å with D3, every pair for ANIr2s): TorchANI's
    # energies and forces over geometries the step did not see when built.
    ref, fast = pair(name, dtype)
    species, coords = molecule(fast, 20, dtype=dtype)
    step = torchani_fast.EnergyForcesStep(fast, species, coords)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = coords + 0.1 * torch.randn(coords.shape, generator=g, dtype=torch.float64).to(dtype)
        e, f = step(x)
        e_ref, f_ref = energy_forces(ref, species, x)
        assert_close(e, e_ref, dtype)
        assert_close(f, f_ref, dtype, "forces")
        # One composition of the energy (torchani_fast.core): the step's bits are a model call's.
        e_model, f_model = fast.energies_forces(species, x)
        assert torch.equal(e, e_model) and torch.equal(f, f_model)


def test_energy_forces_step_with_dispersion_in_a_small_periodic_cell():
    ref, fast = pair("ANI2dr")
    atoms = triclinic_water()
    species = torch.tensor(atoms.numbers).unsqueeze(0)
    coords = torch.tensor(atoms.positions).unsqueeze(0)
    cell, pbc = torch.tensor(atoms.cell.array), torch.tensor([True, True, True])
    step = torchani_fast.EnergyForcesStep(fast, species, coords, cell, pbc)
    x = coords + 0.05
    e, f = step(x)
    e_ref, f_ref = energy_forces(ref, species, x, cell, pbc)
    assert_close(e, e_ref, torch.float64)
    assert_close(f, f_ref, torch.float64, "forces")
    # Without the pair potentials it is the ANI potential alone (ANI-2xr's smooth-cutoff
    # AEV and GELU networks in the step).
    for name in ("repulsion_xtb", "dispersion_d3"):
        fast.potentials[name]._enabled = ref.potentials[name]._enabled = False
    fast._has_extra_potentials = fast._check_has_extra_potentials()
    ref._has_extra_potentials = ref._check_has_extra_potentials()
    step = torchani_fast.EnergyForcesStep(fast, species, coords, cell, pbc)
    e, f = step(x)
    e_ref, f_ref = energy_forces(ref, species, x, cell, pbc)
    assert_close(e, e_ref, torch.float64)
    assert_close(f, f_ref, torch.float64, "forces")


def test_energy_forces_step_refuses_a_kept_potential_and_a_kept_aev():
    _, fast = pair("ANI2xr")
    species, coords = molecule(fast, 8)
    fast.potentials["repulsion_xtb"].__class__ = torchani.potentials.RepulsionXTB  # as if kept
    with pytest.raises(NotImplementedError, match=r"also has \['repulsion_xtb'\]"):
        torchani_fast.EnergyForcesStep(fast, species, coords)
    # A model whose AEV stays TorchANI's is refused, naming why.
    from torchani.cutoffs import CutoffBiweight

    model = stock("ANI2x")
    aevc = model.potentials["nnp"].aev_computer
    aevc.radial.cutoff_fn = aevc.angular.cutoff_fn = CutoffBiweight()
    with pytest.warns(UserWarning, match="keeps TorchANI's AEV computer"):
        torchani_fast.patch(model)
    with pytest.raises(NotImplementedError, match="needs torchani_fast's AEV.*CutoffBiweight"):
        torchani_fast.EnergyForcesStep(model, species, coords)


@contextlib.contextmanager
def _no_weights():
    """TorchANI's factories with the weight fetch and loads replaced, as random_model does."""
    from torchani_fast.testing import _NoWeights

    def no_load(module, state_dict, *args, **kw):
        return torch.nn.modules.module._IncompatibleKeys([], [])

    with torch.random.fork_rng(), warnings.catch_warnings(), \
            mock.patch.object(torchani.models, "_fetch_state_dict", lambda *a, **k: _NoWeights()), \
            mock.patch.object(torch.nn.Module, "load_state_dict", no_load):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        yield


@pytest.mark.parametrize("name", FACTORIES)
def test_factories_same_signature_and_patched(name):
    ours, theirs = getattr(torchani_fast.models, name), getattr(torchani.models, name)
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)
    assert torchani_fast.models.MODELS[name] is ours
    with _no_weights():
        model = ours(model_index=0, dtype=torch.float64, neighborlist="all_pairs")
    assert torchani_fast.is_patched(model) and model.neighborlist.strategy == "all_pairs"
    ref = stock(name)
    species, coords = molecule(ref, 10)
    assert_close(energy_forces(model, species, coords)[0], energy_forces(ref, species, coords)[0],
                 torch.float64)
    with pytest.raises(ValueError, match="strategy"):
        with _no_weights():
            ours(model_index=0, strategy="nope")


@pytest.mark.parametrize("name", ["ANI2dr", "ANImbis", "ANI1xnr"])
def test_cli_energy(name, tmp_path, monkeypatch):
    ref, fast = pair(name)
    monkeypatch.setitem(models._LOADED, models.cache_key(name, dtype=torch.float64), fast)
    species, coords = molecule(ref, 12)
    import ase
    import ase.io

    path = tmp_path / "mol.xyz"
    ase.io.write(path, ase.Atoms(numbers=species[0].numpy(), positions=coords[0].numpy()))
    out = tmp_path / "out.json"
    assert cli.main(["energy", str(path), "-m", name.lower(), "--forces", "-t", "f64", "-d", "cpu",
                     "--no-progress", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    atoms = ase.io.read(path)  # the file's rounding of the positions
    coords = torch.tensor(atoms.positions).unsqueeze(0)
    e, f = energy_forces(ref, species, coords)
    assert data["energies"][0] == pytest.approx(float(e[0]), rel=1e-10)
    np.testing.assert_allclose(np.array(data["forces"][0]), f[0].numpy(), rtol=0, atol=1e-9)


def test_cli_refuses_periodic_anir2s_and_wrong_elements(tmp_path, capsys):
    import ase.io

    path = tmp_path / "water.xyz"
    ase.io.write(path, triclinic_water())
    assert cli.main(["energy", str(path), "-m", "ANIr2s", "--no-progress"]) != 0
    assert "repulsion without cutoff" in capsys.readouterr().err
    cl = tmp_path / "cl.xyz"
    ase.io.write(cl, ase.Atoms("CCl", positions=[[0, 0, 0], [1.7, 0, 0]]))
    assert cli.main(["energy", str(cl), "-m", "ANI1xnr", "--no-progress"]) != 0
    assert "Cl" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["ANI2dr", "ANImbis", "ANIr2s"])
def test_the_model_list_is_not_copied_per_potential(name, monkeypatch):
    # torchani_fast's AEV and pair ops skip pairs beyond their cutoff: the patched model
    # hands them its one list (TorchANI copies it per potential); the same numbers.
    import torchani_fast.core as core

    ref, fast = pair(name)
    species, coords = molecule(fast, 20)
    scripted = torch.jit.script(fast)  # (before the counting function replaces TorchANI's)
    copies = []
    monkeypatch.setattr(core, "discard_outside_cutoff",
                        lambda nb, cutoff: copies.append(cutoff) or discard_outside_cutoff(nb, cutoff))
    for model in (fast, scripted):
        e, f = energy_forces(model, species, coords)
        e_ref, f_ref = energy_forces(ref, species, coords)
        assert_close(e, e_ref, torch.float64)
        assert_close(f, f_ref, torch.float64, "forces")
    assert copies == []
    # A potential the model keeps as TorchANI's gets its copy, as in TorchANI.
    if "dispersion_d3" in fast.potentials:
        fast.potentials["dispersion_d3"].fast_cutoff_kind = -1  # (the ATen code: reads its own pairs)
        e, f = energy_forces(fast, species, coords)
        assert copies == [fast.potentials["dispersion_d3"].cutoff]
        e_ref, f_ref = energy_forces(ref, species, coords)
        assert_close(e, e_ref, torch.float64)
        assert_close(f, f_ref, torch.float64, "forces")


@pytest.mark.parametrize("name", ["ANI2xr", "ANImbis", "user subclass"])
def test_full_model_pickle_round_trip(name, tmp_path):
    # torch.save(model) of a patched model: its class is found again by name
    # (patch.PatchedANI / PatchedANIq; a user's subclass of ANI: _front_door's).
    ref = stock("ANI2xr" if name == "user subclass" else name)
    if name == "user subclass":
        ref.__class__ = type("MyANI", (type(ref),), {"__module__": __name__})
        globals()["MyANI"] = type(ref)  # (pickle finds the user's class in its module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = torchani_fast.patch(copy.deepcopy(ref))
    assert type(fast).__name__ == "Patched" + type(ref).__name__ and isinstance(fast, type(ref))
    torch.save(fast, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is type(fast)
    species, coords = molecule(fast, 12)
    e_ref, f_ref = energy_forces(ref, species, coords)
    e, f = energy_forces(loaded, species, coords)
    assert_close(e, e_ref, torch.float64)
    assert_close(f, f_ref, torch.float64, "forces")
