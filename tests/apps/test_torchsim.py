"""torchani_fast.torchsim.ANIModel: ANI as a torch-sim ModelInterface.

Energies and forces of a torch-sim state equal TorchANI's on each system alone
(eV: TorchANI's Hartree times ASE's Hartree); the stress equals torchani_fast's
ASE calculator's; torch-sim's own FIRE relaxes to ASE FIRE's minimum, and its
NVE integrator conserves the energy with this model.
"""
import copy

import numpy as np
import pytest
import torch

ts = pytest.importorskip("torch_sim", reason="torch-sim-atomistic is not installed")

import torchani_fast  # noqa: E402
from torchani_fast.torchsim import ANIModel  # noqa: E402
from support import read_molecule as _read

pytestmark = pytest.mark.usefixtures("weights")


@pytest.fixture(scope="module")
def models():
    import torchani

    stock = torchani.models.ANI2x().double()
    return stock, torchani_fast.patch(copy.deepcopy(stock))


def _molecules():
    rng = np.random.default_rng(0)
    out = [_read("3lka_ligand.xyz"), _read("CH4-5.xyz", 0), _read("2iuz_ligand.xyz")]
    for a in out:
        a.positions += rng.normal(scale=0.05, size=a.positions.shape)
    return out


def _stock_alone(stock, atoms):
    import ase.units

    species = torch.tensor(atoms.numbers).unsqueeze(0)
    x = torch.tensor(atoms.positions, dtype=torch.float64).unsqueeze(0).requires_grad_(True)
    cell = pbc = None
    if atoms.pbc.any():
        cell, pbc = torch.tensor(atoms.cell.array, dtype=torch.float64), torch.tensor(atoms.pbc)
    e = stock((species, x), cell=cell, pbc=pbc).energies
    (g,) = torch.autograd.grad(e.sum(), x)
    return e.detach()[0] * ase.units.Hartree, -g[0] * ase.units.Hartree


def test_energies_forces_equal_torchani_per_system(models):
    stock, patched = models
    molecules = _molecules()
    model = ANIModel(patched)
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.float64)
    state = ts.io.atoms_to_state(molecules, model.device, model.dtype)
    positions = state.positions.clone()
    out = model(state)
    assert torch.equal(state.positions, positions)
    assert out["energy"].shape == (3,) and out["forces"].shape == (state.positions.shape[0], 3)
    assert "stress" not in out
    for k, atoms in enumerate(molecules):
        e, f = _stock_alone(stock, atoms)
        torch.testing.assert_close(out["energy"][k], e, rtol=1e-10, atol=0)
        torch.testing.assert_close(out["forces"][state.system_idx == k], f, rtol=1e-10, atol=1e-9)


def test_periodic_stress_equals_the_ase_calculator(models):
    stock, patched = models
    water = _read("water-0.8nm.xyz")
    boxes = [water, water.copy()]
    boxes[1].positions += np.random.default_rng(1).normal(scale=0.05, size=water.positions.shape)
    boxes[1].set_cell(water.cell.array * 1.02, scale_atoms=True)
    model = ANIModel(patched, compute_stress=True)
    out = model(ts.io.atoms_to_state(boxes, model.device, model.dtype))
    from ase.stress import voigt_6_to_full_3x3_stress

    for k, atoms in enumerate(boxes):
        a = atoms.copy()
        a.calc = patched.ase()
        torch.testing.assert_close(out["energy"][k].item(), a.get_potential_energy(), rtol=1e-10, atol=0)
        np.testing.assert_allclose(out["forces"][k * 30:(k + 1) * 30].numpy(), a.get_forces(), rtol=0, atol=1e-9)
        np.testing.assert_allclose(out["stress"][k].numpy(), voigt_6_to_full_3x3_stress(a.get_stress()),
                                   rtol=1e-8, atol=1e-12)
        e, _ = _stock_alone(stock, atoms)
        torch.testing.assert_close(out["energy"][k], e, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="compute_stress needs a periodic state"):
        model(ts.io.atoms_to_state(_molecules()[:1], model.device, model.dtype))


def test_torch_sim_fire_reaches_ase_minimum(models):
    import ase.optimize

    _, patched = models
    molecules = _molecules()[:2]
    model = ANIModel(patched)
    state = ts.io.atoms_to_state(molecules, model.device, model.dtype)
    final = ts.optimize(state, model, optimizer=ts.optimizers.fire, max_steps=2000,
                        convergence_fn=ts.generate_force_convergence_fn(0.01, include_cell_forces=False))
    out = model(final)
    for k, atoms in enumerate(molecules):
        fk = out["forces"][final.system_idx == k]
        assert float(fk.norm(dim=1).max()) < 0.01
        ref = atoms.copy()
        ref.calc = patched.ase()
        assert ase.optimize.FIRE(ref, logfile=None).run(fmax=0.01, steps=2000)
        # The same minimum: 1e-5 eV/atom, or lower.
        assert (out["energy"][k].item() - ref.get_potential_energy()) / len(atoms) < 1e-5


def test_torch_sim_nve_conserves_energy(models):
    _, patched = models
    molecules = _molecules()[:2]
    model = ANIModel(patched)
    state = ts.io.atoms_to_state(molecules, model.device, model.dtype)
    kT = torch.tensor(300 * ts.units.MetalUnits.temperature, dtype=torch.float64)
    init, step = ts.integrators.nve(model, dt=torch.tensor(0.5 * ts.units.MetalUnits.time,
                                                           dtype=torch.float64), kT=kT, seed=0)
    md = init(state)
    totals = []
    for _ in range(40):
        md = step(md)
        kinetic = ts.calc_kinetic_energy(momenta=md.momenta, masses=md.masses, system_idx=md.system_idx)
        totals.append(md.energy + kinetic)
    totals = torch.stack(totals)
    assert bool((totals.std(0) < 2e-3).all())  # eV, 40 steps of 0.5 fs
    assert bool((md.energy != totals[0]).all())  # it moved
