"""The old import path of :mod:`torchani_fast.apps.openmm.torchforce` (the same module)."""
import sys

from ..apps.openmm import torchforce as _module

sys.modules[__name__] = _module
