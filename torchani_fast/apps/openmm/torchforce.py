"""TorchForce export: a scripted module in OpenMM-Torch's units and conventions.

OpenMM-Torch's ``TorchForce`` calls a TorchScript module with the positions of
*all* particles, ``(N, 3)`` in nm (float32 or float64, following the platform's
precision), and, if the force uses periodic boundary conditions, the box
vectors ``(3, 3)`` in nm (rows); the module returns the energy in kJ/mol as a
scalar and TorchForce differentiates it for the forces. The module runs the
scripted patched model, so no Python runs per step.
"""
import typing as tp

import torch
from torch import Tensor
from torch.jit import Final

from .force import HARTREE_TO_KJ_PER_MOL, atomic_numbers_of, load_model, resolve_device, resolve_dtype

__all__ = ["ANITorchForceModule", "create_torch_force", "torch_force_module"]


class ANITorchForceModule(torch.nn.Module):
    """``forward(positions (N, 3) nm, boxvectors (3, 3) nm = None) -> energy (kJ/mol, float64 scalar)``.

    Parameters
    ----------
    model : torch.nn.Module
        A (patched) TorchANI ANI model with ``periodic_table_index=True``.
    atomic_numbers : sequence of int
        Of the atoms the model applies to.
    atoms : sequence of int, optional
        Their indices among the positions OpenMM passes (all, in order, by default).
    periodic : bool
        If True, ``boxvectors`` is required and used as the cell.
    """

    periodic: Final[bool]
    subset: Final[bool]
    num_particles: Final[int]
    energy_scale: Final[float]

    def __init__(self, model: torch.nn.Module, atomic_numbers: tp.Sequence[int],
                 atoms: tp.Optional[tp.Sequence[int]] = None, periodic: bool = False):
        super().__init__()
        ref = next(iter(model.parameters()), None)
        if ref is None:
            ref = next(t for t in model.buffers() if t.is_floating_point())
        self.model = model
        self.periodic = bool(periodic)
        self.energy_scale = HARTREE_TO_KJ_PER_MOL
        self.subset = atoms is not None
        self.num_particles = len(atomic_numbers) if atoms is None else -1
        self.register_buffer("species", torch.tensor([list(atomic_numbers)], dtype=torch.long,
                                                     device=ref.device))
        self.register_buffer("atoms", torch.tensor(list(atoms) if atoms is not None else [],
                                                   dtype=torch.long, device=ref.device))
        self.register_buffer("pbc", torch.ones(3, dtype=torch.bool, device=ref.device))
        self.register_buffer("_ref", torch.zeros((), dtype=ref.dtype, device=ref.device))
        if self.subset and len(self.atoms) != len(atomic_numbers):
            raise ValueError(f"atoms ({len(self.atoms)}) and atomic_numbers ({len(atomic_numbers)}) "
                             "must have the same length")

    def forward(self, positions: Tensor, boxvectors: tp.Optional[Tensor] = None) -> Tensor:
        if positions.dim() != 2 or positions.shape[1] != 3:
            raise ValueError("positions must have shape (N, 3) in nm, got " + str(list(positions.shape)))
        if self.subset:
            x = positions.index_select(0, self.atoms)
        else:
            if positions.shape[0] != self.num_particles:
                raise ValueError("positions must hold the " + str(self.num_particles)
                                 + " atoms of the model, got " + str(positions.shape[0]))
            x = positions
        # nm -> Å in the positions' precision, then the model's dtype.
        x = (x * 10.0).to(self._ref.dtype).unsqueeze(0)
        if self.periodic:
            if boxvectors is None:
                raise ValueError("the module is periodic: pass boxvectors (3, 3) in nm")
            cell = (boxvectors * 10.0).to(self._ref.dtype)
            energies = self.model((self.species, x), cell=cell, pbc=self.pbc).energies
        else:
            energies = self.model((self.species, x)).energies
        return energies.sum().to(torch.float64) * self.energy_scale


def torch_force_module(name: str, topology, atoms: tp.Optional[tp.Sequence[int]] = None, *,
                       periodic: tp.Optional[bool] = None, model_index: tp.Optional[int] = None,
                       dtype: tp.Union[str, torch.dtype, None] = None,
                       device: tp.Union[str, torch.device, None] = None) -> torch.jit.ScriptModule:
    """A scripted :class:`ANITorchForceModule` for a model of :data:`~torchani_fast.openmm.MODELS`.

    Parameters are those of :func:`~torchani_fast.openmm.create_python_force`;
    the default device is the CPU. Save it with ``module.save(path)`` for
    ``openmmtorch.TorchForce(path)``, or pass it to :func:`create_torch_force`.
    """
    import copy

    dtype = resolve_dtype(dtype)
    device = resolve_device("cpu" if device is None else device)
    # A copy: scripting must not touch the model the PythonForces share.
    model = copy.deepcopy(load_model(name, model_index, dtype, device))
    numbers = atomic_numbers_of(topology, atoms, model.atomic_numbers.tolist(), name)
    if periodic is None:
        periodic = topology.getPeriodicBoxVectors() is not None
    return torch.jit.script(ANITorchForceModule(model, numbers, atoms, periodic))


def create_torch_force(name: str, topology, atoms: tp.Optional[tp.Sequence[int]] = None, *,
                       periodic: tp.Optional[bool] = None, force_group: int = 0,
                       model_index: tp.Optional[int] = None,
                       dtype: tp.Union[str, torch.dtype, None] = None,
                       device: tp.Union[str, torch.device, None] = None):
    """An ``openmmtorch.TorchForce`` of :func:`torch_force_module` (needs openmm-torch).

    Raises
    ------
    ImportError
        If ``openmmtorch`` does not import (its text is kept).
    """
    try:
        import openmmtorch
    except ImportError as exc:  # e.g. no wheel built against this torch
        raise ImportError(f"create_torch_force needs openmm-torch (openmmtorch), which did not import: "
                          f"{exc}. Use the default PythonForce implementation instead.") from exc
    module = torch_force_module(name, topology, atoms, periodic=periodic, model_index=model_index,
                                dtype=dtype, device=device)
    force = openmmtorch.TorchForce(module)
    force.setUsesPeriodicBoundaryConditions(bool(module.periodic))
    force.setForceGroup(int(force_group))
    force.setName(f"torchani_fast {name}")
    return force
