"""The short path of :mod:`torchani_fast.apps.torchsim` (the same module)."""
import sys

from .apps import torchsim as _module

sys.modules[__name__] = _module
