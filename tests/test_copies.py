"""Copies and pickles of every public object: each copy computes the same
numbers as the original, independently (its own lock, caches and buffers).

Before issue 60 the ASE calculator (and so an ``Atoms`` carrying it), the
steps and the workspace could not be deep-copied or pickled ("cannot pickle
'_thread.RLock'", "... '_thread.lock'", "Tried to deepcopy object
__torch__.torch.classes.torchani_fast.Workspace"); TorchANI's calculator can.
"""
import copy
import io
import pickle
import threading

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule

from torchani_fast.workspace import Workspace
from torchani_fast.models import ANI2x
from torchani_fast.step import EnergyForcesStep, GrowingStep

pytestmark = pytest.mark.usefixtures("weights")

COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
}


@pytest.fixture(scope="module")
def model():
    return ANI2x(dtype=torch.float64)


def _methane():
    species = torch.tensor([[6, 1, 1, 1, 1]])
    coords = torch.tensor([[[0.0, 0.0, 0.0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63],
                            [-0.63, 0.63, -0.63], [0.63, -0.63, -0.63]]], dtype=torch.float64)
    return species, coords


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("atoms", [molecule("CH3CH2OH"), bulk("C", "diamond", a=3.6, cubic=True)],
                         ids=["molecule", "periodic"])
def test_calculator_and_atoms_carrying_it(model, how, atoms):
    atoms = atoms.copy()
    atoms.calc = model.ase()
    expected = atoms.get_potential_energy(), atoms.get_forces()
    copied = COPIES[how](atoms)  # the Atoms and its calculator, results included
    assert copied.calc is not atoms.calc and copied.calc._lock is not atoms.calc._lock
    assert copied.get_potential_energy() == expected[0]
    for a in (copied, atoms):
        a.positions[0, 0] += 0.02
    assert copied.get_potential_energy() == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(copied.get_forces(), atoms.get_forces(), rtol=0, atol=1e-10)
    assert copied.get_potential_energy() != expected[0]


@pytest.mark.parametrize("how", COPIES)
def test_calculator_of_a_scripted_model(model, how):
    atoms = molecule("CH4")
    atoms.calc = model.ase(jit=True)
    expected = atoms.get_potential_energy()
    copied = COPIES[how](atoms)
    assert isinstance(copied.calc.model, torch.jit.ScriptModule)
    copied.positions[0, 0] += 0.01
    atoms.positions[0, 0] += 0.01
    assert copied.get_potential_energy() == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    assert copied.get_potential_energy() != expected


@pytest.mark.parametrize("how", COPIES)
def test_copied_calculator_runs_beside_the_original_in_threads(model, how):
    calc = model.ase()
    other = COPIES[how](calc)
    results = {}

    def run(c, key):
        atoms = molecule("CH3OH")
        atoms.calc = c
        results[key] = [atoms.get_potential_energy() for _ in range(5)]

    threads = [threading.Thread(target=run, args=(c, k)) for k, c in enumerate((calc, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1]


@pytest.mark.parametrize("how", list(COPIES) + ["torch.save"])
def test_patched_model(model, how):
    species, coords = _methane()
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    else:
        copied = COPIES[how](model)
    assert type(copied) is type(model)
    assert torch.equal(copied((species, coords)).energies, model((species, coords)).energies)


def test_scripted_patched_model_deepcopy(model):
    species, coords = _methane()
    scripted = torch.jit.script(model)
    assert torch.equal(copy.deepcopy(scripted)((species, coords)).energies,
                       model((species, coords)).energies)


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("kind", [EnergyForcesStep, GrowingStep])
def test_steps(model, how, kind):
    species, coords = _methane()
    step = kind(model, species, coords.clone())
    copied = COPIES[how](step)
    assert type(copied) is kind
    x = coords + 0.01
    e0, f0 = step(x.clone())
    e1, f1 = copied(x.clone())
    assert torch.equal(e0, e1) and torch.equal(f0, f1)


@pytest.mark.parametrize("how", COPIES)
def test_workspace_copy_starts_empty(how):
    copied = COPIES[how](Workspace())
    assert isinstance(copied, Workspace) and copied.nbytes == 0
    with copied:
        pass


@pytest.mark.parametrize("how", COPIES)
def test_openmm_objects(how):
    pytest.importorskip("openmm")
    from torchani_fast.openmm import ANIComputation, torch_force_module
    import openmm.app as app

    numbers = [6, 1, 1, 1, 1]
    computation = ANIComputation("ani2x-fast", numbers, periodic=False, dtype=torch.float64, device="cpu")
    copied = COPIES[how](computation)
    assert (copied.name, copied.dtype, copied.periodic) == (computation.name, computation.dtype,
                                                            computation.periodic)
    top = app.Topology()
    res = top.addResidue("LIG", top.addChain())
    for i, z in enumerate(numbers):
        top.addAtom(f"A{i}", app.Element.getByAtomicNumber(z), res)
    module = torch_force_module("ani2x-fast", top, dtype=torch.float64, device="cpu")
    copied_module = copy.deepcopy(module)
    positions = _methane()[1][0] / 10.0
    assert torch.equal(copied_module(positions), module(positions))
