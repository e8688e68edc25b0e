"""openmm-ml plugin: ``MLPotential("ani2x-fast")``, ``"ani1x-fast"``, ``"ani1ccx-fast"``,
``"ani2xr-fast"`` and ``"ani2dr-fast"`` (ANI-2x with repulsion; and D3 dispersion).

Registered through the ``openmmml.potentials`` entry points of torchani_fast's
``pyproject.toml``; openmm-ml loads them when it is imported.

>>> from openmmml import MLPotential
>>> system = MLPotential("ani2x-fast").createSystem(topology, dtype=torch.float64)

``createSystem`` and ``createMixedSystem`` accept, besides openmm-ml's own
arguments,

- ``modelIndex`` (int 0-7): one ensemble member instead of the mean;
- ``dtype``: ``torch.float32`` (default) or ``torch.float64`` (or their names);
- ``device``: e.g. ``"cpu"``, ``"cuda:0"`` (default: CUDA if available);
- ``implementation``: ``"python"`` (default, an ``openmm.PythonForce`` around a
  :class:`~torchani_fast.EnergyForcesStep`) or ``"torchforce"`` (an
  ``openmmtorch.TorchForce`` of :func:`~torchani_fast.openmm.torch_force_module`;
  needs openmm-torch).
"""
import typing as tp

import openmm
import openmm.app
from openmmml.mlpotential import MLPotentialImpl, MLPotentialImplFactory

from .force import MODELS, create_python_force

__all__ = ["ANIFastPotentialImpl", "ANIFastPotentialImplFactory", "register"]

IMPLEMENTATIONS = ("python", "torchforce")


class ANIFastPotentialImplFactory(MLPotentialImplFactory):
    """Creates :class:`ANIFastPotentialImpl` objects for the names of :data:`MODELS`."""

    def createImpl(self, name: str, **args) -> MLPotentialImpl:
        if name not in MODELS:
            raise ValueError(f"unknown torchani_fast potential {name!r}; known: {sorted(MODELS)}")
        if args:
            raise TypeError(f"MLPotential({name!r}) takes no extra arguments, got {sorted(args)}; "
                            "pass modelIndex, dtype and device to createSystem()")
        return ANIFastPotentialImpl(name)


class ANIFastPotentialImpl(MLPotentialImpl):
    """An ANI model of torchani_fast, with energies in kJ/mol and forces in kJ/mol/nm."""

    def __init__(self, name: str):
        self.name = name

    def addForces(self, topology: openmm.app.Topology, system: openmm.System,
                  atoms: tp.Optional[tp.Iterable[int]], forceGroup: int,
                  modelIndex: tp.Optional[int] = None, dtype=None, device=None,
                  implementation: str = "python", cudaGraphs: bool = True, **args) -> None:
        """Add one force computing the model on ``atoms`` (all atoms if None).

        ``cudaGraphs=False`` keeps the ``"python"`` force eager on a GPU (no CUDA graph).
        Other keyword arguments (those of the embedding, e.g. ``mlLongRange``)
        are ignored, as openmm-ml's own potentials do.
        """
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        atoms = None if atoms is None else [int(i) for i in atoms]
        periodic = topology.getPeriodicBoxVectors() is not None or system.usesPeriodicBoundaryConditions()
        if implementation == "python":
            force = create_python_force(self.name, topology, atoms, periodic=periodic,
                                        force_group=forceGroup, model_index=modelIndex,
                                        dtype=dtype, device=device, cuda_graphs=cudaGraphs)
        else:
            from .torchforce import create_torch_force

            force = create_torch_force(self.name, topology, atoms, periodic=periodic,
                                       force_group=forceGroup, model_index=modelIndex,
                                       dtype=dtype, device=device)
        system.addForce(force)

    def getMLLongRange(self) -> bool:
        """ANI is short-ranged (5.1 Å cutoff): the embedding adds the long-range terms."""
        return False


def register() -> None:
    """Register the names of :data:`MODELS` with openmm-ml by hand.

    Only needed where torchani_fast's entry points are not installed (running
    from a source tree on ``PYTHONPATH``); a ``pip install`` registers them.
    """
    from openmmml.mlpotential import MLPotential

    for name in MODELS:
        MLPotential.registerImplFactory(name, ANIFastPotentialImplFactory())
