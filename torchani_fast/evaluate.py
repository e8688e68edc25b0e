"""The old import path of :mod:`torchani_fast.core` (the same module)."""
import sys

from . import core as _module

sys.modules[__name__] = _module
