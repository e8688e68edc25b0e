"""When the front ends capture, replay, re-capture or run eagerly (GraphedSteps), on the CPU.

``torchani_fast._device_paths.on_cpu()`` makes CPU tensors take the GPU's code
paths, so the decisions a GPU would take are taken here (the steps themselves
then run eagerly: a CPU cannot capture). The engines are the real ones (ASE's
integrators, an OpenMM Context) with a real model; the captures themselves, and
that replays equal eager results, are tested on a GPU (tests/test_cuda.py).
"""
import numpy as np
import pytest
import torch
import ase.units
from ase.md.verlet import VelocityVerlet

import torchani_fast
from torchani_fast import _device_paths
from torchani_fast.apps.ase import Calculator
from torchani_fast.testing import random_model

from support import read_molecule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def model():
    model = torchani_fast.patch(random_model("ANI2x", dtype=torch.float64))
    model.requires_grad_(False)  # (inference: the networks cache their weight packs)
    return model


def _md(atoms, steps=3):
    VelocityVerlet(atoms, 0.5 * ase.units.fs).run(steps)


def test_ase_captures_once_per_molecule_and_replays(model):
    """First geometry: capture; the MD steps after it: replays (no event);
    other atoms: a new capture; the first atoms again: a capture again (one step kept)."""
    ligand, other = read_molecule("3lka_ligand.xyz"), read_molecule("2iuz_ligand.xyz")
    with _device_paths.on_cpu():
        calc = Calculator(model)
        ligand.calc = calc
        _md(ligand)
        assert calc._steps.events == [("capture", "first use")]
        assert calc.evaluations == 4
        other.calc = calc
        other.get_forces()
        ligand.get_forces()
    assert calc._steps.events == [("capture", "first use"), ("capture", "the species or pbc changed"),
                                  ("capture", "the species or pbc changed")]


def test_ase_results_equal_the_eager_calculator_and_graphs_can_be_turned_off(model):
    atoms = read_molecule("3lka_ligand.xyz")
    with _device_paths.on_cpu():
        graphed, eager = Calculator(model), Calculator(model, cuda_graphs=False)
        results = []
        for calc in (graphed, eager):
            a = atoms.copy()
            a.calc = calc
            _md(a, 2)
            results.append((a.get_potential_energy(), a.get_forces(), a.positions.copy()))
    assert graphed._steps.events == [("capture", "first use")]
    assert eager._steps.events == [("eager", "first use")]
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])
    np.testing.assert_array_equal(results[0][2], results[1][2])


def test_ase_recaptures_when_weights_change_in_place(model):
    """A captured graph replays the weight packs it captured: changed weights need a new capture
    (an eager step reads them at every call: no rebuild)."""
    import copy

    own = copy.deepcopy(model)
    atoms = read_molecule("3lka_ligand.xyz")
    with _device_paths.on_cpu():
        atoms.calc = Calculator(own)
        atoms.get_potential_energy()
        atoms.positions[0, 0] += 1e-3
        atoms.get_potential_energy()  # unchanged weights: a replay
        assert atoms.calc._steps.events == [("capture", "first use")]
        with torch.no_grad():
            for p in own.parameters():
                p.mul_(1.01)
        atoms.positions[0, 0] += 1e-3
        e = atoms.get_potential_energy()
    assert atoms.calc._steps.events == [("capture", "first use"), ("capture", "the weights changed in place")]
    assert e == pytest.approx(float(own.energies_forces(*_tensors(atoms)).energies[0]) * ase.units.Hartree,
                              rel=1e-10)
    # On the CPU path (no graphs) the same change rebuilds nothing.
    atoms.calc = Calculator(own)
    atoms.get_potential_energy()
    with torch.no_grad():
        for p in own.parameters():
            p.mul_(1.01)
    atoms.positions[0, 0] += 1e-3
    atoms.get_potential_energy()
    assert atoms.calc._steps.events == [("eager", "first use")]


def _tensors(atoms):
    species = torch.tensor(atoms.numbers, dtype=torch.long).unsqueeze(0)
    return species, torch.tensor(atoms.positions, dtype=torch.float64).unsqueeze(0)


def test_ase_overflow_recaptures_then_goes_eager(model):
    """A denser geometry overflows the captured list: re-captured with room (the
    call recomputed); after ``max_recaptures`` captures of one molecule, eager."""
    ligand = read_molecule("2iuz_ligand.xyz")
    with _device_paths.on_cpu():
        calc = Calculator(model)
        calc._steps.max_recaptures = 2
        for scale in (3.0, 1.6, 1.0):
            a = ligand.copy()
            a.positions *= scale  # denser each time: more pairs than the list holds
            a.calc = calc
            a.get_forces()
        energy = a.get_potential_energy()
    assert calc._steps.events == [("capture", "first use"),
                                  ("capture", "the neighbour list overflowed: more room"),
                                  ("eager", "the neighbour list overflowed 2 times")]
    assert not calc._steps._graphed and calc._step.step._graph is None
    assert energy == pytest.approx(float(model.energies_forces(*_tensors(a)).energies[0]) * ase.units.Hartree,
                                   rel=1e-10)
    # The molecule stays eager; another one is captured again.
    other = read_molecule("3lka_ligand.xyz")
    with _device_paths.on_cpu():
        other.calc = calc
        other.get_forces()
        a.calc = calc
        a.get_forces()
    assert calc._steps.events[-2:] == [("capture", "the species or pbc changed"),
                                       ("eager", "the species or pbc changed")]


def test_cpu_tensors_run_eagerly(model):
    atoms = read_molecule("3lka_ligand.xyz")
    atoms.calc = Calculator(model)
    atoms.get_forces()
    assert atoms.calc._steps.events == [("eager", "first use")]


# -- OpenMM: a real Context with the PythonForce ---------------------------------------------

openmm = pytest.importorskip("openmm", reason="openmm is not installed (pip install openmm)")


def _weights():
    from torchani_fast.openmm.force import load_model

    try:
        return load_model("ani2x-fast", None, torch.float64, torch.device("cpu"))
    except Exception as exc:  # no weights under TORCHANI_DATA_DIR
        pytest.skip(f"ani2x-fast weights are not available: {exc}")


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_openmm_periodic_force_keeps_one_capture_while_a_barostat_changes_the_box(cuda_graphs):
    """The box is copied into the captured cell in place: a barostat's new box needs no re-capture."""
    from openmm import unit

    from torchani_fast.openmm import ANIComputation
    from torchani_fast.testing import water_box

    _weights()
    numbers, coords, cell, _ = water_box(8)
    box = cell.numpy() / 10.0
    with _device_paths.on_cpu():
        compute = ANIComputation("ani2x-fast", numbers[0].tolist(), True, dtype=torch.float64,
                                 device="cpu", cuda_graphs=cuda_graphs)
        system = openmm.System()
        system.setDefaultPeriodicBoxVectors(*[openmm.Vec3(*r) for r in box])
        for z in numbers[0].tolist():
            system.addParticle(16.0 if z == 8 else 1.0)
        force = openmm.PythonForce(compute)
        force.setUsesPeriodicBoundaryConditions(True)
        system.addForce(force)
        system.addForce(openmm.MonteCarloBarostat(1.0 * unit.bar, 300 * unit.kelvin, 1))
        integrator = openmm.LangevinMiddleIntegrator(300 * unit.kelvin, 1 / unit.picosecond, 0.0005)
        integrator.setRandomNumberSeed(1)
        ctx = openmm.Context(system, integrator, openmm.Platform.getPlatformByName("Reference"))
        ctx.setPositions(coords[0].numpy() / 10.0)
        volumes = set()
        for _ in range(3):
            integrator.step(1)
            b = ctx.getState().getPeriodicBoxVectors(asNumpy=True).value_in_unit(unit.nanometer)
            volumes.add(round(float(np.linalg.det(b)), 12))
    assert len(volumes) > 1, "the barostat never changed the box: the test would prove nothing"
    assert compute._steps.events == [("capture" if cuda_graphs else "eager", "first use")]
    assert compute.rebuilds == 1
