"""torchani_fast: exact, fast custom ops for TorchANI models.

>>> import torchani, torchani_fast
>>> model = torchani_fast.patch(torchani.models.ANI2x())
"""
import torch  # noqa: F401  (loads libtorch, which _C links against)

try:
    from . import _C  # noqa: F401  (registers torch.ops.torchani_fast.*)
except ImportError as exc:  # keep the real reason: a missing build, an ABI mismatch...
    raise ImportError(
        "torchani_fast: the compiled ops (torchani_fast._C) could not be loaded: "
        f"{exc}. Build them with `pip install --no-build-isolation .` against the "
        "torch you run with."
    ) from exc

from . import ops  # noqa: E402,F401  (fake kernels)
from .aev import AEVComputer  # noqa: E402
from .patch import is_patched, patch  # noqa: E402
from . import grad  # noqa: E402  (energies_forces_and_hessians)
from .step import EnergyForcesStep  # noqa: E402

__version__ = "0.1.0"
__all__ = ["AEVComputer", "EnergyForcesStep", "patch", "is_patched", "ops", "grad", "__version__"]
