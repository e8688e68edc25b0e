"""torchani_fast.ase.Calculator against torchani.ase.Calculator, and in ASE workflows."""
import numpy as np
import pytest
import torch
from ase.calculators.calculator import PropertyNotImplementedError

import torchani.ase
from torchani_fast.ase import Calculator
from support import model_pair, read_molecule


@pytest.fixture(scope="module")
def pair():
    return model_pair("ANI2x", torch.float64)


@pytest.fixture(scope="module")
def pair1(pair):
    """Member 0 of each ensemble: the same physics at 1/8 of the network cost, for
    the many-evaluation tests (optimisation, MD, vibrations)."""
    return pair[0][0], pair[1][0]


@pytest.fixture(scope="module")
def pair32():
    return model_pair("ANI2x", torch.float32)


def _all_properties(atoms):
    e = atoms.get_potential_energy()
    free = atoms.get_potential_energy(force_consistent=True)
    f = atoms.get_forces()
    s = atoms.get_stress(voigt=False) if atoms.pbc.any() else None
    return e, free, f, s


def _compare(ref_model, fast_model, atoms, stress_kind, tol_e, tol_f, tol_s, device="cpu"):
    a_ref, a_fast = atoms.copy(), atoms.copy()
    a_ref.calc = torchani.ase.Calculator(ref_model, stress_kind=stress_kind)
    a_fast.calc = Calculator(fast_model, stress_kind=stress_kind)
    e_ref, free_ref, f_ref, s_ref = _all_properties(a_ref)
    e, free, f, s = _all_properties(a_fast)
    assert isinstance(e, float) and f.shape == (len(atoms), 3) and f.dtype == np.float64
    assert e == pytest.approx(e_ref, rel=0, abs=tol_e)
    assert free == e
    np.testing.assert_allclose(f, f_ref, rtol=0, atol=tol_f)
    if s_ref is not None:
        np.testing.assert_allclose(s, s_ref, rtol=0, atol=tol_s)
        assert a_fast.get_stress().shape == (6,)
    assert a_fast.calc.evaluations == 1  # energy, forces and stress from one evaluation


@pytest.mark.parametrize("stress_kind", ["scaling", "fdotr"])
@pytest.mark.parametrize("name", ["benzene.xyz", "water-0.8nm.xyz"])
def test_periodic_matches_torchani_float64(pair, name, stress_kind):
    ref, fast = pair
    _compare(ref, fast, read_molecule(name), stress_kind, 1e-8, 1e-9, 1e-11)


def test_numerical_stress_matches_analytic(pair):
    # TorchANI's 'numerical' stress is a finite difference too; ours must agree with
    # the analytic stress (and with TorchANI's numerical one) to finite-difference accuracy.
    ref, fast = pair
    atoms = read_molecule("water-0.8nm.xyz")
    a_num, a_an, a_ref = atoms.copy(), atoms.copy(), atoms.copy()
    a_num.calc = Calculator(fast, stress_kind="numerical")
    a_an.calc = Calculator(fast)
    a_ref.calc = torchani.ase.Calculator(ref, stress_kind="numerical")
    np.testing.assert_allclose(a_num.get_stress(), a_an.get_stress(), rtol=0, atol=1e-8)
    np.testing.assert_allclose(a_num.get_stress(), a_ref.get_stress(), rtol=0, atol=1e-8)


def test_molecule_matches_torchani_float64(pair):
    ref, fast = pair
    _compare(ref, fast, read_molecule("2iuz_ligand.xyz"), "scaling", 1e-8, 1e-9, None)


def test_float32_matches_torchani(pair32):
    ref, fast = pair32
    # float32 energies of ~1e4 eV carry ~1e-3 eV of rounding; forces ~1e-4 eV/Å.
    _compare(ref, fast, read_molecule("benzene.xyz"), "scaling", 5e-3, 1e-3, 1e-5)
    _compare(ref, fast, read_molecule("3lka_ligand.xyz"), "fdotr", 5e-3, 1e-3, None)


def test_device(pair, device):
    ref, fast = pair
    atoms = read_molecule("3lka_ligand.xyz")
    fast_dev = fast.to(device)
    try:
        calc = Calculator(fast_dev)
        assert calc.device.type == device
        _compare(ref, fast_dev, atoms, "scaling", 1e-8, 1e-9, None)
    finally:
        fast.to("cpu")


def test_one_evaluation_serves_every_property(pair):
    _, fast = pair
    calls = []
    hook = fast.neighborlist.register_forward_hook(lambda *a: calls.append(1))
    try:
        atoms = read_molecule("water-0.8nm.xyz")
        atoms.calc = calc = Calculator(fast)
        atoms.get_potential_energy()
        atoms.get_forces()
        atoms.get_stress()
        atoms.get_potential_energy()
        assert len(calls) == 1 and calc.evaluations == 1
        species, cell = calc._species, calc._cell

        atoms.positions[0] += 0.01
        atoms.get_forces()
        atoms.get_stress()
        assert len(calls) == 2 and calc.evaluations == 2
        # Same elements and cell: the input tensors were not rebuilt.
        assert calc._species is species and calc._cell is cell

        atoms.set_cell(atoms.cell * 1.01, scale_atoms=True)
        atoms.get_potential_energy()
        assert calc.evaluations == 3 and calc._cell is not cell
    finally:
        hook.remove()


def test_errors(pair):
    _, fast = pair
    molecule = read_molecule("3lka_ligand.xyz")
    molecule.calc = Calculator(fast)
    with pytest.raises(PropertyNotImplementedError, match="periodic"):
        molecule.get_stress()
    iron = molecule.copy()
    iron.numbers[3] = 26
    iron.calc = Calculator(fast)
    with pytest.raises(ValueError, match="Fe"):
        iron.get_potential_energy()
    with pytest.raises(ValueError, match="stress_kind"):
        Calculator(fast, stress_kind="virial")


def test_overwrite_wraps_positions_like_torchani(pair):
    ref, fast = pair
    atoms = read_molecule("water-0.8nm.xyz")
    atoms.positions[:3] += atoms.cell[0] * 1.5  # push a molecule out of the cell
    a_ref, a_fast = atoms.copy(), atoms.copy()
    a_ref.calc = torchani.ase.Calculator(ref, overwrite=True)
    a_fast.calc = Calculator(fast, overwrite=True)
    with pytest.warns(UserWarning):
        f_ref = a_ref.get_forces()
    with pytest.warns(UserWarning):
        f = a_fast.get_forces()
    np.testing.assert_allclose(f, f_ref, rtol=0, atol=1e-9)
    frac = a_fast.get_scaled_positions(wrap=False)
    assert (frac >= 0).all() and (frac < 1).all()


def _relax(calc, atoms, optimizer, fmax):
    import ase.optimize

    atoms = atoms.copy()
    atoms.calc = calc
    opt = getattr(ase.optimize, optimizer)(atoms, logfile=None)
    assert opt.run(fmax=fmax, steps=500)
    return atoms.get_potential_energy(), atoms.positions.copy(), opt.nsteps


@pytest.mark.parametrize("optimizer,name,fmax", [("BFGS", "CH3CH2OH", 1e-3),
                                                 ("LBFGS", "CH4-5.xyz", 1e-3),
                                                 ("FIRE", "CH4-5.xyz", 5e-3)])
def test_optimization_reaches_torchani_minimum(pair1, optimizer, name, fmax):
    from ase.build import molecule

    ref, fast = pair1
    atoms = read_molecule(name, index=0) if name.endswith(".xyz") else molecule(name)
    atoms.rattle(0.05, seed=3)  # start away from the G2 / trajectory geometry
    e_ref, x_ref, n_ref = _relax(torchani.ase.Calculator(ref), atoms, optimizer, fmax)
    e, x, n = _relax(Calculator(fast), atoms, optimizer, fmax)
    assert e == pytest.approx(e_ref, rel=0, abs=1e-6)
    np.testing.assert_allclose(x, x_ref, rtol=0, atol=1e-3)


def _nve(calc, steps=200, dt_fs=0.5):
    from ase.build import molecule
    import ase.units as units
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary, ZeroRotation
    from ase.md.verlet import VelocityVerlet

    atoms = molecule("CH3CH2OH")
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(7))
    Stationary(atoms)
    ZeroRotation(atoms)
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, dt_fs * units.fs)
    energies = []
    dyn.attach(lambda: energies.append(atoms.get_total_energy()), interval=1)
    dyn.run(steps)
    return np.array(energies), atoms.positions.copy()


def test_nve_energy_drift_no_worse_than_torchani(pair1):
    ref, fast = pair1
    e_ref, x_ref = _nve(torchani.ase.Calculator(ref))
    e, x = _nve(Calculator(fast))
    drift_ref = np.abs(e_ref - e_ref[0]).max()
    drift = np.abs(e - e[0]).max()
    assert len(e) == 201
    assert drift <= drift_ref * 1.01 + 1e-9, (drift, drift_ref)
    np.testing.assert_allclose(x, x_ref, rtol=0, atol=1e-6)  # the same trajectory


def test_langevin_runs(pair1):
    import ase.units as units
    from ase.md.langevin import Langevin

    _, fast = pair1
    atoms = read_molecule("CH4-5.xyz", index=0)
    atoms.calc = calc = Calculator(fast)
    dyn = Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.02 / units.fs,
                   rng=np.random.default_rng(0))
    dyn.run(20)
    assert calc.evaluations == 21 and np.isfinite(atoms.get_total_energy())


def test_vibrations_match_torchani(pair1, tmp_path):
    from ase.build import molecule
    from ase.vibrations import Vibrations

    ref, fast = pair1
    freqs = []
    for tag, calc in (("ref", torchani.ase.Calculator(ref)), ("fast", Calculator(fast))):
        atoms = molecule("CH4")
        atoms.calc = calc
        vib = Vibrations(atoms, name=str(tmp_path / tag))
        vib.run()
        freqs.append(vib.get_frequencies())
    np.testing.assert_allclose(freqs[1], freqs[0], rtol=1e-6, atol=1e-3)


# -- the calculator's state check: ASE's answer, without np.allclose per array --------
def _variants():
    import ase
    base = ase.Atoms("CH4", positions=[[0, 0, 0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63],
                                       [-0.63, 0.63, -0.63], [0.63, -0.63, -0.63]],
                     cell=[10, 10, 10], pbc=True)
    out = [("same", base.copy())]
    for name, delta in (("moved", 1e-3), ("moved by 1e-16", 1e-16), ("moved by 2e-15", 2e-15)):
        a = base.copy()
        a.positions[1, 0] += delta
        out.append((name, a))
    a = base.copy(); a.positions[2, 1] = np.nan; out.append(("nan", a))
    a = base.copy(); a.positions[2, 1] = np.inf; out.append(("inf", a))
    a = base.copy(); a.numbers[0] = 7; out.append(("numbers", a))
    a = base.copy(); a.cell[0, 0] += 1e-3; out.append(("cell", a))
    a = base.copy(); a.pbc = [True, False, True]; out.append(("pbc", a))
    a = base.copy(); a.set_initial_charges([0.1, 0, 0, 0, 0]); out.append(("charges added", a))
    a = base.copy(); a.set_momenta(np.ones((5, 3))); out.append(("momenta (not checked)", a))
    a = base.copy() + ase.Atoms("H", positions=[[1, 1, 1]]); out.append(("one more atom", a))
    return base, out


def test_system_changes_is_ase_compare_atoms():
    from ase.calculators.calculator import compare_atoms
    from torchani_fast.ase import system_changes

    base, variants = _variants()
    assert system_changes(None, base) == compare_atoms(None, base)
    for name, atoms in variants:
        for old, new in ((base, atoms), (atoms, base), (atoms, atoms.copy())):
            for tol in (1e-15, 0.0, 1e-2):
                for excluded in (set(), {"positions"}, {"cell", "initial_charges"}):
                    ours = system_changes(old, new, tol, excluded)
                    ases = compare_atoms(old, new, tol, excluded)
                    assert sorted(ours) == sorted(ases), (name, tol, excluded)
                    assert len(ours) == len(ases)
    inf = [a for n, a in variants if n == "inf"][0]
    assert system_changes(inf, inf.copy()) == []  # inf == inf, as np.allclose says


def test_calculator_recomputes_exactly_when_the_atoms_change(pair1):
    import ase
    model = pair1[1]
    atoms = ase.Atoms("CH4", positions=[[0, 0, 0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63],
                                        [-0.63, 0.63, -0.63], [0.63, -0.63, -0.63]])
    atoms.calc = model.ase()
    atoms.get_potential_energy()
    atoms.get_forces()
    assert atoms.calc.evaluations == 1
    atoms.positions[0, 0] += 1e-16  # within ASE's tolerance: no new evaluation
    atoms.get_forces()
    assert atoms.calc.evaluations == 1
    atoms.positions[0, 0] += 1e-6
    atoms.get_forces()
    assert atoms.calc.evaluations == 2


def _torchani_ev(ref, atoms):
    """Energy (eV) and forces (eV/Å) from TorchANI's own calculator."""
    a = atoms.copy()
    a.calc = torchani.ase.Calculator(ref)
    return a.get_potential_energy(), a.get_forces()


def test_molecules_go_through_a_step_that_makes_room_for_denser_geometries(pair1):
    """A molecule is evaluated by a GrowingStep sized on its first geometry; a
    denser one overflows that list, gets a step with room and is recomputed;
    other atoms get their own step. Every answer is TorchANI's."""
    ref, fast = pair1
    ligand = read_molecule("2iuz_ligand.xyz")
    stretched = ligand.copy()
    stretched.positions *= 1.8  # far fewer pairs within 5.2 Å than the ligand itself
    calc = Calculator(fast)
    for geometry in (stretched, ligand):
        geometry.calc = calc
        e, f = geometry.get_potential_energy(), geometry.get_forces()
        e_ref, f_ref = _torchani_ev(ref, geometry)
        assert e == pytest.approx(e_ref, rel=1e-12)
        np.testing.assert_allclose(f, f_ref, rtol=0, atol=1e-9)
    assert calc._step.builds == 2 and calc.evaluations == 2
    first = calc._step
    other = read_molecule("3lka_ligand.xyz")
    other.calc = calc
    e_ref, f_ref = _torchani_ev(ref, other)
    assert other.get_potential_energy() == pytest.approx(e_ref, rel=1e-12)
    np.testing.assert_allclose(other.get_forces(), f_ref, rtol=0, atol=1e-9)
    assert calc._step is not first and calc._step.builds == 1


def test_molecule_step_sees_weights_and_self_energies_changed_in_place(pair1):
    """The calculator keeps a step between calls: parameters and self-energies
    changed in place afterwards (an optimizer step, load_state_dict) are used."""
    import copy

    ref, fast = (copy.deepcopy(m) for m in pair1)
    atoms = read_molecule("3lka_ligand.xyz")
    atoms.calc = Calculator(fast)
    atoms.get_potential_energy()
    with torch.no_grad():
        for model in (ref, fast):
            for p in model.parameters():
                p.mul_(1.01)
            model.energy_shifter.self_energies.add_(0.25)
    atoms.positions[0, 0] += 1e-3
    e_ref, f_ref = _torchani_ev(ref, atoms)
    assert atoms.get_potential_energy() == pytest.approx(e_ref, rel=1e-12)
    np.testing.assert_allclose(atoms.get_forces(), f_ref, rtol=0, atol=1e-9)
    assert atoms.calc._step.builds == 1


def test_non_finite_molecule_positions_are_refused_by_the_step(pair1):
    atoms = read_molecule("3lka_ligand.xyz")
    atoms.calc = Calculator(pair1[1])
    atoms.get_potential_energy()
    atoms.positions[3, 1] = np.nan
    with pytest.raises((ValueError, RuntimeError), match="finite"):
        atoms.get_forces()
    assert "forces" not in atoms.calc.results
