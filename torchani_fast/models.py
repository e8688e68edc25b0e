"""Ready-to-use patched ANI models (and the energy/forces helpers of :mod:`torchani_fast.core`).

>>> from torchani_fast.models import ANI2x
>>> model = ANI2x(dtype=torch.float64)                  # a patched torchani ANI model
>>> energies, forces = model.energies_forces(species, coords)   # Ha, Ha/Å

The factories take the arguments of ``torchani.models`` and return the same
TorchANI model object, patched by :func:`torchani_fast.patch`, so every TorchANI
entry point (``forward``, ``atomic_energies``, ``energies_qbcs``, ``ase``,
``torch.jit.script``...) keeps working. There is one factory per row of
:data:`torchani_fast.registry.MODELS`, and :func:`load` keeps one model per
arguments for the front ends (command line, OpenMM, screening workers). Weights are read by TorchANI from
``$TORCHANI_DATA_DIR/StateDicts`` (set ``HF_HUB_OFFLINE=1`` on machines
without network access).
"""
import inspect
import threading
import typing as tp

import torch

from . import registry
from .aev import AEVComputer
from .core import EnergiesForces, EnergiesForcesHessians, energies_forces  # noqa: F401
from .grad import energies_forces_hessians  # noqa: F401
from .patch import patch

_STRATEGIES = ("auto", "pyaev", "cuaev", "cuaev-fused", "cuaev-interface", "torchani_fast")

__all__ = [spec.name for spec in registry.MODELS] + [
    "EnergiesForces", "EnergiesForcesHessians", "energies_forces", "energies_forces_hessians", "MODELS", "load"]

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


# TorchANI's factories' arguments, in their order (a row's extra ones follow).
_COMMON: tp.Tuple[tp.Tuple[str, tp.Any], ...] = (
    ("model_index", None), ("neighborlist", "auto"), ("strategy", "pyaev"), ("periodic_table_index", True),
    ("device", None), ("dtype", None))

_DOC = """{description}, patched by torchani_fast.

    Parameters
    ----------
    model_index : int, optional
        Use only member ``model_index`` of the ensemble; by default the whole
        ensemble (mean energy).
    neighborlist : {{"auto", "all_pairs", "cell_list", "adaptive"}}
        Neighbour search of the patched model; "auto" ("adaptive" is an alias)
        uses all pairs for small molecules and a cell list for large ones.
    strategy : str
        Accepted for compatibility with ``torchani.models``; any TorchANI AEV
        strategy name ("pyaev", "cuaev", "auto", ...) is valid and a patched
        model always uses torchani_fast's kernels.
    periodic_table_index : bool
        If True (default), ``species`` are atomic numbers; if False, indices
        into the model's element list ({indices}).
    device : str or torch.device, optional
        Where the model lives ("cpu", "cuda", "cuda:1"); default CPU.
    dtype : torch.dtype, optional
        ``torch.float32`` (default, TorchANI's) or ``torch.float64``.{extra}

    Returns
    -------
    torchani.arch.ANI
        TorchANI's model of this name, patched in place; see
        :func:`torchani_fast.patch`. It also has ``model.ase()`` (a
        :class:`torchani_fast.ase.Calculator`) and
        ``model.energies_forces(species, coords, cell=None, pbc=None)``. Parts
        that torchani_fast does not reproduce exactly stay TorchANI's, fed by
        torchani_fast's neighbour list, and the first build warns once naming
        them (:func:`torchani_fast.patch.kept_parts`).

    Raises
    ------
    ValueError
        For an unknown ``neighborlist`` or ``strategy``.
    """


def _factory(spec: registry.ModelSpec) -> tp.Callable[..., torch.nn.Module]:
    """The factory of one registry row: TorchANI's arguments (and the row's extra ones), in its order."""
    signature = inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
                                   for name, default in _COMMON + spec.extra])

    def factory(*args, **kwargs) -> torch.nn.Module:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{spec.name}(): {exc}") from None
        bound.apply_defaults()
        a = dict(bound.arguments)
        common = [a.pop(name) for name, _ in _COMMON]
        return _build(spec.name, *common, **a)

    factory.__signature__ = signature
    indices = ", ".join(f"{e}={i}" for i, e in enumerate(spec.elements))
    extra_doc = "".join(f"\n    {k} : optional\n        Passed to ``torchani.models.{spec.name}`` "
                        f"(default {v!r})." for k, v in spec.extra)
    factory.__name__ = factory.__qualname__ = spec.name
    factory.__module__ = __name__
    factory.__doc__ = _DOC.format(description=spec.description, indices=indices, extra=extra_doc)
    return factory


#: The model factories by name (``registry.MODELS``' names).
MODELS: tp.Dict[str, tp.Callable[..., torch.nn.Module]] = {spec.name: _factory(spec) for spec in registry.MODELS}
globals().update(MODELS)

_LOADED: tp.Dict[tuple, torch.nn.Module] = {}
_LOAD_LOCK = threading.Lock()


def load(name: str, *, model_index: tp.Optional[int] = None, dtype: torch.dtype = torch.float32,
         device: tp.Union[str, torch.device] = "cpu") -> torch.nn.Module:
    """The patched model ``name`` (any case), built once per process and arguments.

    The one model cache of the front ends (command line, OpenMM forces,
    screening workers): they share the model read-only. Build your own with
    the factories when you change a model (weights, members, dtype).
    """
    spec = registry.by_name(name)
    key = cache_key(spec.name, model_index=model_index, dtype=dtype, device=device)
    with _LOAD_LOCK:
        if key not in _LOADED:
            _LOADED[key] = MODELS[spec.name](model_index=model_index, dtype=dtype, device=device)
        return _LOADED[key]


def cache_key(name: str, *, model_index: tp.Optional[int] = None, dtype: torch.dtype = torch.float32,
              device: tp.Union[str, torch.device] = "cpu") -> tuple:
    """The key of :func:`load`'s cache for these arguments (tests put their own models there)."""
    return (registry.by_name(name).name, model_index, dtype, str(torch.device(device)))
