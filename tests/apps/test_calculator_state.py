"""The ASE calculator follows its model: ``model.double()``, ``model.float()``,
``calc.model = other`` and in-place weight changes between calls give what
TorchANI's calculator gives after the same change, never the numbers of the
model as it was when the calculator was built.

Before issue 60 the calculator took dtype, device and a step once, at
construction: after ``model.double()`` it kept a float32 step (1e-3 eV off),
after ``model.float()`` on a float64 calculator it passed float64 coordinates
to a float32 model, and a reassigned ``calc.model`` was ignored for molecules.
"""
import pytest
import torch
import torchani
from ase.build import bulk, molecule

from torchani_fast.models import ANI1x, ANI2x

pytestmark = pytest.mark.usefixtures("weights")


def _pair(dtype):
    return ANI2x(dtype=dtype), torchani.models.ANI2x().to(dtype)


def _energies_forces(calc, atoms):
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces()


@pytest.mark.parametrize("atoms", [molecule("CH3CH2OH"), bulk("C", "diamond", a=3.6, cubic=True)],
                         ids=["molecule", "periodic"])
@pytest.mark.parametrize("start, then", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_dtype_change_after_construction(atoms, start, then):
    ours, theirs = _pair(start)
    calc = ours.ase()
    _energies_forces(calc, atoms)  # builds the caches (and the molecule's step) in `start`
    ours.to(then)
    # (TorchANI's calculator keeps the dtype of its positions: one built for the
    # model as it is now is the reference)
    ref = theirs.to(then).ase()
    moved = atoms.copy()
    moved.positions[0, 0] += 0.01
    e, f = _energies_forces(calc, moved)
    e_ref, f_ref = _energies_forces(ref, moved)
    assert calc.dtype == then
    tol = 1e-9 if then == torch.float64 else 1e-5
    assert e == pytest.approx(e_ref, rel=tol, abs=tol)
    assert abs(f - f_ref).max() < (1e-7 if then == torch.float64 else 5e-3)


def test_same_atoms_after_dtype_change_are_recomputed():
    # ASE serves the cached energy when the atoms did not change: the cache must go.
    ours, theirs = _pair(torch.float32)
    atoms = molecule("CH4")
    atoms.calc = ours.ase()
    first = atoms.get_potential_energy()
    ours.double()
    theirs.double()
    again = atoms.get_potential_energy()
    ref = atoms.copy()
    ref.calc = theirs.ase()
    assert again == pytest.approx(ref.get_potential_energy(), rel=1e-12)
    assert again != first  # float32 and float64 energies of CH4 differ in the last bits


def test_reassigned_model_is_used_for_molecules():
    calc = ANI2x(dtype=torch.float64).ase()
    atoms = molecule("CH3OH")
    atoms.calc = calc
    atoms.get_potential_energy()
    calc.model = ANI1x(dtype=torch.float64)
    atoms.positions[0, 0] += 0.01
    e = atoms.get_potential_energy()
    ref = atoms.copy()
    ref.calc = torchani.models.ANI1x().double().ase()
    assert e == pytest.approx(ref.get_potential_energy(), rel=1e-12)


def test_weights_loaded_in_place_are_used():
    ours = ANI2x(dtype=torch.float64)
    state = ours.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if t.is_floating_point():
                t.mul_(1.001)
    calc = ANI2x(dtype=torch.float64).ase()
    atoms = molecule("CH4")
    atoms.calc = calc
    atoms.get_potential_energy()
    calc.model.load_state_dict(state)
    atoms.positions[0, 0] += 0.01
    e = atoms.get_potential_energy()
    ref = atoms.copy()
    ref.calc = ours.ase()
    assert e == pytest.approx(ref.get_potential_energy(), rel=1e-12)
