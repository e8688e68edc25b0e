"""The ML atoms given to the OpenMM front ends (``createSystem``/``createMixedSystem``
of openmm-ml, :func:`~torchani_fast.openmm.create_python_force`,
:func:`~torchani_fast.openmm.torch_force_module`): every index must name one
atom of the topology, once. Before issue 60 a duplicated index gave a number
(the atom on top of itself, a huge repulsion-free energy) although the docs
promise that bad indices fail.
"""
import pytest
import torch

openmm = pytest.importorskip("openmm")
app = pytest.importorskip("openmm.app")
pytest.importorskip("openmmml")

from torchani_fast.openmm import create_python_force, torch_force_module  # noqa: E402
from torchani_fast.openmm.mlpotential import ANIFastPotentialImpl  # noqa: E402

pytestmark = pytest.mark.usefixtures("weights")


def _topology(numbers):
    top = app.Topology()
    res = top.addResidue("LIG", top.addChain())
    for i, z in enumerate(numbers):
        top.addAtom(f"A{i}", app.Element.getByAtomicNumber(z), res)
    return top


BAD = [([0, 1, 1], r"atom index 1 is given twice \(entries 1 and 2"),
       ([2, 0, 2], r"atom index 2 is given twice \(entries 0 and 2"),
       ([0, 5], r"atom index 5 is outside the topology"),
       ([0, -1], r"atom index -1 is outside the topology"),
       ([], r"no atoms")]


@pytest.mark.parametrize("atoms, message", BAD)
def test_mixed_system_atoms(atoms, message):
    top = _topology([8, 1, 1, 6])
    with pytest.raises(ValueError, match=message):
        ANIFastPotentialImpl("ani2x-fast").addForces(top, openmm.System(), atoms, 0, device="cpu")


@pytest.mark.parametrize("atoms, message", BAD)
def test_python_force_and_torch_force_module_atoms(atoms, message):
    top = _topology([8, 1, 1, 6])
    with pytest.raises(ValueError, match=message):
        create_python_force("ani2x-fast", top, atoms, device="cpu")
    with pytest.raises(ValueError, match=message):
        torch_force_module("ani2x-fast", top, atoms, dtype=torch.float64)


def test_mixed_system_with_a_duplicated_ml_atom_is_refused():
    from openmmml import MLPotential
    from torchani_fast.openmm.mlpotential import ANIFastPotentialImplFactory

    if "ani2x-fast" not in MLPotential._implFactories:
        MLPotential.registerImplFactory("ani2x-fast", ANIFastPotentialImplFactory())
    top = _topology([8, 1, 1, 8, 1, 1])
    mm = openmm.System()
    for _ in range(6):
        mm.addParticle(1.0)
    with pytest.raises(ValueError, match="atom index 0 is given twice"):
        MLPotential("ani2x-fast").createMixedSystem(top, mm, [0, 1, 2, 0], device="cpu")
