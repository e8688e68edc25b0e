"""The old import path of :mod:`torchani_fast.apps.openmm.mlpotential` (the same module)."""
import sys

from ..apps.openmm import mlpotential as _module

sys.modules[__name__] = _module
