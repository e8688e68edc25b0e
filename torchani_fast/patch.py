"""``patch(model)``: swap a TorchANI model's featurizer for torchani_fast's.

The model object is modified in place and returned, like ``Module.to``. Every
public entry point of ``torchani.arch.ANI`` keeps working because only the
members that TorchANI calls through are replaced:

- ``model.potentials['nnp'].aev_computer`` -> :class:`torchani_fast.aev.AEVComputer`
  (same ``radial``/``angular`` modules, so the state dict is unchanged);
- ``model.neighborlist`` (shared with the new AEV computer) ->
  :class:`torchani_fast.aev.NeighborList`, used by periodic calls, ASE stress and
  any extra potentials of the model;
- ``model.potentials['nnp'].neural_networks`` -> :class:`torchani_fast.nn.FusedEnsemble`
  (or ``FusedNetworks`` for a single network), which keeps TorchANI's member
  modules, so the state dict is unchanged. Networks that cannot be fused (not
  CELU MLPs, e.g. ``to_infer_model()``'s BmmEnsemble) are left as they are.
- TorchANI's ``RepulsionXTB`` and ``TwoBodyDispersionD3`` (ANI-2xr, ANI-2dr,
  ANIr2s...) -> :mod:`torchani_fast.potentials`' subclasses of them (the class
  is swapped in place: same buffers and state dict), evaluated on the model's
  one neighbour list, which the patched model hands to torchani_fast's AEV and
  pair ops as it is (they skip pairs beyond their cutoff; TorchANI copies the
  list per potential: :class:`torchani_fast.core.ModelCore`).

A part that torchani_fast does not reproduce exactly (an AEV with TorchANI's
smooth cutoff, GELU networks...) stays TorchANI's, fed by torchani_fast's
neighbour list, and patch() says so once per model with a ``UserWarning``
naming the part and the reason; :func:`kept_parts` lists them.
"""
import typing as tp
import warnings
import weakref

import torch
from torchani.arch import ANI, ANIq
from torchani.nn import SpeciesConverter as _TorchaniSpeciesConverter
from torchani.potentials import RepulsionXTB, TwoBodyDispersionD3

from ._front_door import front_door_class, swap_class
from .aev import AEVComputer, NeighborList
from .core import ModelCore, ModelCoreQ
from .mixins import FrontDoor, ValidatedModel
from .nn import (FusedChargeNetworks, _FusedBase, charge_unsupported_reason, fuse_charge_networks,
                 fuse_networks, unsupported_reason)
from .potentials import (FastDispersionD3, FastRepulsionXTB, UnboundedNeighborList, fast_unsupported_reason,
                         set_fast_cutoff)
from .validation import SpeciesConverter

__all__ = ["patch", "is_patched", "kept_parts", "nnp_of", "PATCHED_CLASSES", "PatchedANI", "PatchedANIq"]

# model -> {part: reason} of the parts patch() left as TorchANI's (and warned about).
_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, tp.Dict[str, str]]" = weakref.WeakKeyDictionary()


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` was already patched by torchani_fast (its neighbour
    list is torchani_fast's; see :func:`kept_parts` for what stayed TorchANI's)."""
    nnp = nnp_of(model)
    return isinstance(nnp.aev_computer, AEVComputer) or isinstance(
        getattr(model, "neighborlist", None), NeighborList)


def kept_parts(model: torch.nn.Module) -> tp.Dict[str, str]:
    """The parts of a patched model that are still TorchANI's, with the reason
    (``{}`` when everything runs on torchani_fast's kernels)."""
    return dict(_KEPT.get(model, {}))


def _keep(model: torch.nn.Module, part: str, reason: str) -> None:
    """Record that ``part`` stays TorchANI's; warn the first time for this model."""
    kept = _KEPT.setdefault(model, {})
    if part not in kept:
        kept[part] = reason
        warnings.warn(f"torchani_fast keeps TorchANI's {part} for this model: {reason}",
                      UserWarning, stacklevel=3)


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
    nnp = nnp_of(model)
    if is_patched(model):
        model.neighborlist.set_strategy(neighborlist)
        _patch_parts(model, nnp)
        return model
    # A model with a potential of infinite range (ANIr2s' repulsion) needs all pairs.
    nl = UnboundedNeighborList(neighborlist) if model.cutoff == float("inf") else NeighborList(neighborlist)
    try:
        nnp.aev_computer = AEVComputer.from_torchani(nnp.aev_computer, nl)
    except TypeError as exc:
        if not hasattr(nnp.aev_computer, "neighborlist"):
            raise
        # TorchANI's featurizer, fed by our neighbour search (also on its own calls).
        _keep(model, "AEV computer", str(exc))
        nnp.aev_computer.neighborlist = nl
    model.neighborlist = nl
    swap_class(model.species_converter, SpeciesConverter)
    model.species_converter._init_patched()
    _patch_parts(model, nnp)
    return model


def _patch_parts(model: torch.nn.Module, nnp: torch.nn.Module) -> None:
    _fuse(model, nnp)
    for name, pot in model.potentials.items():
        if name == "nnp":
            continue
        cls = PATCHED_CLASSES.get(type(pot))
        if cls is not None:
            reason = fast_unsupported_reason(pot)
            if reason is not None:
                _keep(model, f"{type(pot).__name__} potential {name!r}", reason)
            else:
                swap_class(pot, cls)
        if isinstance(pot, (FastRepulsionXTB, FastDispersionD3)):
            set_fast_cutoff(pot)
    swap_class(model, _model_class(type(model)))


def _fuse(model: torch.nn.Module, nnp: torch.nn.Module) -> None:
    # Networks that cannot be fused keep TorchANI's modules; fused ones stay as they are.
    if isinstance(nnp.neural_networks, _FusedBase):
        return
    reason = unsupported_reason(nnp.neural_networks)
    if reason is None:
        nnp.neural_networks = fuse_networks(nnp.neural_networks, nnp.aev_computer)
    else:
        _keep(model, "neural networks", reason)
    charges = getattr(nnp, "charge_networks", None)  # ANIq (ANImbis)
    if charges is not None and not isinstance(charges, FusedChargeNetworks):
        reason = charge_unsupported_reason(charges)
        if reason is None:
            nnp.charge_networks = fuse_charge_networks(charges, nnp.aev_computer)
        else:
            _keep(model, "charge networks", reason)


def nnp_of(model: torch.nn.Module) -> torch.nn.Module:
    """The ANI potential of a TorchANI >= 2.5 model (``model.potentials['nnp']``):
    its AEV computer and networks; ``TypeError`` for anything else."""
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("patch() needs the eager TorchANI model; call torch.jit.script after patching")
    potentials = getattr(model, "potentials", None)
    if not isinstance(potentials, torch.nn.ModuleDict) or "nnp" not in potentials:
        raise TypeError(
            "torchani_fast.patch expects a TorchANI >= 2.5 ANI model (with "
            f"model.potentials['nnp']), got {type(model).__name__}"
        )
    return potentials["nnp"]


# --- the class changes ------------------------------------------------------------------------
# patch() changes classes in place from this one mapping (TorchANI 2.2.4's classes:
# torchani_fast.legacy), always through _front_door.swap_class: the model's, its species
# converter's (validation.SpeciesConverter) and its pair potentials' (potentials.Fast*). A patched
# model's class puts torchani_fast's mixins (torchani_fast/mixins.py, core.py) in
# front of its TorchANI class; a user's subclass of ANI or ANIq gets one made on
# first use (_front_door.py, where pickle finds it by name).


def _mixins(base: type) -> tp.Tuple[type, ...]:
    """torchani_fast's classes in front of the TorchANI class ``base`` (ANI, ANIq or a subclass)."""
    return (FrontDoor, ValidatedModel, ModelCoreQ if issubclass(base, ANIq) else ModelCore)


class PatchedANI(*_mixins(ANI), ANI):
    __doc__ = ANI.__doc__


class PatchedANIq(*_mixins(ANIq), ANIq):
    __doc__ = ANIq.__doc__


#: TorchANI's class -> the class patch() gives the object, for the classes written out.
PATCHED_CLASSES: tp.Dict[type, type] = {
    ANI: PatchedANI,
    ANIq: PatchedANIq,
    _TorchaniSpeciesConverter: SpeciesConverter,
    RepulsionXTB: FastRepulsionXTB,
    TwoBodyDispersionD3: FastDispersionD3,
}


def _model_class(base: type) -> type:
    if isinstance(base, type) and issubclass(base, FrontDoor):
        return base  # patched already
    return front_door_class(base, PATCHED_CLASSES, _mixins)


