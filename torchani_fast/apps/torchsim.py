"""ANI as a torch-sim model: batched optimisation and MD with torch-sim's runners.

torch-sim (``pip install torch-sim-atomistic``) runs FIRE, gradient descent and
MD integrators over many systems at once, with autobatching; its models take a
``SimState`` (flat atoms, a system index, one cell per system in column-vector
convention, one ``pbc`` flag for all) and return energies (eV), forces (eV/Å)
and stresses (eV/Å³). :class:`ANIModel` is that interface around any TorchANI
model, patched by torchani_fast or not:

>>> import torch_sim as ts
>>> from torchani_fast.torchsim import ANIModel
>>> model = ANIModel(torchani_fast.models.ANI2x(dtype=torch.float64))
>>> state = ts.io.atoms_to_state(conformers, model.device, model.dtype)
>>> relaxed = ts.optimize(state, model, optimizer=ts.optimizers.fire)    # doctest: +SKIP

Energies and forces of all systems come from one padded model call per
distinct cell (:func:`torchani_fast.batched.energies_forces`). Stress
(``compute_stress=True``, periodic states only) is dE/dstrain / volume, as
torchani_fast's ASE calculator computes it, with one model call per system.
"""
import typing as tp

import torch
from torch import Tensor
from torch_sim.models.interface import ModelInterface

from .. import core
from . import batched

__all__ = ["ANIModel"]


class ANIModel(ModelInterface):
    """A TorchANI model as a torch-sim ``ModelInterface``.

    Parameters
    ----------
    model : torchani.arch.ANI
        The model (its dtype and device are the interface's ``dtype`` and ``device``).
    compute_forces : bool
        Return ``forces`` (N, 3) in eV/Å (default True).
    compute_stress : bool
        Return ``stress`` (S, 3, 3) in eV/Å³; periodic states only (default False).
    """

    def __init__(self, model: torch.nn.Module, compute_forces: bool = True, compute_stress: bool = False):
        super().__init__()
        import ase.units

        self.model = model
        ref = core.model_float(model)
        self._device, self._dtype = ref.device, ref.dtype
        self._compute_forces = bool(compute_forces)
        self._compute_stress = bool(compute_stress)
        self._memory_scales_with = "n_atoms_x_density"
        self._hartree = float(ase.units.Hartree)

    @ModelInterface.compute_stress.setter
    def compute_stress(self, value: bool) -> None:
        self._compute_stress = bool(value)

    @ModelInterface.compute_forces.setter
    def compute_forces(self, value: bool) -> None:
        self._compute_forces = bool(value)

    def forward(self, state, **kwargs) -> tp.Dict[str, Tensor]:
        """``{"energy": (S,), "forces": (N, 3), "stress": (S, 3, 3)}`` in eV, eV/Å, eV/Å³
        of a ``SimState`` (or a dict with positions, cell, system_idx,
        atomic_numbers and pbc); the state is not changed."""
        get = state.get if isinstance(state, dict) else lambda k: getattr(state, k)
        positions, numbers, system_idx = get("positions"), get("atomic_numbers"), get("system_idx")
        if numbers is None:
            raise ValueError("state has no atomic_numbers: ANI needs each atom's element")
        cell, pbc = get("cell"), bool(get("pbc"))
        num_systems = int(system_idx.max()) + 1 if system_idx.numel() else 0
        rows = cell.mT if cell is not None else None  # torch-sim's columns -> TorchANI's rows
        if self._compute_stress:
            if not pbc or rows is None:
                raise ValueError("compute_stress needs a periodic state (state.pbc=True and a cell); "
                                 "set compute_stress=False for molecules")
            return self._with_stress(numbers, positions, system_idx, rows, num_systems)
        pbc3 = torch.full((3,), pbc, dtype=torch.bool, device=positions.device)
        e, f = batched.energies_forces(self.model, numbers, positions, system_idx,
                                       rows if pbc else None, pbc3 if pbc else None, num_systems)
        out = {"energy": (e * self._hartree).to(positions.dtype)}
        if self._compute_forces:
            out["forces"] = (f * self._hartree).to(positions.dtype)
        return out

    def _with_stress(self, numbers: Tensor, positions: Tensor, system_idx: Tensor, rows: Tensor,
                     num_systems: int) -> tp.Dict[str, Tensor]:
        # E(x F, cell F) with F = I + sym(strain), one system per call: dE/dstrain
        # at 0 is the virial (each system's own cell must be deformed alone).
        energies, forces, stress = [], torch.empty_like(positions), []
        eye = torch.eye(3, dtype=self._dtype, device=self._device)
        pbc = torch.ones(3, dtype=torch.bool, device=self._device)
        for s in range(num_systems):
            mask = system_idx == s
            species = numbers[mask].unsqueeze(0).to(self._device)
            x = positions[mask].detach().to(self._device, self._dtype).unsqueeze(0).requires_grad_(True)
            cell = rows[s].detach().to(self._device, self._dtype)
            strain = torch.zeros((3, 3), dtype=self._dtype, device=self._device, requires_grad=True)
            with torch.enable_grad():
                deform = eye + 0.5 * (strain + strain.T)
                e = self.model((species, x @ deform), cell=cell @ deform, pbc=pbc).energies
                gx, virial = torch.autograd.grad(e.sum(), (x, strain))
            energies.append(e.detach()[0])
            forces[mask] = (-gx[0]).to(positions.dtype)
            stress.append(virial / torch.linalg.det(cell).abs())
        out = {"energy": (torch.stack(energies) * self._hartree).to(positions.dtype),
               "stress": (torch.stack(stress) * self._hartree).to(positions.dtype)}
        if self._compute_forces:
            out["forces"] = forces * self._hartree
        return out
