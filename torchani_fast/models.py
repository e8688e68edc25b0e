"""Ready-to-use patched ANI models (and the energy/forces helpers of :mod:`torchani_fast.evaluate`).

>>> from torchani_fast.models import ANI2x
>>> model = ANI2x(dtype=torch.float64)                  # a patched torchani ANI model
>>> energies, forces = model.energies_forces(species, coords)   # Ha, Ha/Å

The factories take the arguments of ``torchani.models`` and return the same
TorchANI model object, patched by :func:`torchani_fast.patch`, so every TorchANI
entry point (``forward``, ``atomic_energies``, ``energies_qbcs``, ``ase``,
``torch.jit.script``...) keeps working. Weights are read by TorchANI from
``$TORCHANI_DATA_DIR/StateDicts`` (set ``HF_HUB_OFFLINE=1`` on machines
without network access).
"""
import typing as tp

import torch

from .aev import AEVComputer
from .evaluate import (EnergiesForces, EnergiesForcesHessians, energies_forces,  # noqa: F401
                       energies_forces_hessians)
from .patch import patch

_STRATEGIES = ("auto", "pyaev", "cuaev", "cuaev-fused", "cuaev-interface", "torchani_fast")

__all__ = ["ANI2x", "ANI1x", "ANI1ccx", "ANI1xnr", "ANI2xr", "ANI2dr", "ANImbis", "ANIr2s",
           "ANIr2s_water", "ANIr2s_ch3cn", "ANIr2s_chcl3", "SnnANI2xr", "EnergiesForces",
           "EnergiesForcesHessians", "energies_forces", "energies_forces_hessians", "MODELS"]

# TorchANI's neighbour-list names -> torchani_fast's strategies. A patched model
# always searches neighbours with torchani_fast's op; "adaptive" (TorchANI's
# size-based switch) is what "auto" does.
_NEIGHBORLISTS = {
    "auto": "auto",
    "adaptive": "auto",
    "all_pairs": "all_pairs",
    "cell_list": "cell_list",
}


def _build(name: str, model_index: tp.Optional[int], neighborlist: str, strategy: str,
           periodic_table_index: bool, device, dtype, **extra) -> torch.nn.Module:
    import torchani.models

    if neighborlist not in _NEIGHBORLISTS:
        raise ValueError(
            f"neighborlist must be one of {sorted(_NEIGHBORLISTS)}, got {neighborlist!r} "
            "(a patched model always uses torchani_fast's neighbour search)"
        )
    factory = getattr(torchani.models, name)
    # TorchANI builds its own featurizer with strategy "pyaev"; patch() then
    # replaces it, so the strategy only has to be a name TorchANI knows.
    model = factory(model_index=model_index, neighborlist="all_pairs", strategy="pyaev",
                    periodic_table_index=periodic_table_index, device=device, dtype=dtype, **extra)
    model = patch(model, neighborlist=_NEIGHBORLISTS[neighborlist])
    aev = model.potentials["nnp"].aev_computer
    if isinstance(aev, AEVComputer):
        aev.set_strategy(strategy)  # validates the name
    elif strategy not in _STRATEGIES:
        # TorchANI's featurizer kept (see patch.kept_parts): it runs as "pyaev".
        raise ValueError(f"Unknown compute strategy {strategy!r}; one of {list(_STRATEGIES)}")
    return model


def ANI2x(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
          strategy: str = "pyaev", periodic_table_index: bool = True,
          device: tp.Union[str, torch.device, None] = None,
          dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    """The ANI-2x ensemble (elements H C N O S F Cl), patched by torchani_fast.

    Parameters
    ----------
    model_index : int, optional
        Use only member ``model_index`` (0-7) of the 8-network ensemble; by
        default the whole ensemble (mean energy).
    neighborlist : {"auto", "all_pairs", "cell_list", "adaptive"}
        Neighbour search of the patched model; "auto" ("adaptive" is an alias)
        uses all pairs for small molecules and a cell list for large ones.
    strategy : str
        Accepted for compatibility with ``torchani.models``; any TorchANI AEV
        strategy name ("pyaev", "cuaev", "auto", ...) is valid and a patched
        model always uses torchani_fast's kernels.
    periodic_table_index : bool
        If True (default), ``species`` are atomic numbers; if False, indices
        into the model's element list (H=0, C=1, N=2, O=3, S=4, F=5, Cl=6).
    device : str or torch.device, optional
        Where the model lives ("cpu", "cuda", "cuda:1"); default CPU.
    dtype : torch.dtype, optional
        ``torch.float32`` (default, TorchANI's) or ``torch.float64``.

    Returns
    -------
    torchani.arch.ANI
        A TorchANI model, patched in place; see :func:`torchani_fast.patch`.
        It also has ``model.ase()`` (a :class:`torchani_fast.ase.Calculator`)
        and ``model.energies_forces(species, coords, cell=None, pbc=None)``.

    Raises
    ------
    ValueError
        For an unknown ``neighborlist`` or ``strategy``.
    """
    return _build("ANI2x", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def ANI1x(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
          strategy: str = "pyaev", periodic_table_index: bool = True,
          device: tp.Union[str, torch.device, None] = None,
          dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    """The ANI-1x ensemble (elements H C N O), patched by torchani_fast.

    Parameters and return value are those of :func:`ANI2x`; with
    ``periodic_table_index=False`` the element indices are H=0, C=1, N=2, O=3.
    """
    return _build("ANI1x", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def ANI1ccx(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
            strategy: str = "pyaev", periodic_table_index: bool = True,
            device: tp.Union[str, torch.device, None] = None,
            dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    """The ANI-1ccx ensemble (elements H C N O, CCSD(T)*/CBS), patched by torchani_fast.

    Parameters and return value are those of :func:`ANI2x`; with
    ``periodic_table_index=False`` the element indices are H=0, C=1, N=2, O=3.
    """
    return _build("ANI1ccx", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


_NEWER = """

    TorchANI 2.9's model of this name (same arguments, same elements), patched by
    torchani_fast. Parts that torchani_fast does not reproduce exactly yet stay
    TorchANI's, fed by torchani_fast's neighbour list, and the first build warns
    once naming them (:func:`torchani_fast.patch.kept_parts`). The arguments and
    return value are those of :func:`ANI2x`.
"""


def ANI1xnr(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
            strategy: str = "pyaev", periodic_table_index: bool = True,
            device: tp.Union[str, torch.device, None] = None,
            dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    return _build("ANI1xnr", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def ANI2xr(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
           strategy: str = "pyaev", periodic_table_index: bool = True,
           device: tp.Union[str, torch.device, None] = None,
           dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    return _build("ANI2xr", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def ANI2dr(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
           strategy: str = "pyaev", periodic_table_index: bool = True,
           device: tp.Union[str, torch.device, None] = None,
           dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    return _build("ANI2dr", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def ANImbis(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
            strategy: str = "pyaev", periodic_table_index: bool = True,
            device: tp.Union[str, torch.device, None] = None,
            dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    return _build("ANImbis", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def ANIr2s(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
           strategy: str = "pyaev", periodic_table_index: bool = True,
           device: tp.Union[str, torch.device, None] = None,
           dtype: tp.Optional[torch.dtype] = None,
           solvent: tp.Optional[str] = None) -> torch.nn.Module:
    return _build("ANIr2s", model_index, neighborlist, strategy, periodic_table_index, device, dtype,
                  solvent=solvent)


def ANIr2s_water(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
                 strategy: str = "pyaev", periodic_table_index: bool = True,
                 device: tp.Union[str, torch.device, None] = None,
                 dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    return _build("ANIr2s_water", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def ANIr2s_ch3cn(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
                 strategy: str = "pyaev", periodic_table_index: bool = True,
                 device: tp.Union[str, torch.device, None] = None,
                 dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    return _build("ANIr2s_ch3cn", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def ANIr2s_chcl3(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
                 strategy: str = "pyaev", periodic_table_index: bool = True,
                 device: tp.Union[str, torch.device, None] = None,
                 dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    return _build("ANIr2s_chcl3", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


def SnnANI2xr(model_index: tp.Optional[int] = None, neighborlist: str = "auto",
              strategy: str = "pyaev", periodic_table_index: bool = True,
              device: tp.Union[str, torch.device, None] = None,
              dtype: tp.Optional[torch.dtype] = None) -> torch.nn.Module:
    return _build("SnnANI2xr", model_index, neighborlist, strategy, periodic_table_index, device, dtype)


for _f, _what in ((ANI1xnr, "ANI-1xnr (reactive, H C N O)"),
                  (ANI2xr, "ANI-2xr (ANI-2x data, xTB repulsion, smooth cutoff)"),
                  (ANI2dr, "ANI-2dr (B97-3c, xTB repulsion and D3(BJ) dispersion)"),
                  (ANImbis, "ANImbis (ANI-2x energies and MBIS atomic charges; an ANIq model)"),
                  (ANIr2s, "ANIr2s (r2SCAN-3c, experimental; solvent=None/'water'/'ch3cn'/'chcl3')"),
                  (ANIr2s_water, "ANIr2s with SMD water (experimental)"),
                  (ANIr2s_ch3cn, "ANIr2s with SMD acetonitrile (experimental)"),
                  (ANIr2s_chcl3, "ANIr2s with SMD chloroform (experimental)"),
                  (SnnANI2xr, "SnnANI2xr (one shared network, xTB repulsion)")):
    _f.__doc__ = f"The {_what} model, patched by torchani_fast." + _NEWER
del _f, _what

#: The model factories by name, as accepted by the ``torchani-fast --model`` option.
MODELS: tp.Dict[str, tp.Callable[..., torch.nn.Module]] = {
    "ANI2x": ANI2x, "ANI1x": ANI1x, "ANI1ccx": ANI1ccx, "ANI1xnr": ANI1xnr, "ANI2xr": ANI2xr,
    "ANI2dr": ANI2dr, "ANImbis": ANImbis, "ANIr2s": ANIr2s, "ANIr2s_water": ANIr2s_water,
    "ANIr2s_ch3cn": ANIr2s_ch3cn, "ANIr2s_chcl3": ANIr2s_chcl3, "SnnANI2xr": SnnANI2xr,
}
