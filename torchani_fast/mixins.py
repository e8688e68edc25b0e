"""The classes torchani_fast puts in front of TorchANI's model classes.

:func:`torchani_fast.patch` gives a model a subclass of its TorchANI class
(``PatchedANI`` = ``FrontDoor, ValidatedModel, ModelCore, ANI``; the mapping is
in :mod:`torchani_fast.patch`) whose mixins are these:

- :class:`FrontDoor`: Python-side conveniences that TorchScript never compiles
  (``model.ase()``, ``model.energies_forces()``);
- :class:`ValidatedModel`: ``_check_inputs`` with real messages
  (:mod:`torchani_fast.validation`);
- :class:`~torchani_fast.core.ModelCore` / ``ModelCoreQ``: the one composition of
  the energy, which TorchScript compiles in TorchANI's place.

The ASE calculator is an application (:mod:`torchani_fast.apps.ase`): this
library does not import it. ``model.ase()`` asks :func:`front_end` for the
factory that the package registers (``torchani_fast/__init__.py``).
"""
import typing as tp

import torch
from torch import Tensor

from . import core
from .validation import check_inputs

__all__ = ["FrontDoor", "ValidatedModel", "front_end", "register_front_end"]

_FRONT_ENDS: tp.Dict[str, tp.Callable[..., tp.Any]] = {}


def register_front_end(name: str, factory: tp.Callable[..., tp.Any]) -> None:
    """Make ``factory`` what ``model.<name>()`` builds (``"ase"``: the calculator)."""
    _FRONT_ENDS[name] = factory


def front_end(name: str) -> tp.Callable[..., tp.Any]:
    """The factory registered for ``name``; ``RuntimeError`` naming it if none is."""
    try:
        return _FRONT_ENDS[name]
    except KeyError:
        raise RuntimeError(f"no {name!r} front end is registered: import torchani_fast first") from None


class FrontDoor:
    """Eager-only conveniences that :func:`torchani_fast.patch` adds to a model."""

    @torch.jit.unused
    def ase(self, overwrite: bool = False, stress_kind: str = "scaling", jit: bool = False,
            cuda_graphs: bool = True):
        """An ASE calculator (:class:`torchani_fast.ase.Calculator`) for this model.

        Same arguments as ``torchani.arch.ANI.ase``; one model evaluation serves
        energy, forces and stress. ``cuda_graphs=False``: on a GPU, no CUDA graph
        of molecules' steps (docs/cuda.md).
        """
        model = torch.jit.script(self) if jit else self
        return front_end("ase")(model, overwrite=overwrite, stress_kind=stress_kind, cuda_graphs=cuda_graphs)

    @torch.jit.unused
    def energies_forces(self, species, coords, cell=None, pbc=None):
        """Energies (Ha) and forces (Ha/Å); see :func:`torchani_fast.core.energies_forces`."""
        return core.energies_forces(self, species, coords, cell, pbc)


class ValidatedModel:
    """Mixin for patched models: ``_check_inputs`` with real messages.

    ``torchani.arch.ANI`` calls ``self._check_inputs(species, coords, charge)`` at
    the start of every entry point (forward, atomic_energies, energies_qbcs,
    compute_from_neighbors, ...); TorchScript compiles this override in its place.
    """

    def _check_inputs(self, species: Tensor, coords: Tensor, charge: int = 0, values: bool = True) -> None:
        """``values=False``: only what reads no data (see :func:`~torchani_fast.validation.check_inputs`)."""
        reference = self.energy_shifter.self_energies
        check_inputs(species, coords, charge, reference.dtype, reference.device, values)
