"""OpenMM integration: torchani_fast models as openmm-ml potentials and TorchForce modules.

After ``pip install torchani_fast openmm openmmml``::

    from openmmml import MLPotential
    potential = MLPotential("ani2x-fast")          # or "ani1x-fast", "ani1ccx-fast"
    system = potential.createSystem(topology)      # vacuum or periodic
    mixed = potential.createMixedSystem(topology, mm_system, ligand_atoms)

The names are registered in the ``openmmml.potentials`` entry-point group
(:mod:`torchani_fast.openmm.mlpotential`). Every evaluation goes through one
:class:`~torchani_fast.EnergyForcesStep` built for the atoms of the force
(:class:`ANIComputation`), with energies in kJ/mol and forces in kJ/mol/nm.

For MD with no Python per step (OpenMM-Torch, CUDA-resident MD),
:func:`torch_force_module` returns a scripted module in OpenMM-Torch's
conventions and :func:`create_torch_force` wraps it in an
``openmmtorch.TorchForce``.
"""
from .force import HARTREE_TO_KJ_PER_MOL, MODELS, ANIComputation, create_python_force
from .torchforce import ANITorchForceModule, create_torch_force, torch_force_module

__all__ = ["ANIComputation", "ANITorchForceModule", "HARTREE_TO_KJ_PER_MOL", "MODELS",
           "create_python_force", "create_torch_force", "torch_force_module"]
