"""The models torchani_fast knows: one row per model.

Everything that names a model reads :data:`MODELS`: the factories of
:mod:`torchani_fast.models` (one per row, with the row's docstring), the command
line's ``--model`` (any case), the structure checks made before a model is
loaded (elements, cutoff), OpenMM's ``MLPotential`` names (``openmm``; the
``openmmml.potentials`` entry points are generated from them by ``setup.py``)
and :func:`torchani_fast.models.load`, the one model cache. Adding a model is
one row here (a TorchANI 2.9 factory of that name) and its tests.

Pure Python, no torch: ``setup.py`` reads it before anything is installed.
"""
import math
import typing as tp

__all__ = ["ModelSpec", "MODELS", "by_name", "openmm_names"]

_1X = ("H", "C", "N", "O")
_2X = ("H", "C", "N", "O", "S", "F", "Cl")


class ModelSpec(tp.NamedTuple):
    """One model: how it is built, named and checked."""

    #: ``torchani.models``' factory of this name; also ``torchani_fast.models``' and the CLI's.
    name: str
    #: What the factory's docstring says it is.
    description: str
    #: The element symbols it covers, in its element order.
    elements: tp.Tuple[str, ...]
    #: Its neighbour cutoff in Å (the largest of its potentials; inf: a potential without one).
    cutoff: float
    #: Its ``MLPotential`` name in openmm-ml, or None (not offered there).
    openmm: tp.Optional[str] = None
    #: Keyword arguments its factory takes besides the common ones, with their defaults.
    extra: tp.Tuple[tp.Tuple[str, tp.Any], ...] = ()


MODELS: tp.Tuple[ModelSpec, ...] = (
    ModelSpec("ANI2x", "The ANI-2x ensemble (elements H C N O S F Cl)", _2X, 5.1, "ani2x-fast"),
    ModelSpec("ANI1x", "The ANI-1x ensemble (elements H C N O)", _1X, 5.2, "ani1x-fast"),
    ModelSpec("ANI1ccx", "The ANI-1ccx ensemble (elements H C N O, CCSD(T)*/CBS)", _1X, 5.2, "ani1ccx-fast"),
    ModelSpec("ANI1xnr", "ANI-1xnr (reactive, H C N O)", _1X, 5.2),
    ModelSpec("ANI2xr", "ANI-2xr (ANI-2x data, xTB repulsion, smooth cutoff)", _2X, 5.2, "ani2xr-fast"),
    ModelSpec("ANI2dr", "ANI-2dr (B97-3c, xTB repulsion and D3(BJ) dispersion)", _2X, 8.0, "ani2dr-fast"),
    ModelSpec("ANImbis", "ANImbis (ANI-2x energies and MBIS atomic charges; an ANIq model)", _2X, 5.1),
    ModelSpec("ANIr2s", "ANIr2s (r2SCAN-3c, experimental; solvent=None/'water'/'ch3cn'/'chcl3')", _2X,
              math.inf, extra=(("solvent", None),)),
    ModelSpec("ANIr2s_water", "ANIr2s with SMD water (experimental)", _2X, math.inf),
    ModelSpec("ANIr2s_ch3cn", "ANIr2s with SMD acetonitrile (experimental)", _2X, math.inf),
    ModelSpec("ANIr2s_chcl3", "ANIr2s with SMD chloroform (experimental)", _2X, math.inf),
    ModelSpec("SnnANI2xr", "SnnANI2xr (one shared network, xTB repulsion)", _2X, 5.2),
)

_BY_NAME = {spec.name.lower(): spec for spec in MODELS}


def by_name(name: str) -> ModelSpec:
    """The row of ``name`` (any case); ``ValueError`` listing the known names."""
    try:
        return _BY_NAME[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(s.name for s in MODELS)}") from None


def openmm_names() -> tp.Dict[str, str]:
    """openmm-ml's names -> model names, for the models offered there."""
    return {spec.openmm: spec.name for spec in MODELS if spec.openmm is not None}
