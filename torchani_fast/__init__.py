"""torchani_fast: exact, fast custom ops for TorchANI models.

>>> import torchani, torchani_fast
>>> model = torchani_fast.patch(torchani.models.ANI2x())
"""
def _check_not_source_tree() -> None:
    """Refuse, by name, a source checkout that shadows the installed package.

    ``python -c "import torchani_fast"`` run from the repository root imports
    the checkout's ``torchani_fast/`` (the current directory comes first on
    ``sys.path``), which has no compiled ``_C`` unless it was built in place;
    without this check the import fails later with a misleading error.
    """
    import importlib.util
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if not (os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc"))):
        return  # an installed copy (wheel): a missing _C is reported below
    if importlib.util.find_spec(__name__ + "._C") is not None:
        return  # built in place, or an editable install
    raise ImportError(
        f"torchani_fast: you are importing the source tree at {here} (the current directory "
        "or PYTHONPATH puts the repository before the installed package), which has no "
        "compiled ops (torchani_fast._C). Run Python from another directory to use the "
        "installed torchani_fast, or build the checkout in place: "
        "`pip install --no-build-isolation -e .`"
    )


_check_not_source_tree()

import torch  # noqa: E402,F401  (loads libtorch, which _C links against)

from .compat import LEGACY_TORCHANI, SUPPORTED_TORCHANI, __version__  # noqa: E402
from .compat import LEGACY as _LEGACY  # noqa: E402
from .compat import check_torchani_version as _check_torchani_version  # noqa: E402,F401

try:
    from . import _C  # noqa: F401  (registers torch.ops.torchani_fast.*)
except ImportError as exc:  # keep the real reason: a missing build, an ABI mismatch...
    raise ImportError(
        "torchani_fast: the compiled ops (torchani_fast._C) could not be loaded: "
        f"{exc}. Build them with `pip install --no-build-isolation .` against the "
        "torch you run with."
    ) from exc

from . import ops  # noqa: E402,F401  (fake kernels)
from .workspace import Workspace  # noqa: E402

if _LEGACY:
    # TorchANI 2.2.4: patch() and the AEV computer of torchani_fast.legacy; the
    # rest of the package is written against TorchANI >= 2.7's modules.
    from .legacy import AEVComputer, is_patched, patch  # noqa: E402

    _NEEDS_MODERN = ("grad", "EnergyForcesStep", "screen", "models")

    def __getattr__(name: str):
        if name in _NEEDS_MODERN:
            raise AttributeError(
                f"torchani_fast.{name} needs TorchANI {SUPPORTED_TORCHANI}; with TorchANI "
                f"{LEGACY_TORCHANI} torchani_fast offers patch() (torchani_fast.legacy)")
        raise AttributeError(f"module 'torchani_fast' has no attribute {name!r}")
else:
    from .aev import AEVComputer  # noqa: E402
    from .patch import is_patched, patch  # noqa: E402
    from . import grad, models  # noqa: E402  (energies_forces_and_hessians; the factories)
    from .step import EnergyForcesStep  # noqa: E402
    from .screen import screen  # noqa: E402  (the function; the module is torchani_fast.apps.screen)

    # The library imports no application: model.ase() builds what is registered here.
    from .mixins import register_front_end as _register_front_end  # noqa: E402

    def _ase_calculator(model, **kwargs):
        from .apps.ase import Calculator

        return Calculator(model, **kwargs)

    _register_front_end("ase", _ase_calculator)

__all__ = ["AEVComputer", "EnergyForcesStep", "Workspace", "patch", "is_patched", "ops", "grad", "models",
           "cpu_isa", "screen", "__version__"]

_ISA_LEVELS = ("none", "avx2", "avx512")


def cpu_isa(cap: "str | None" = None) -> str:
    """The instruction set the CPU kernels use: ``"avx512"`` (the networks'
    matrix products, the AEV's exp and log, the neighbour search; the rest as
    avx2), ``"avx2"`` (AVX2 + FMA) or ``"none"``
    (portable C++), the best this CPU has unless capped.

    ``cpu_isa("avx2")`` caps it from now on (``"avx512"`` lifts the cap), for
    comparisons and debugging; results agree to float rounding across levels.
    Change it between calls, not while other threads run ops. The environment
    variable ``TORCHANI_FAST_CPU_ISA`` sets the cap at import.
    """
    if cap is not None and cap not in _ISA_LEVELS:
        raise ValueError(f"cpu_isa: cap must be one of {_ISA_LEVELS}, got {cap!r}")
    return _ISA_LEVELS[_C.simd_level(-1 if cap is None else _ISA_LEVELS.index(cap))]


def _cap_from_environment() -> None:
    import os

    cap = os.environ.get("TORCHANI_FAST_CPU_ISA")
    if cap:
        try:
            cpu_isa(cap.strip().lower())
        except ValueError as exc:
            raise ValueError(f"TORCHANI_FAST_CPU_ISA={cap!r}: {exc}") from None


_cap_from_environment()
