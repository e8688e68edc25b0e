"""How torchani_fast evaluates a model: one module for every front end.

:func:`energies_forces` and :func:`energies_forces_hessians` (also exported by
:mod:`torchani_fast.models`, and behind ``patched.energies_forces``) and the
helpers the ASE calculator, :class:`~torchani_fast.EnergyForcesStep` and the
command line share: the model's dtype and device (:func:`model_float`), the
tensor check of inputs (:func:`require_tensors`) and ``-dE/dx``
(:func:`forces_of`). This module imports no other front end (``ase``, ``cli``,
``models``, ``patch``, ``step``), so each of them may import it.
"""
import typing as tp

import torch
from torch import Tensor

__all__ = ["EnergiesForces", "EnergiesForcesHessians", "Workspace", "energies_forces",
           "energies_forces_hessians", "model_float", "require_tensors", "forces_of"]


# Outputs smaller than this never come from a workspace (csrc/common/workspace.h;
# the package's __init__ loads the ops before this module).
WORKSPACE_MIN_BYTES: int = torch.classes.torchani_fast.Workspace.min_bytes()


class Workspace:
    """Memory for the CPU ops' large outputs, reused by the calls made inside ``with workspace:``.

    For a caller that evaluates one system again and again (MD, optimisation):
    :class:`~torchani_fast.EnergyForcesStep` and the ASE calculator own one.
    Inside the ``with`` block (in this thread, backward passes included) the
    AEV and the networks' AEV gradient reuse the memory of the previous call's
    once nothing references it any more; a tensor still held is never
    overwritten. Outputs above 32 MB then cost no page faults (float64,
    8 232 waters: 12% of an energy + forces call). Outside any workspace the
    ops allocate and keep nothing between calls. Blocks may nest; the memory is
    freed with the object. (csrc/common/workspace.h)

    Entering and leaving cost ~8 us: callers skip it where it would do
    nothing (:meth:`reuses`).
    """

    def __init__(self) -> None:
        self._held = torch.classes.torchani_fast.Workspace()

    @staticmethod
    def reuses(atoms: int, features: int, dtype: torch.dtype) -> bool:
        """Whether an AEV of ``atoms`` x ``features`` in ``dtype`` is large enough
        to come from a workspace (smaller outputs are always allocated)."""
        return atoms * features * (torch.finfo(dtype).bits // 8) >= WORKSPACE_MIN_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes held now, for the next call to reuse."""
        return self._held.nbytes()

    def __enter__(self) -> "Workspace":
        self._held.enter()
        return self

    def __exit__(self, *exc) -> None:
        self._held.exit()


class EnergiesForces(tp.NamedTuple):
    """Energies (M,) in Hartree and forces (M, A, 3) in Hartree/Å, detached."""

    energies: Tensor
    forces: Tensor


class EnergiesForcesHessians(tp.NamedTuple):
    """Energies (M,), forces (M, A, 3) and Hessians (M, 3A, 3A), in Ha and Å, detached."""

    energies: Tensor
    forces: Tensor
    hessians: Tensor


def model_float(model: torch.nn.Module) -> Tensor:
    """The first floating-point parameter (or buffer) of ``model``: its dtype and device."""
    for t in model.parameters():
        return t
    for t in model.buffers():
        if t.is_floating_point():
            return t
    raise ValueError("the model has no floating-point parameters or buffers to take a dtype from")


def require_tensors(**named) -> None:
    """TypeError naming the first argument that is not a tensor (None allowed)."""
    for name, value in named.items():
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got {type(value).__module__}.{type(value).__name__}; "
                f"convert it explicitly, e.g. torch.as_tensor({name})")


def forces_of(energies: Tensor, x: Tensor) -> Tensor:
    """-dE/dx; zeros where the energies do not depend on ``x`` (a batch of
    padding only: every energy is 0 and autograd has nothing to differentiate)."""
    if not energies.requires_grad:
        return torch.zeros_like(x)
    (grad,) = torch.autograd.grad(energies.sum(), x, allow_unused=True)
    return torch.zeros_like(x) if grad is None else -grad


def _prepare(model, species, coords: Tensor, cell, pbc):
    require_tensors(species=species, coords=coords, cell=cell, pbc=pbc)
    ref = model_float(model)
    # A fresh leaf: detach() gives a new tensor object, so setting requires_grad
    # on it never touches the caller's tensor; .to() is a no-op when the dtype
    # and device already match.
    x = coords.detach().to(device=ref.device, dtype=ref.dtype).requires_grad_(True)
    if cell is not None:
        cell = cell.detach().to(device=ref.device, dtype=ref.dtype)
    if pbc is not None:
        pbc = pbc.to(device=ref.device)
    return x, cell, pbc


def energies_forces(model: torch.nn.Module, species: Tensor, coords: Tensor,
                    cell: tp.Optional[Tensor] = None,
                    pbc: tp.Optional[Tensor] = None) -> EnergiesForces:
    """Energies and forces of a batch, leaving the caller's tensors untouched.

    Parameters
    ----------
    model : torchani.arch.ANI or torch.jit.ScriptModule
        Any TorchANI ANI model, patched or not, eager or scripted.
    species : Tensor
        (M, A) long: atomic numbers (or element indices if the model has
        ``periodic_table_index=False``); -1 marks padding atoms.
    coords : Tensor
        (M, A, 3) positions in Å, any float dtype and device: a detached copy
        is moved to the model's dtype and device; ``coords.requires_grad`` is
        left as it was.
    cell : Tensor, optional
        (3, 3) lattice vectors (rows) in Å, shared by the batch.
    pbc : Tensor, optional
        (3,) bool; ``None`` for no periodicity.

    Returns
    -------
    EnergiesForces
        ``energies`` (M,) in Hartree and ``forces`` (M, A, 3) = -dE/dx in
        Hartree/Å, both detached, in the model's dtype and on its device.
        Forces on padding atoms are 0; a batch of padding only gives energies
        and forces 0.

    Raises
    ------
    TypeError
        If an input is not a tensor (numpy arrays and lists are not converted).
    """
    x, cell, pbc = _prepare(model, species, coords, cell, pbc)
    with torch.enable_grad():
        energies = model((species.to(x.device), x), cell=cell, pbc=pbc).energies
        forces = forces_of(energies, x)
    return EnergiesForces(energies.detach(), forces)


def energies_forces_hessians(model: torch.nn.Module, species: Tensor, coords: Tensor,
                             cell: tp.Optional[Tensor] = None,
                             pbc: tp.Optional[Tensor] = None) -> EnergiesForcesHessians:
    """Energies, forces and Hessians (second derivatives) of a batch.

    Arguments are those of :func:`energies_forces`.

    Returns
    -------
    EnergiesForcesHessians
        ``energies`` (M,) in Ha, ``forces`` (M, A, 3) in Ha/Å and ``hessians``
        (M, 3A, 3A) = d²E/dx² in Ha/Å², with rows and columns ordered
        atom-major (x0, y0, z0, x1, ...), all detached.

    Computed by :func:`torchani_fast.grad.energies_forces_and_hessians`:
    patched eager models (CPU or CUDA) get the Hessian in one pass; others
    (scripted, unpatched) one autograd pass per Cartesian component.

    Raises
    ------
    TypeError
        If an input is not a tensor (numpy arrays and lists are not converted).
    NotImplementedError
        If the model's featurizer has no second derivatives (the message of the
        underlying error is kept).
    """
    from .grad import energies_forces_and_hessians

    x, cell, pbc = _prepare(model, species, coords, cell, pbc)
    try:
        return energies_forces_and_hessians(model, species.to(x.device), x.detach(), cell, pbc)
    except RuntimeError as exc:
        if "second derivative" in str(exc) or "double backward" in str(exc):
            raise NotImplementedError(f"Hessians are not supported yet: {exc}") from exc
        raise
