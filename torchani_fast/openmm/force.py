"""The old import path of :mod:`torchani_fast.apps.openmm.force` (the same module)."""
import sys

from ..apps.openmm import force as _module

sys.modules[__name__] = _module
