"""``patch(model)``: swap a TorchANI model's featurizer for torchani_fast's.

The model object is modified in place and returned, like ``Module.to``. Every
public entry point of ``torchani.arch.ANI`` keeps working because only the
members that TorchANI calls through are replaced:

- ``model.potentials['nnp'].aev_computer`` -> :class:`torchani_fast.aev.AEVComputer`
  (same ``radial``/``angular`` modules, so the state dict is unchanged);
- ``model.neighborlist`` (shared with the new AEV computer) ->
  :class:`torchani_fast.aev.NeighborList`, used by periodic calls, ASE stress and
  any extra potentials of the model.
"""
import torch

from .aev import AEVComputer, NeighborList

__all__ = ["patch", "is_patched"]


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` was already patched by torchani_fast."""
    nnp = _nnp(model)
    return isinstance(nnp.aev_computer, AEVComputer)


def patch(model: torch.nn.Module, neighborlist: str = "auto") -> torch.nn.Module:
    """Make a TorchANI model use torchani_fast's compiled kernels.

    Parameters
    ----------
    model : torchani.arch.ANI
        A TorchANI >= 2.5 ANI model (``ANI2x()``, ``ANI1x()``, ``ANI1ccx()``,
        ``model_index=i``, ``model[i]``, any dtype or device) whose AEV uses
        ``ANIRadial`` + ``ANIAngular`` with the cosine cutoff.
    neighborlist : {"auto", "all_pairs", "cell_list"}
        Neighbour search strategy; "auto" switches to the O(N) cell list for
        large molecules.

    Returns
    -------
    The same model object, patched in place. Patching twice is harmless.

    Raises
    ------
    TypeError
        If the model is not a TorchANI ANI model or its featurizer is of a kind
        torchani_fast does not reproduce exactly (the message names it).
    """
    nnp = _nnp(model)
    if isinstance(nnp.aev_computer, AEVComputer):
        nnp.aev_computer.neighborlist.set_strategy(neighborlist)
        return model
    nl = NeighborList(neighborlist)
    nnp.aev_computer = AEVComputer.from_torchani(nnp.aev_computer, nl)
    model.neighborlist = nl
    return model


def _nnp(model: torch.nn.Module) -> torch.nn.Module:
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("patch() needs the eager TorchANI model; call torch.jit.script after patching")
    potentials = getattr(model, "potentials", None)
    if not isinstance(potentials, torch.nn.ModuleDict) or "nnp" not in potentials:
        raise TypeError(
            "torchani_fast.patch expects a TorchANI >= 2.5 ANI model (with "
            f"model.potentials['nnp']), got {type(model).__name__}"
        )
    return potentials["nnp"]
